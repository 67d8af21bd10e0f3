"""The loss-curve mode of the peer runner: real text, megatrain's init, megatrain's AdamW, every step's loss.

run_peer.py's throughput runs train on 4 batches of random ids; a loss curve needs real data and a reference that
sees the same batches. This module makes a peer's run and `megatrain train` the same run:

  * data: megatrain's own pipeline (`megatrain.data.batches.open_data`) on its bundled corpus (or `--data FILE`),
    with the `DataConfig` that `megatrain_config` writes for megatrain, so both tokenize the same way (byte-level for
    a preset or a config directory without tokenizer.json: every model's vocabulary covers 256), split off the same
    held-out tail, and draw the same shuffled windows in the same order (`TrainLoader.next_batch`, one per step);
  * init: `--init megatrain` loads megatrain's seeded init (`megatrain.model.init.init_tiles`, the weights
    `megatrain train` starts from with `model.seed`) into the HF model through megatrain's own HF name map
    (`megatrain.io.hf_io.state_dict_from_tiles`), so step 1 computes the same loss on both sides;
  * AdamW: weight decay on matrices only, none on norms and biases, as megatrain's update does
    (`UnitLayout.decay_numel`: the 2-D tensors); constant learning rate, no warm-up (megatrain: decay "constant",
    warmup_steps 0);
  * losses: every step's loss (warm-up steps included, 1-based step index) and the SHA-1 of its input ids, so a
    comparison can prove the data order was the same (`write_losses`; scripts/peers/curves.py reads it).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

CURVE_RUN_NAME = "peer-curve-reference"  # the megatrain run directory name megatrain_config writes


def data_config(batch: int, seq: int, path: str = ""):
    """The megatrain `DataConfig` of a curve run: `path` ("" = the bundled corpus), megatrain's defaults for the rest
    (held-out fraction, shuffle, data seed), so that the peer and `megatrain train` open the same stream."""
    from megatrain.data.errors import DataError
    from megatrain.train.config import DataConfig  # the one definition of the data defaults; needs PYTHONPATH=.
    from megatrain.train.config_values import ConfigError

    cfg = DataConfig(path=path, seq_len=seq, batch_size=batch)
    try:
        cfg.validate()
    except ConfigError as e:  # one kind of error for the runner to report: the data cannot be used
        raise DataError(str(e)) from None
    return cfg


def open_corpus(spec, batch: int, seq: int, path: str = ""):
    """megatrain's `Data` for the run (train loader with its cursor at step 0); a DataError names what is wrong."""
    from megatrain.data.batches import open_data

    return open_data(data_config(batch, seq, path), spec.vocab_size)


def batch_sha1(ids) -> str:
    """SHA-1 of a (B, S) int64 tensor of input ids, as stored per step: equal digests = the same batch."""
    import numpy as np

    return hashlib.sha1(np.ascontiguousarray(ids.detach().cpu().numpy().astype("<i8"))).hexdigest()


def megatrain_init(model, spec, seed: int) -> str:
    """Copy megatrain's seeded init of `spec` into the HF `model` (same names, megatrain's own map); a note."""
    from megatrain.io.hf_io import state_dict_from_tiles
    from megatrain.model.init import init_tiles
    from megatrain.train.config import ModelConfig  # the init std megatrain train uses by default

    std = ModelConfig().init_std
    state = state_dict_from_tiles(spec, init_tiles(spec, seed=seed, std=std))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # HF may hold buffers (rotary inv_freq) that are no weights; every weight must come from megatrain's init.
    weights = {n for n, _ in model.named_parameters()}
    lacking = sorted(set(missing) & weights)
    if lacking or unexpected:
        raise ValueError(f"megatrain's init does not fit the HF model: missing {lacking[:3]}, "
                         f"unexpected {list(unexpected)[:3]}")
    return f"megatrain init (seed {seed}, std {std})"


def decay_groups(model, weight_decay: float) -> list[dict]:
    """AdamW parameter groups as megatrain decays: matrices (2-D: embedding, projections, lm_head) with
    `weight_decay`, 1-D tensors (norms, biases) without."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def write_losses(path: str | Path, losses: list[float], warmup: int, digests: list[str]) -> None:
    """The per-step file: a JSON list, one object per step, warm-up included:
    {"step": 1-based, "loss": float, "warmup": bool, "batch_sha1": hex of the step's input ids}."""
    rows = [{"step": i + 1, "loss": loss, "warmup": i < warmup, "batch_sha1": d}
            for i, (loss, d) in enumerate(zip(losses, digests))]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")  # one step a line


def megatrain_config(a, adamw: dict, schedule: str = ""):
    """The `megatrain train` RunConfig of the same run as run_peer's args `a` (model, batch, seq, steps = warm-up +
    timed, lr constant without warm-up, betas, eps, weight decay, clipping, init seed, data), writing every step's
    loss to runs/CURVE_RUN_NAME/metrics.jsonl; no evaluation, no checkpoint. `schedule`: a megatrain schedule name
    ("" = megatrain's default); its `clip` is set to the peer's."""
    from megatrain.model.presets import PRESETS
    from megatrain.train.config import RunConfig

    data = data_config(a.batch, a.seq, a.data or "")
    model = {"name": a.model, "seed": a.seed}
    if a.model not in PRESETS:  # an HF config directory: random init, not its weights (it has none)
        model["init"] = "random"
        model["name"] = str(Path(a.model))
    raw = {
        "model": model,
        "data": {"path": data.path, "seq_len": data.seq_len, "batch_size": data.batch_size,
                 "tokenizer": "bytes" if a.model not in PRESETS else ""},
        "schedule": {**({"name": schedule} if schedule else {}), "clip": float(a.clip)},
        "optimizer": {"lr": a.lr, "warmup_steps": 0, "decay": "constant", "min_lr": 0.0,
                      "beta1": adamw["betas"][0], "beta2": adamw["betas"][1], "eps": adamw["eps"],
                      "weight_decay": adamw["weight_decay"]},
        "run": {"name": CURVE_RUN_NAME, "steps": a.warmup + a.steps, "eval_every": 0, "log_every": 10,
                "checkpoint_every": 0, "checkpoint_at_end": False, "progress": False},
    }
    return RunConfig.from_dict(raw, source="run_peer --megatrain-toml")
