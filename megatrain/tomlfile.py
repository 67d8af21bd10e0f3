"""Reading a TOML file with one clear error for each way it can be wrong."""
from __future__ import annotations

import tomllib
from pathlib import Path


def read_toml(path: str | Path, error: type[Exception], what: str = "file") -> dict:
    """The parsed TOML at `path`; `error(message)` if it is missing, not UTF-8 or not valid TOML."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise error(f"{p} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{p} is not UTF-8 text: {e}") from None
