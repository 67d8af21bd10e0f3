"""Data: token files, JSONL with a local tokenizer, packing, seeded shuffling, held-out split, exact cursor resume."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatrain.data.filetokens import FileTokens
from megatrain.train.config import DataConfig
from megatrain.data.batches import (
    CORPUS_PATH,
    ByteTokenizer,
    DataError,
    TrainLoader,
    Windows,
    open_data,
    read_bin,
    read_jsonl,
)


def cfg(**kw) -> DataConfig:
    base = dict(seq_len=16, batch_size=4, eval_fraction=0.0)
    return DataConfig(**{**base, **kw})


def write_bin(path, tokens, dtype="uint16"):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def make_tokenizer(path, words: list[str]):
    """A word-level tokenizer.json built locally: id i is words[i]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_bundled_corpus_is_byte_tokens_with_a_readme():
    size = CORPUS_PATH.stat().st_size
    assert 100_000 <= size <= 300_000
    assert "License" in (CORPUS_PATH.parent / "README.md").read_text()
    data = open_data(DataConfig(seq_len=64, batch_size=8), vocab_size=256)
    raw = CORPUS_PATH.read_bytes()
    # The held-out split is the last 5% of the bytes, the rest is training text.
    assert len(data.train.windows.stream) + len(data.eval.stream) == len(raw)
    assert bytes(data.eval.stream.tokens[:100]) == raw[len(data.train.windows.stream):][:100]
    batch = data.train.next_batch()
    assert batch.inputs.shape == batch.targets.shape == (8, 64) and batch.inputs.dtype == torch.int64
    row = bytes(batch.inputs[0].tolist())
    assert raw.find(row) % 64 == 0  # a window of the corpus, at a multiple of seq_len
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("naïve café")) == "naïve café" and len(tok.encode("é")) == 2


def test_packing_gives_next_token_targets(tmp_path):
    tokens = np.arange(1000) % 251
    data = open_data(cfg(path=str(write_bin(tmp_path / "t.bin", tokens)), shuffle=False), vocab_size=256)
    w = data.train.windows
    assert len(w) == (1000 - 1) // 16
    b = data.train.next_batch()
    for row in range(4):  # unshuffled: window i starts at token 16 i
        assert b.inputs[row].tolist() == tokens[16 * row:16 * row + 16].tolist()
        assert b.targets[row].tolist() == tokens[16 * row + 1:16 * row + 17].tolist()


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_files_are_read_from_disk_window_by_window(tmp_path, dtype):
    tokens = np.random.default_rng(0).integers(0, 70_000 if dtype == "uint32" else 50_000, 5000)
    path = write_bin(tmp_path / "train.bin", tokens, dtype)
    stream = read_bin(path, dtype)
    assert isinstance(stream.tokens, FileTokens) and stream.tokens.dtype == np.dtype(dtype)  # not in memory
    data = open_data(cfg(path=str(path), dtype=dtype, shuffle=False), vocab_size=70_000)
    assert data.train.next_batch().inputs[0].tolist() == tokens[:16].tolist()


def test_nanogpt_directory_uses_val_bin_as_held_out(tmp_path):
    write_bin(tmp_path / "train.bin", np.full(400, 7))
    write_bin(tmp_path / "val.bin", np.full(100, 9))
    data = open_data(cfg(path=str(tmp_path), eval_fraction=0.5), vocab_size=256)
    assert len(data.train.windows.stream) == 400  # no fraction split off when val.bin exists
    evals = list(data.eval_batches(10, batch_size=2))
    assert len(evals) == 3 and all((b.inputs == 9).all() for b in evals)


def test_wrong_dtype_size_and_too_little_data_are_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin has 3 bytes, not a multiple of 2"):
        open_data(cfg(path=str(tmp_path / "odd.bin")), vocab_size=256)
    write_bin(tmp_path / "short.bin", np.arange(40))
    with pytest.raises(DataError, match=r"short\.bin: 2 windows of 17 tokens cannot fill one batch of 4"):
        open_data(cfg(path=str(tmp_path / "short.bin")), vocab_size=256)


def test_out_of_range_token_names_file_and_position(tmp_path):
    tokens = np.arange(3000) % 200
    tokens[1234] = 300
    path = write_bin(tmp_path / "bad.bin", tokens)
    with pytest.raises(DataError, match=r"token id 300 at .*bad\.bin, token 1234 is >= the model's vocab_size 256"):
        open_data(cfg(path=str(path)), vocab_size=256)
    # In the held-out tail the position is still the file's.
    tokens[1234] = 5
    tokens[2990] = 256
    write_bin(path, tokens)
    with pytest.raises(DataError, match=r"token 2990 "):
        open_data(cfg(path=str(path), eval_fraction=0.1), vocab_size=256)
    assert open_data(cfg(path=str(path), eval_fraction=0.1), vocab_size=257).eval is not None


def test_jsonl_with_a_local_tokenizer(tmp_path):
    words = ["<unk>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog"]
    tok = make_tokenizer(tmp_path / "tokenizer.json", words)
    docs = ["the cat sat on the mat", "a dog sat", "the dog sat on a cat"] * 10
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)) + "\n")
    stream = read_jsonl(jsonl, tok, eos_token="</s>")
    expected = [i for d in docs for i in [words.index(w) for w in d.split()] + [1]]
    assert stream.tokens.tolist() == expected
    data = open_data(cfg(path=str(jsonl), tokenizer=str(tok), eos_token="</s>", seq_len=8, shuffle=False),
                     vocab_size=len(words))
    assert data.train.next_batch().inputs[0].tolist() == expected[:8]
    with pytest.raises(DataError, match="not a token"):
        read_jsonl(jsonl, tok, eos_token="<eos>")
    with pytest.raises(DataError, match=r"line 1: no string field 'body'"):
        read_jsonl(jsonl, tok, text_key="body")


def test_jsonl_out_of_range_token_names_the_line(tmp_path):
    words = ["<unk>"] + [f"w{i}" for i in range(299)]
    tok = make_tokenizer(tmp_path / "tokenizer.json", words)
    lines = [{"text": "w1 w2 w3"}, {"text": "w4 w5"}, {}, {"text": "w6 w298 w7"}]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) if x else "" for x in lines) + "\n")  # line 3 is blank
    with pytest.raises(DataError, match=r"token id 299 at .*docs\.jsonl, line 4 \(token 6\)"):
        open_data(cfg(path=str(jsonl), tokenizer=str(tok), seq_len=2, batch_size=1), vocab_size=256)


def test_shuffling_is_seeded_and_visits_every_window_once_per_epoch(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.arange(16 * 40 + 1) % 256)

    def first_tokens(seed, batches):
        loader = open_data(cfg(path=str(path), seed=seed), vocab_size=256).train
        return [loader.next_batch().inputs[:, 0].tolist() for _ in range(batches)]

    a, b, c = first_tokens(0, 10), first_tokens(0, 10), first_tokens(1, 10)
    assert a == b and a != c
    epoch = sorted(t for batch in a for t in batch)  # 40 windows, 4 per batch: 10 batches = one epoch
    assert epoch == sorted((16 * i) % 256 for i in range(40))
    assert first_tokens(0, 20)[10:] != a  # the next epoch has another order


def test_cursor_resume_gives_the_identical_batch_sequence(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.random.default_rng(3).integers(0, 256, 16 * 23 + 1))
    c = cfg(path=str(path), batch_size=3)
    run = open_data(c, vocab_size=256).train
    for _ in range(11):  # 7 batches per epoch: the saved cursor is inside the second epoch
        run.next_batch()
    saved = json.loads(json.dumps(run.state_dict()))
    expected = [run.next_batch() for _ in range(12)]
    resumed = open_data(c, vocab_size=256).train
    resumed.load_state_dict(saved)
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)


def test_cursor_from_other_data_is_refused(tmp_path):
    path = write_bin(tmp_path / "t.bin", np.arange(16 * 30 + 1) % 256)
    saved = open_data(cfg(path=str(path)), vocab_size=256).train.state_dict()
    other = open_data(cfg(path=str(path), batch_size=5), vocab_size=256).train
    with pytest.raises(DataError, match="batch_size=4 but this run's data has 5"):
        other.load_state_dict(saved)


def test_eval_batches_are_fixed_and_held_out(tmp_path):
    tokens = np.concatenate([np.full(900, 1), np.full(100, 2)])
    data = open_data(cfg(path=str(write_bin(tmp_path / "t.bin", tokens)), eval_fraction=0.1), vocab_size=256)
    first = [b.inputs for b in data.eval_batches(2)]
    again = [b.inputs for b in data.eval_batches(2)]
    assert len(first) == 1 and all(torch.equal(x, y) for x, y in zip(first, again))  # 6 windows: one batch of 4
    assert (first[0] == 2).all()
    for _ in range(60):  # training never sees held-out tokens
        assert (data.train.next_batch().targets == 1).all()


def test_windows_of_a_loader_match_the_stream():
    from megatrain.data.batches import TokenStream

    s = TokenStream(np.arange(100, dtype=np.uint16), "mem")
    loader = TrainLoader(Windows(s, 9), batch_size=2, seed=5)
    b = loader.next_batch()
    starts = b.inputs[:, 0]
    assert torch.equal(b.inputs, starts[:, None] + torch.arange(9)) and (starts % 9 == 0).all()
