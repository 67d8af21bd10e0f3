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
from megatrain.profiling.store import reprofile_command, resolve_profile
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
    if cfg.run.simulate:  # the profile of profiling/store.py's precedence, named in one line with why
        choice = resolve_profile(backend, flag=cfg.run.profile, flag_name="run.profile", run_dir=cfg.run.run_dir,
                                 resumed=bool(cfg.run.resume))
        log(choice.line())
        profile = load_profile_checked(choice.profile)
        profile_name = profile.name if choice.source in ("cache", "run") else Path(choice.profile).stem
        line = choice.explicit and mismatch_line(
            profile, profile_name, reprofile_command(backend, cfg.model.name, batch, seq),
            " (into this machine's cache, which a run without run.profile then uses)")
        if line:
            log(line)
    if cfg.model.pretrained:

        check_hf_dir(cfg.model.name, spec, strict=not cfg.model.num_layers)
    return Preflight(plan, data, profile, profile_name)


def load_profile_checked(name: str):
    """The simulator's hardware profile; a missing or malformed file is a ConfigError, not a traceback."""

    try:
        return load_profile(name)
    except ProfileError as e:
        raise ConfigError(f"run.profile={name!r}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"run.profile={name!r} is not a hardware profile ({type(e).__name__}: {e}); give a JSON "
                          "written by `megatrain profile`, or leave run.profile empty") from None
