"""Which tokenizer a run's data is tokenized with, decided once, before anything is read.

    choice = resolve_tokenizer(cfg.data.tokenizer, cfg.model.name, pretrained=cfg.model.pretrained)
    choice.kind            # "bytes" (token = UTF-8 byte) or "file" (a local tokenizer.json)
    choice.files_dir       # the directory whose tokenizer files an export ships (None for bytes)

The rule (so a tokenizer can never silently disagree with the embeddings it feeds):

    data.tokenizer = "bytes"            byte-level, explicitly (vocabulary 256)
    data.tokenizer = DIR                DIR/tokenizer.json (a Hugging Face model or tokenizer directory)
    data.tokenizer = FILE               that tokenizer.json
    data.tokenizer = "" and model.name  the model directory's tokenizer.json
      is a HF directory with one
    data.tokenizer = "" and a preset    byte-level (the `debug` preset's vocabulary is 256)

A HF directory without tokenizer.json whose weights are loaded (pretrained) and data that needs tokenizing is an
error unless data.tokenizer says which tokenizer (or "bytes"): the embeddings were trained with some tokenizer,
and bytes are almost never it. An explicit data.tokenizer whose vocabulary differs from the pretrained model
directory's own tokenizer.json is refused for the same reason. Nothing is downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from tokenizers import Tokenizer

BYTE_VOCAB_SIZE = 256
BYTES = "bytes"  # the data.tokenizer value that asks for byte-level tokens
TOKENIZER_JSON = "tokenizer.json"


class TokenizerError(ValueError):
    """A tokenizer setting that cannot be used (raised as the data module's DataError by its callers)."""


class ByteTokenizer:
    """Byte-level tokenizer: token = UTF-8 byte (vocabulary 256, matching the `debug` preset)."""

    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenizerChoice:
    """The tokenizer of a run's data: byte-level, or a local tokenizer.json (and where its files live)."""

    kind: str  # "bytes" | "file"
    path: Path | None = None  # the tokenizer.json (kind "file")
    files_dir: Path | None = None  # a directory with the full set of tokenizer files, when there is one
    why: str = ""  # where the choice came from, for the log line

    @property
    def is_bytes(self) -> bool:
        return self.kind == BYTES

    def describe(self) -> str:
        what = "byte-level (token = UTF-8 byte)" if self.is_bytes else str(self.path)
        return f"{what} ({self.why})" if self.why else what

    def to_dict(self) -> dict:
        return {"kind": self.kind, "path": str(self.path) if self.path else None,
                "files_dir": str(self.files_dir) if self.files_dir else None}


def _hf_dir(model_name: str) -> Path | None:
    """The model's directory when `model.name` is a Hugging Face directory (or a config.json in one)."""
    p = Path(model_name)
    if p.is_dir():
        return p
    if p.is_file() and p.name == "config.json":
        return p.parent
    return None


def _from_setting(setting: str) -> TokenizerChoice:
    p = Path(setting)
    if p.is_dir():
        if not (p / TOKENIZER_JSON).is_file():
            raise TokenizerError(f"data.tokenizer={setting!r} is a directory without {TOKENIZER_JSON}; give a Hugging "
                                 "Face model or tokenizer directory that has one, the tokenizer.json itself, or "
                                 f"'{BYTES}'")
        return TokenizerChoice("file", p / TOKENIZER_JSON, p, "data.tokenizer")
    if p.is_file():
        return TokenizerChoice("file", p, None, "data.tokenizer")
    raise TokenizerError(f"data.tokenizer={setting!r} does not exist; give a tokenizer.json, a directory holding "
                         f"one, or '{BYTES}' for byte-level tokens")


def resolve_tokenizer(setting: str, model_name: str, pretrained: bool, needs_tokenizing: bool = True
                      ) -> TokenizerChoice:
    """The tokenizer of the data (see the module docstring). `needs_tokenizing`: the data is text or JSONL (a
    pre-tokenized .bin needs no tokenizer to be read; the choice then only says what an export ships)."""
    model_dir = _hf_dir(model_name)
    own = model_dir / TOKENIZER_JSON if model_dir is not None and (model_dir / TOKENIZER_JSON).is_file() else None
    if setting == BYTES:
        return TokenizerChoice(BYTES, why="data.tokenizer")
    if setting:
        choice = _from_setting(setting)
        if pretrained and own is not None and choice.path.resolve() != own.resolve() \
                and _vocab(choice.path) != _vocab(own):
            raise TokenizerError(
                f"data.tokenizer {choice.path} has another vocabulary than {own}, the tokenizer the pretrained "
                f"weights of {model_dir} were trained with; leave data.tokenizer empty to use the model's, or set "
                "model.init='random' to train new embeddings for this tokenizer")
        return choice
    if own is not None:
        return TokenizerChoice("file", own, model_dir, f"the model directory's, {model_dir}")
    if model_dir is not None and pretrained and needs_tokenizing:
        raise TokenizerError(
            f"the model directory {model_dir} has no {TOKENIZER_JSON}, so megatrain cannot tell how its pretrained "
            "embeddings expect text to be tokenized; set data.tokenizer to the model's tokenizer.json (or the "
            f"directory holding it), or data.tokenizer='{BYTES}' to train on UTF-8 bytes anyway")
    return TokenizerChoice(BYTES, why="the default for a preset" if model_dir is None else "no tokenizer given")


def _vocab(path: Path) -> dict:
    return load_tokenizer(path).get_vocab(with_added_tokens=True)


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from a local tokenizer.json, or from a directory holding one (no network)."""

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_JSON
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception subclasses
        raise TokenizerError(f"data.tokenizer {path} is not a readable tokenizer.json: {e}") from None
