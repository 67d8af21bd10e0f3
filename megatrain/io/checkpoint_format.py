"""What a complete checkpoint is, on disk: its file names, format and version, the unit keys of its tensors, the
checksums that vouch for every file (a state file's and a sharded manifest's own checksum included), and the check
that a checkpoint is whole before anything of it is used (`verify_checkpoint`, `newest_complete`). The writer and
the loader of the one-process format are io/checkpoint.py, the sharded format io/sharded_checkpoint.py; both read
and write what this module defines."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from megatrain.io import safetensors_io as stio
from megatrain.io.errors import CheckpointError
from megatrain.model.spec import EMBED, HEAD

KINDS = ("master", "adam_m", "adam_v")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"  # a sharded checkpoint's description of its rank files (sharded_checkpoint.py)
FORMAT = "megatrain-checkpoint"
# 2: checksums of every file and of the state; 3: a sharded checkpoint's manifest among them (1 and 2 still read)
VERSION = 3


def step_dir_name(step: int) -> str:
    """The directory of the checkpoint of `step` under a run's checkpoints/: "step_00000100"."""
    return f"step_{step:08d}"


def listed_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """[(step, path)] of the checkpoint directories of `directory` that have a state file, oldest first (not yet
    verified: `verify_checkpoint` / `newest_complete` check them)."""
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        if p.name.startswith("step_") and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name.removeprefix("step_")), p))
            except ValueError:
                continue
    return sorted(found)


def unit_key(unit: int) -> str:
    """Tensor name of a unit in checkpoint files: "embed", "layers.3", "head"."""
    return {EMBED: "embed", HEAD: "head"}.get(unit, f"layers.{unit}")


def key_unit(key: str) -> int:
    if key == "embed":
        return EMBED
    if key == "head":
        return HEAD
    return int(key.removeprefix("layers."))



def _canonical_sha256(meta: dict) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checksummed_text(meta: dict) -> str:
    """A state file's (or manifest's) text: `meta` plus "checksum", the SHA-256 of `meta` in canonical JSON."""
    return json.dumps({**meta, "checksum": _canonical_sha256(meta)}, indent=1)


def check_own_checksum(meta: dict, file: Path) -> dict:
    """`meta` (read from `file`, written by `checksummed_text`) without its "checksum", which must match."""
    meta = dict(meta)
    if meta.pop("checksum", None) != _canonical_sha256(meta):
        raise CheckpointError(f"{file} does not match its checksum: the file was damaged or edited")
    return meta


def read_state(path: str | Path) -> dict:
    """The checked content of a checkpoint's state file (its own checksum verified; CheckpointError if not)."""
    path = Path(path)
    state_path = path / STATE_FILE
    try:
        meta = json.loads(state_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no {STATE_FILE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{state_path} is corrupt ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION):
        got = (meta.get("format"), meta.get("version")) if isinstance(meta, dict) else (type(meta).__name__, None)
        raise CheckpointError(f"{state_path} is not a {FORMAT} checkpoint (format {got[0]!r}, version {got[1]!r})")
    if meta["version"] >= 2:
        meta = check_own_checksum(meta, state_path)
    try:
        meta["step"], meta["units"] = int(meta["step"]), [int(u) for u in meta["units"]]
        if not isinstance(meta["state"], dict):
            raise TypeError("'state' is not an object")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{state_path} is damaged ({type(e).__name__}: {e})") from None
    return meta


def check_files(path: Path, files: Mapping[str, str | None], listed_in: str) -> None:
    """Every file of `files` ({name: SHA-256, or None for no checksum}) present in checkpoint `path`, a
    safetensors file complete (header against size), and matching its SHA-256; CheckpointError naming the file."""
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} has no {name} (listed in {listed_in})")
        if name.endswith(".safetensors"):
            try:
                stio.read_header(file)
            except stio.SafetensorsFormatError as e:
                raise CheckpointError(f"checkpoint {path} is damaged: {e}") from None
        if expected is not None and stio.file_sha256(file) != expected:
            raise CheckpointError(f"{file} does not match the checksum in {listed_in}: the file was damaged or "
                                  "edited (flipped, missing or changed bytes)")


# Checkpoints this process verified, with the signature of their files then: unchanged, they are not hashed again
# (a resume verifies when it resolves, checks and loads; a failed save names the newest complete checkpoint).
_verified: dict[Path, tuple] = {}


def _signature(path: Path) -> tuple | None:
    try:
        return tuple(sorted((p.name, st.st_size, st.st_mtime_ns, st.st_ino)
                            for p in path.iterdir() for st in (p.stat(),)))
    except OSError:
        return None


def was_verified(path: Path) -> bool:
    """Whether this process verified checkpoint `path` and none of its files changed since."""
    sig = _signature(path)
    return sig is not None and _verified.get(path.resolve()) == sig


def remember_verified(path: Path) -> None:
    """Record checkpoint `path` as verified, as its files are now (call it right after verifying)."""
    _verified[path.resolve()] = _signature(path)


def check_complete(path: Path) -> dict:
    """verify_checkpoint without naming the newest complete checkpoint on failure."""
    meta = read_state(path)
    if was_verified(path):
        return meta
    if meta["version"] >= 2:  # version 2 and up list their files: the three kinds, or a sharded one's files
        files = meta.get("files", {})
        if not isinstance(files, dict):
            raise CheckpointError(f"{path / STATE_FILE} is damaged: 'files' is not an object")
        if meta.get("layout") == "sharded" and meta["version"] >= 3 and MANIFEST not in files:
            raise CheckpointError(f"{path / STATE_FILE} lists no checksum of {MANIFEST}; the file was edited")
        check_files(path, files, STATE_FILE)
    else:
        check_files(path, {f"{kind}.safetensors": None for kind in KINDS}, STATE_FILE)
    remember_verified(path)
    return meta


def newest_complete(directory: Path, exclude: Path | None = None) -> Path | None:
    """The newest checkpoint of `directory` (other than `exclude`) that passes verification, or None."""
    skip = exclude.resolve() if exclude is not None else None
    for _, p in reversed(listed_checkpoints(Path(directory))):
        if p.resolve() == skip:
            continue
        try:
            check_complete(p)
        except CheckpointError:
            continue
        return p
    return None


def resume_hint(damaged: Path) -> str:
    """What to do about the damaged checkpoint `damaged`: which checkpoint of its directory to resume from."""
    newest = newest_complete(damaged.parent, exclude=damaged)
    if newest is None:
        return f"no other checkpoint in {damaged.parent} passes verification; {damaged} is left as it is"
    return (f"the newest complete checkpoint is {newest}: resume from it (--resume {newest}); {damaged} is left "
            "as it is")


def verify_checkpoint(path: str | Path) -> dict:
    """Check a checkpoint without allocating: the state file, and every file it lists (tensor files, a sharded
    checkpoint's manifest) present, complete (header against size) and matching its SHA-256. Returns the state
    file's content; CheckpointError naming the file and the newest complete checkpoint to resume from."""
    path = Path(path)
    try:
        return check_complete(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {resume_hint(path)}") from None
