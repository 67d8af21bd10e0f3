"""Hugging Face exports of a run's weights: at the end of a run (`run.export_hf`) or of any checkpoint later.

    megatrain export runs/ft-1 out/ft-1-hf                      # the run's latest checkpoint
    megatrain export runs/ft-1/checkpoints/step_00000500 out/ft-500 --dtype fp32

    export_checkpoint("runs/ft-1", "out/ft-1-hf")               # the same from Python

Both write what `transformers` `from_pretrained` loads (hf_checkpoint.export_hf): config.json derived from the
source model directory's config.json when the run started from one (bos/eos/pad ids kept), the source's
generation_config.json, and the files of the tokenizer the data was tokenized with (the rule of
training/tokenization.py, applied to the config the checkpoint was written with); byte-level data ships no
tokenizer. Only the fp32 master is read from a checkpoint (one unit at a time), not the AdamW moments.

Every export also holds megatrain_export.json (the run directory, the checkpoint, the step). Nothing but an earlier
export is ever replaced (io/export_target.py): a target that is, holds or sits above a run or checkpoint directory
(any run's), or sits inside a checkpoint, is refused, and `--overwrite` replaces only a directory holding
megatrain_export.json. A resumed run may replace an export of its own run directory at its end; any other existing
directory is refused up front, before the run.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatrain.model.spec import ModelSpec
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.checkpoint_format import STATE_FILE
from megatrain.io.errors import CheckpointError
from megatrain.train.config import ConfigError
from megatrain.io.export_target import PROVENANCE_FILE, check_export_target
from megatrain.io.hf_checkpoint import export_hf
from megatrain.data.tokenization import (
    TokenizerChoice,
    TokenizerError,
    load_tokenizer,
    resolve_tokenizer,
)
from megatrain.io.sharded_checkpoint import tile_reader
from megatrain.model.presets import PRESETS
import time

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

__all__ = ["DTYPES", "export_checkpoint", "export_weights", "export_run", "find_checkpoint", "check_run_export_target"]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint `path` names: a checkpoint directory, a run directory or its checkpoints/ (the latest)."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    for directory in (path / "checkpoints", path):
        if directory.is_dir():
            latest = CheckpointManager(directory).latest()
            if latest is not None:
                return latest
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a checkpoint directory (runs/NAME/checkpoints/"
                              "step_...) or a run directory (its latest checkpoint is exported)")
    raise CheckpointError(f"{path} is neither a checkpoint (no {STATE_FILE}) nor a run directory with a complete "
                          "checkpoint in checkpoints/")


def check_run_export_target(out: str | Path, run_dir: str | Path) -> bool:
    """`run.export_hf` checked before the run: whether `out` holds an export of this run (the end of the run
    replaces it). The run's own directory or one above it, any other existing path, and a target
    `io.export_target.check_export_target` refuses are a ConfigError now, not after the whole run."""
    out, run_dir = Path(out), Path(run_dir)
    where = out.resolve()
    if where == run_dir.resolve() or where in run_dir.resolve().parents:
        raise ConfigError(f"run.export_hf={str(out)!r} is the run directory {run_dir} or above it; the export would "
                          "replace the run: choose a directory outside it (e.g. beside it)")
    try:
        made_by = json.loads((out / PROVENANCE_FILE).read_text()).get("run_dir")
    except (OSError, ValueError, AttributeError):
        made_by = None
    if not out.exists() or (made_by is not None and Path(made_by).resolve() == run_dir.resolve()):
        try:  # a new directory, or an export of this run: also free of runs and outside every checkpoint
            return check_export_target(out, overwrite=True)
        except CheckpointError as e:
            raise ConfigError(f"run.export_hf={str(out)!r}: {e}") from None
    raise ConfigError(f"run.export_hf={str(out)!r} already exists and is not an export of this run "
                      f"({run_dir}); the export at the end would fail after the whole run. Choose a new "
                      "directory or remove it")


def _config_defaults(choice: TokenizerChoice, eos_token: str) -> dict:
    """config.json token ids the source config may lack: eos from the data's eos_token, if the tokenizer has it."""
    if choice.is_bytes or not eos_token:
        return {}
    try:
        eos_id = load_tokenizer(choice.path).token_to_id(eos_token)
    except TokenizerError:
        return {}
    return {"eos_token_id": eos_id}


def export_weights(out: str | Path, spec: ModelSpec, tiles, config: dict, *, dtype: torch.dtype = torch.bfloat16,
                   tokenizer: TokenizerChoice | None = None, provenance: dict | None = None,
                   overwrite: bool = False) -> Path:
    """Export per-unit fp32 tiles of a run whose resolved config (RunConfig.to_dict()) is `config`."""

    model, data = config.get("model", {}), config.get("data", {})
    name = str(model.get("name", ""))
    if name and name not in PRESETS and not Path(name).exists():
        # Without it the export would lose the source's config fields and tokenizer without a word.
        raise CheckpointError(f"the run's model directory {name!r} is not found from {Path.cwd()}; run the export "
                              "from the directory the run was started in (its paths are relative to it)")
    source = Path(name) if name and Path(name).is_dir() else None
    if tokenizer is None:
        pretrained = model.get("init") == "pretrained" or (model.get("init", "auto") == "auto" and source is not None)
        try:
            tokenizer = resolve_tokenizer(data.get("tokenizer", ""), name, pretrained, needs_tokenizing=False)
        except TokenizerError as e:
            raise CheckpointError(f"the tokenizer of this run's data cannot be found any more: {e}") from None
    files = None if tokenizer.is_bytes else (tokenizer.files_dir or tokenizer.path)
    return export_hf(out, spec, tiles, dtype=dtype, overwrite=overwrite, source=source, tokenizer=files,
                     config_defaults=_config_defaults(tokenizer, data.get("eos_token", "")),
                     provenance={**(provenance or {}), "tokenizer": tokenizer.to_dict()})


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str = "bf16", overwrite: bool = False
                      ) -> tuple[Path, dict]:
    """Export a checkpoint (or a run directory's latest) as a Hugging Face directory; returns (out, provenance)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path = find_checkpoint(checkpoint)
    try:
        meta = json.loads((path / STATE_FILE).read_text())
        state, step = meta["state"], int(meta["step"])
        spec = ModelSpec.from_dict(state["spec"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path / STATE_FILE} does not describe a megatrain training checkpoint ({e})") from None

    try:  # either format: a one-process checkpoint or the slices of every rank, one unit at a time
        tile = tile_reader(path)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {path} lacks a file: {e}") from None
    except stio.SafetensorsFormatError as e:
        raise CheckpointError(f"checkpoint {path} is damaged: {e}") from None

    provenance = {"run_dir": str(path.parent.parent), "checkpoint": str(path), "step": step}
    out = export_weights(out, spec, tile, state.get("config", {}), dtype=DTYPES[dtype], provenance=provenance,
                         overwrite=overwrite)
    return out, json.loads((out / PROVENANCE_FILE).read_text())


def export_run(cfg, spec, trainer, world, tokenizer: TokenizerChoice, run_dir: Path, checkpoint: Path | None,
               overwrite: bool, log) -> Path:
    """`run.export_hf` at the end of a run (rank 0 only): the store's master, or with several ranks every rank's
    slices of the final checkpoint (`checkpoint`, written just before; dist/run.py requires it)."""

    t0 = time.perf_counter()
    tiles = trainer.store.master
    if world.distributed:

        tiles = tile_reader(checkpoint)
    path = export_weights(cfg.run.export_hf, spec, tiles, cfg.to_dict(), tokenizer=tokenizer, overwrite=overwrite,
                          provenance={"run_dir": str(run_dir), "checkpoint": str(checkpoint),
                                      "step": trainer.step_count})
    log(f"exported to {path} (Hugging Face, bf16; tokenizer {tokenizer.describe()}) in "
        f"{time.perf_counter() - t0:.2f} s")
    return path
