"""The checks a run makes before it allocates anything or writes anything: each is cheap (headers, a planner, a
memory-mapped file), and a mistake found here costs seconds, not the minutes of filling a host store first.

In order: the schedule's rules (the `build_schedule` that `megatrain plan` and the trainer use), the memory plan
against this machine, the data (every token id against the vocabulary), the simulator's hardware profile, a
Hugging Face directory's every shard and tensor (presence, shape, dtype; headers only), the export target, and
TensorBoard.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatrain.train.config import ConfigError, RunConfig
from megatrain.data.batches import open_data
from megatrain.train.fit import check_memory
from megatrain.compile.builders import build_schedule
from megatrain.io.hf_checkpoint import check_hf_dir
from megatrain.profiling.machine import mismatch_line
from megatrain.sim import ProfileError, load_profile


@dataclass
class Preflight:
    """What the checks produced and the run goes on with."""

    plan: object  # megatrain.plan.memory.MemoryPlan
    data: object  # the opened data (megatrain.data.batches)
    profile: object | None  # megatrain.sim.HardwareProfile when run.simulate
    profile_name: str | None


def preflight(cfg: RunConfig, spec, batch: int, seq: int, knobs, backend: str,
              log: Callable[[str], None]) -> Preflight:
    """Run every check of the module docstring; the first failure raises (ScheduleError, MemoryFitError,
    DataError, ConfigError, CheckpointError), with nothing allocated and nothing written."""

    build_schedule(spec, batch, seq, knobs)  # ScheduleError: a rule of the knobs is broken
    plan, lines = check_memory(spec, batch, seq, knobs, backend)
    log("memory: " + "; ".join(line.strip() for line in lines))
    # every token id checked; a batch size the too-little-data error suggests splits into the micro-batches
    data = open_data(cfg.data, spec.vocab_size, cfg.model, batch_multiple=cfg.schedule.micro_batches)
    log(f"data: {data.describe()}")
    if seq > spec.max_position_embeddings:
        log(f"note: data.seq_len={seq} is beyond the model's max_position_embeddings="
            f"{spec.max_position_embeddings}; RoPE extrapolates there")
    if cfg.run.eval_every and data.eval is None:
        log("note: run.eval_every is set but there is no held-out split (data.eval_fraction = 0); no eval")
    profile, profile_name = None, None
    if cfg.run.simulate:
        profile_name = cfg.run.profile or ("h200-measured" if backend == "cuda" else "cpu")
        profile = load_profile_checked(profile_name)

        out = f"{cfg.run.out_dir}/profiles/{spec.name}-{backend}.json"
        line = mismatch_line(profile, Path(profile_name).stem, f"megatrain profile --quick --model {cfg.model.name} "
                             f"--batch {batch} --seq {seq} --device {backend} --out {out}",
                             f" (then --set run.profile={out})")
        if line:
            log(line)
    if cfg.model.pretrained:

        check_hf_dir(cfg.model.name, spec, strict=not cfg.model.num_layers)
    return Preflight(plan, data, profile, Path(profile_name).stem if profile_name else None)


def load_profile_checked(name: str):
    """The simulator's hardware profile; a missing or malformed file is a ConfigError, not a traceback."""

    try:
        return load_profile(name)
    except ProfileError as e:
        raise ConfigError(f"run.profile={name!r}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"run.profile={name!r} is not a hardware profile ({type(e).__name__}: {e}); give a JSON "
                          "written by `megatrain profile`, or leave run.profile empty") from None
