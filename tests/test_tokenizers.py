"""Which tokenizer a run's data gets (megatrain/data/tokenization.py): never a silent mismatch."""
from __future__ import annotations

import json

import pytest

from megatrain.train.config import DataConfig, ModelConfig, load_config
from megatrain.data.batches import DataError, open_data
from megatrain.data.tokenization import resolve_tokenizer

WORDS = ["<unk>", "the", "layer", "streams", "weights", "host", "memory", "</s>"]


def word_tokenizer(path, words=WORDS):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def hf_dir(path, with_tokenizer=True):
    """A HF-shaped directory: config.json (what the tokenizer rule looks at) and maybe tokenizer.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    if with_tokenizer:
        word_tokenizer(path / "tokenizer.json")
    return path


def text_file(path, words=50):
    path.write_text(" ".join(WORDS[1 + i % 6] for i in range(words)))
    return path


def data(path, **kw):
    return DataConfig(path=str(path), seq_len=8, batch_size=1, eval_fraction=0.0, **kw)


def test_a_hf_directorys_own_tokenizer_is_used_for_text(tmp_path):
    model = ModelConfig(name=str(hf_dir(tmp_path / "m")))
    d = open_data(data(text_file(tmp_path / "a.txt")), 300, model)
    assert d.tokenizer.path == tmp_path / "m" / "tokenizer.json" and d.tokenizer.files_dir == tmp_path / "m"
    assert int(d.train.windows.stream.tokens.max()) < len(WORDS)  # word ids, not bytes
    assert "tokenizer " + str(tmp_path / "m" / "tokenizer.json") in d.describe()


def test_pretrained_directory_without_tokenizer_needs_an_explicit_choice(tmp_path):
    model = ModelConfig(name=str(hf_dir(tmp_path / "m", with_tokenizer=False)))
    txt = text_file(tmp_path / "a.txt")
    with pytest.raises(DataError, match="has no tokenizer.json.*data.tokenizer='bytes'"):
        open_data(data(txt), 300, model)
    d = open_data(data(txt, tokenizer="bytes"), 300, model)  # the explicit choice
    assert d.tokenizer.is_bytes and int(d.train.windows.stream.tokens.max()) > len(WORDS)
    # Random init from the directory's shape has no trained embeddings to mismatch: bytes by default.
    assert open_data(data(txt), 300, ModelConfig(name=model.name, init="random")).tokenizer.is_bytes
    # A preset: bytes, as before.
    assert open_data(data(txt), 256, ModelConfig()).tokenizer.is_bytes


def test_data_tokenizer_accepts_a_directory_and_says_when_it_has_none(tmp_path):
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    word_tokenizer(tok_dir / "tokenizer.json")
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": "the layer streams weights"}) for _ in range(10)) + "\n")
    d = open_data(data(jsonl, tokenizer=str(tok_dir), eos_token="</s>"), 300)
    assert d.tokenizer.files_dir == tok_dir and list(d.train.windows.stream.tokens[:5]) == [1, 2, 3, 4, 7]
    with pytest.raises(DataError, match="is a directory without tokenizer.json"):
        open_data(data(jsonl, tokenizer=str(tmp_path)), 300)
    with pytest.raises(DataError, match="JSONL: set data.tokenizer"):
        open_data(data(jsonl), 300)
    # The config accepts "bytes" and a directory, and says what to give when the path is wrong.
    assert load_config(None, ["data.tokenizer=bytes"]).data.tokenizer == "bytes"
    with pytest.raises(Exception, match="or 'bytes'"):
        load_config(None, [f"data.tokenizer={tmp_path / 'nope'}"])


def test_another_vocabulary_than_the_pretrained_models_is_refused(tmp_path):
    model = hf_dir(tmp_path / "m")
    other = word_tokenizer(tmp_path / "other.json", WORDS[::-1])
    with pytest.raises(Exception, match="another vocabulary than"):
        resolve_tokenizer(str(other), str(model), pretrained=True)
    assert resolve_tokenizer(str(other), str(model), pretrained=False).path == other  # new embeddings: fine
    same = word_tokenizer(tmp_path / "same.json")
    assert resolve_tokenizer(str(same), str(model), pretrained=True).path == same  # same vocabulary: fine
