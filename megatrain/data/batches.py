"""Training data: token streams, packed into (batch, seq_len) inputs and next-token targets.

Sources (`DataConfig.format`, or from the suffix of `DataConfig.path`):

    text   a UTF-8 text file, tokenized with the run's tokenizer (megatrain/data/tokenization.py: a HF model
           directory's own tokenizer.json, `data.tokenizer`, or byte-level tokens, vocabulary 256, the `debug`
           preset's). The default, with no path, is the bundled corpus.
    bin    nanoGPT's pre-tokenized files: a flat array of uint16 (or uint32) token ids, read window by window
           (data/filetokens.py) so a file larger than RAM costs nothing to open, and a file changed under the
           run is an error naming it, not a SIGBUS. A directory holding train.bin and val.bin works too.
    jsonl  one JSON object per line, its `text_key` field tokenized with the run's tokenizer.json (the
           `tokenizers` library; nothing is downloaded), `eos_token` appended after each document.

Packing: a stream of n tokens holds (n - 1) // T windows of T + 1 tokens, window i = tokens[iT : iT + T + 1]
(inputs its first T tokens, targets its last T; consecutive windows share one token so no token is lost as
a target). Documents are concatenated, as in nanoGPT and GPT-2 pre-training. Each epoch visits the training
windows in a permutation seeded by (seed, epoch), `batch_size` at a time (an epoch's last, incomplete batch
is dropped). The position in that order is a small `cursor` dict; restoring it continues with the identical
batch sequence. The held-out split is the last `eval_fraction` of the tokens (or `eval_path`, or val.bin),
read in order, never shuffled.

Every token id is checked against the model's vocabulary when the data is opened, before anything trains:
an id >= vocab_size is a `DataError` naming the file and the position (and JSONL line).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from megatrain.model.spec import ModelSpec
from megatrain.data.errors import DataError  # noqa: F401  (re-exported: `from megatrain.data.batches import DataError`)
from megatrain.data.filetokens import FileTokens
from megatrain.data.sizing import DataShape, held_out_tokens, shortfall, windows_in
from megatrain.data.tokenization import (  # noqa: F401  (ByteTokenizer and load_tokenizer are re-exported)
    BYTE_VOCAB_SIZE,
    ByteTokenizer,
    TokenizerChoice,
    TokenizerError,
    load_tokenizer,
    resolve_tokenizer,
)

CORPUS_PATH = Path(__file__).parent.parent / "corpus" / "python_reference.txt"
_SCAN_CHUNK = 1 << 24  # tokens per chunk of the vocabulary scan (64 MiB of uint32)


# ---- token streams -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenStream:
    """A 1-D array of token ids (in memory, or a FileTokens of a .bin file) and where it came from, for error
    messages."""

    tokens: np.ndarray | FileTokens  # (n,) unsigned ints; a .bin file is read window by window (FileTokens)
    source: str  # file path
    line_starts: np.ndarray | None = None  # JSONL: token offset of each document, for line numbers in errors
    offset: int = 0  # position of tokens[0] in the source (a held-out split is a tail of its file)

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, at: int) -> tuple[TokenStream, TokenStream]:
        """The tokens before `at` and from `at` on, as two streams of the same source (views, no copy)."""
        part = self.tokens.part if isinstance(self.tokens, FileTokens) else lambda a, b: self.tokens[a:b]
        return (TokenStream(part(0, at), self.source, self.line_starts, self.offset),
                TokenStream(part(at, len(self)), self.source, self.line_starts, self.offset + at))

    def where(self, i: int) -> str:
        pos = self.offset + i
        if self.line_starts is None:
            return f"{self.source}, token {pos}"
        line = int(np.searchsorted(self.line_starts, pos, side="right"))  # 1-based: line_starts[0] is line 1
        return f"{self.source}, line {line} (token {pos})"

    def check_vocab(self, vocab_size: int) -> None:
        """Raise a DataError at the first token id >= vocab_size. Scans in chunks (a .bin file stays on disk)."""
        for start in range(0, len(self.tokens), _SCAN_CHUNK):
            chunk = np.asarray(self.tokens[start:start + _SCAN_CHUNK])
            if len(chunk) and int(chunk.max()) >= vocab_size:
                i = start + int(np.argmax(chunk >= vocab_size))
                raise DataError(
                    f"token id {int(self.tokens[i])} at {self.where(i)} is >= the model's vocab_size {vocab_size}; "
                    "the data was tokenized for another vocabulary (check data.tokenizer / data.dtype, or the model)"
                )


def _load_tokenizer(path: str | Path):
    try:
        return load_tokenizer(path)
    except TokenizerError as e:
        raise DataError(str(e)) from None


def read_text(path: str | Path, tokenizer: str | Path | None = None) -> TokenStream:
    """A text file as byte-level tokens, or tokenized with a local tokenizer.json."""
    path = Path(path)
    if tokenizer is None:
        return TokenStream(np.fromfile(path, dtype=np.uint8), str(path))
    tok = _load_tokenizer(tokenizer)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from None
    ids = tok.encode(text, add_special_tokens=False).ids
    return TokenStream(np.asarray(ids, dtype=np.uint32), str(path))


def read_bin(path: str | Path, dtype: str = "uint16") -> TokenStream:
    """A nanoGPT token file: a flat array of `dtype` ids, read window by window and checked at every read
    (data/filetokens.py: not memory-mapped, so a file truncated under the run is an error, not a SIGBUS)."""
    path = Path(path)
    itemsize = np.dtype(dtype).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path} has {size} bytes, not a multiple of {itemsize} ({dtype}); is data.dtype right?")
    if size == 0:
        raise DataError(f"{path} is empty")
    return TokenStream(FileTokens(path, dtype), str(path))


def read_jsonl(path: str | Path, tokenizer: str | Path, text_key: str = "text", eos_token: str = "") -> TokenStream:
    """JSONL documents tokenized with a local tokenizer.json, concatenated, `eos_token` after each."""
    path = Path(path)
    tok = _load_tokenizer(tokenizer)
    eos: list[int] = []
    if eos_token:
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"data.eos_token {eos_token!r} is not a token of {tokenizer}")
        eos = [eos_id]
    texts, lines = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}, line {lineno}: not valid JSON ({e})") from None
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}, line {lineno}: no string field {text_key!r} (set data.text_key)")
            try:  # JSON may escape what UTF-8 cannot hold: a lone surrogate ("\\ud800") has no encoding
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(f"{path}, line {lineno}: field {text_key!r} holds {e.object[e.start]!r}, a lone "
                                "surrogate that is no Unicode text; fix or drop the line") from None
            texts.append(text)
            lines.append(lineno)
    if not texts:
        raise DataError(f"{path} holds no documents")
    ids: list[int] = []
    # Token offset where each physical line starts; blank lines start where the next document does.
    starts = np.zeros(lines[-1], dtype=np.int64)
    done = 0
    for enc, lineno in zip(tok.encode_batch(texts, add_special_tokens=False), lines):
        starts[done:lineno] = len(ids)
        done = lineno
        ids += enc.ids + eos
    return TokenStream(np.asarray(ids, dtype=np.uint32), str(path), line_starts=starts)


# ---- packing -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64, inputs shifted left by one token

    @property
    def tokens(self) -> int:
        return self.inputs.numel()


class Windows:
    """Non-overlapping windows of seq_len + 1 tokens over a stream (see the module docstring)."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.count = windows_in(len(stream), seq_len)

    def __len__(self) -> int:
        return self.count

    def batch(self, indices) -> Batch:
        T = self.seq_len
        rows = [np.asarray(self.stream.tokens[i * T:i * T + T + 1], dtype=np.int64) for i in indices]
        x = torch.from_numpy(np.stack(rows))  # (B, T + 1)
        return Batch(x[:, :-1].contiguous(), x[:, 1:].contiguous())


class TrainLoader:
    """Shuffled training batches with a cursor that saves and restores exactly."""

    def __init__(self, windows: Windows, batch_size: int, seed: int = 0, shuffle: bool = True):
        if len(windows) < batch_size:
            raise DataError(
                f"{windows.stream.source}: {len(windows)} windows of {windows.seq_len + 1} tokens cannot fill one "
                f"batch of {batch_size}; use more data, a smaller data.batch_size or data.seq_len"
            )
        self.windows, self.batch_size, self.seed, self.shuffle = windows, batch_size, seed, shuffle
        self.batches_per_epoch = len(windows) // batch_size
        self.epoch, self.index = 0, 0  # the cursor: next batch is batch `index` of epoch `epoch`
        self._order_epoch, self._order = -1, None

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self.windows)
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> Batch:
        """The batch at the cursor; advances it."""
        order = self._epoch_order()
        b = self.batch_size
        batch = self.windows.batch(order[self.index * b:(self.index + 1) * b])
        self.index += 1
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """The cursor, with what it is valid for (JSON-serializable)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "windows": len(self.windows), "seq_len": self.windows.seq_len, "batch_size": self.batch_size,
                "source": self.windows.stream.source}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor; the data and its packing must be the same as when it was saved."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "windows", "seq_len", "batch_size"):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"the saved data cursor has {key}={state.get(key)!r} but this run's data has {mine[key]!r} "
                    f"({mine['source']}); resume with the data config the checkpoint was written with"
                )
        if not 0 <= state["index"] < self.batches_per_epoch or state["epoch"] < 0:
            raise DataError(f"the saved data cursor {state} is out of range for {self.batches_per_epoch} batches/epoch")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


@dataclass
class Data:
    """The opened data of a run: shuffled training batches and the held-out windows."""

    train: TrainLoader
    eval: Windows | None  # None when there is no held-out split (eval_fraction = 0 and no eval_path)
    tokenizer: TokenizerChoice = TokenizerChoice("bytes")  # what the text was tokenized with (an export ships it)

    def eval_batches(self, num_batches: int, batch_size: int | None = None) -> Iterator[Batch]:
        """The first `num_batches` held-out batches, in order (the same ones at every evaluation)."""
        if self.eval is None:
            return
        b = batch_size or self.train.batch_size
        n = min(num_batches, len(self.eval) // b)
        if n == 0 and len(self.eval):  # too few windows for a full batch: one smaller batch
            yield self.eval.batch(range(len(self.eval)))
            return
        for k in range(n):
            yield self.eval.batch(range(k * b, (k + 1) * b))

    def describe(self) -> str:
        t = self.train.windows
        s = f"train: {len(t.stream):,} tokens, {len(t):,} windows of {t.seq_len + 1} from {t.stream.source}"
        if self.eval is not None:
            s += f"; eval: {len(self.eval.stream):,} tokens, {len(self.eval):,} windows"
        if _format_of(Path(t.stream.source), "auto") != "bin":
            s += f"\ntokenizer {self.tokenizer.describe()}"  # a line of its own: the data line is long already
        return s


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.is_dir():
        return "bin"
    return {".bin": "bin", ".jsonl": "jsonl", ".txt": "text", ".text": "text", ".md": "text"}.get(path.suffix, "text")


def read_stream(path: str | Path, fmt: str = "auto", dtype: str = "uint16", tokenizer: str = "",
                text_key: str = "text", eos_token: str = "") -> TokenStream:
    """One token stream from a file, in `fmt` (auto: from the suffix)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    fmt = _format_of(path, fmt)
    if fmt == "bin":
        return read_bin(path, dtype)
    if fmt == "jsonl":
        if not tokenizer:
            raise DataError(f"{path} is JSONL: set data.tokenizer to a local tokenizer.json (or the Hugging Face "
                            "directory holding it); byte-level tokens are for .txt files")
        return read_jsonl(path, tokenizer, text_key, eos_token)
    return read_text(path, tokenizer or None)


def data_tokenizer(cfg, model=None) -> TokenizerChoice:
    """The tokenizer of the data a `DataConfig` describes, for the model of a `ModelConfig` (None: a preset).
    See megatrain/data/tokenization.py for the rule; a setting that cannot be used is a DataError."""
    path = Path(cfg.path) if cfg.path else CORPUS_PATH
    fmt = "bin" if path.is_dir() else _format_of(path, cfg.format)
    try:
        return resolve_tokenizer(cfg.tokenizer, model.name if model is not None else "",
                                 pretrained=bool(model is not None and model.pretrained),
                                 needs_tokenizing=fmt != "bin")
    except TokenizerError as e:
        raise DataError(str(e)) from None


def open_data(cfg, vocab_size: int, model=None, batch_multiple: int = 1) -> Data:
    """Open the data a `DataConfig` describes, check every token id against `vocab_size`, and split off eval.
    `model` (a ModelConfig): a Hugging Face model directory's own tokenizer is the default tokenizer.
    `batch_multiple`: what a data.batch_size must be a multiple of (the schedule's micro-batches), so that the
    batch size the too-little-data error suggests is one the config accepts."""
    path = Path(cfg.path) if cfg.path else CORPUS_PATH
    choice = data_tokenizer(cfg, model)
    opts = dict(fmt=cfg.format, dtype=cfg.dtype, tokenizer="" if choice.is_bytes else str(choice.path),
                text_key=cfg.text_key, eos_token=cfg.eos_token)
    eval_path = cfg.eval_path
    if path.is_dir():  # a nanoGPT data directory
        if not (path / "train.bin").is_file():
            raise DataError(f"data.path {path} is a directory without train.bin; give a file or a nanoGPT data dir")
        if not eval_path and (path / "val.bin").is_file():
            eval_path = str(path / "val.bin")
        path = path / "train.bin"
    train = read_stream(path, **opts)
    evals = None
    if eval_path:
        evals = read_stream(eval_path, **opts)
    shape = DataShape(len(train), len(evals) if evals is not None else None, cfg.eval_fraction, cfg.seq_len,
                      cfg.batch_size)
    source = train.source if evals is None else f"{train.source} (held out: {evals.source})"
    if (short := shortfall(shape, source, batch_multiple)) is not None:  # before the vocabulary scan: seconds
        raise DataError(short)
    if evals is None and cfg.eval_fraction > 0:
        train, evals = train.split(len(train) - held_out_tokens(len(train), cfg.eval_fraction))
    for stream in (train, evals):
        if stream is not None:
            stream.check_vocab(vocab_size)
    eval_windows = Windows(evals, cfg.seq_len) if evals is not None else None
    loader = TrainLoader(Windows(train, cfg.seq_len), cfg.batch_size, cfg.seed, cfg.shuffle)
    return Data(loader, eval_windows, choice)


# ---- synthetic tokens ----------------------------------------------------------------------------------------
def synthetic_batches(spec: ModelSpec, batch: int, seq: int, seed: int = 0) -> Iterator[tuple]:
    """Endless learnable token batches: arithmetic progressions mod vocab_size with random start and stride 1..4.
    Yields (ids, targets), each a (batch, seq) int64 tensor, targets = ids shifted by one."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq + 1)
    while True:
        start = torch.randint(0, spec.vocab_size, (batch, 1), generator=g)
        stride = torch.randint(1, 5, (batch, 1), generator=g)
        tokens = (start + stride * steps) % spec.vocab_size  # (B, T+1)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
