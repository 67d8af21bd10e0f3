"""The profile `--schedule auto` ranks with on this machine when none is given (train/autoswitch.py
`choose_before_run`): the one profiling/store.py resolves, else this machine profiled quickly first.

    choice = machine_profile(spec, batch, seq, knobs, "cuda", log=print)   # ProfileChoice: path, why, source
"""
from __future__ import annotations

import gc
import time

import torch

from megatrain.compile.knobs import ScheduleKnobs
from megatrain.model.spec import ModelSpec
from megatrain.profiling.calibrate import ProfileRequest, measure_profile, profile_host_reserve, slowest_phases
from megatrain.profiling.store import ProfileChoice, reprofile_command, resolve_profile, save_measured
from megatrain.sim import load_profile
from megatrain.sim.profile import model_signature
from megatrain.train.fit import check_fits


def covers(profile, spec: ModelSpec, seq: int, dtype: str, compiled: bool = False) -> bool:
    """Whether `profile` has measured compute tables of `spec`'s shape at `seq` in `dtype` (and of the compiled
    layer too when `compiled`)."""
    sig = model_signature(spec)
    mine = [t for t in profile.compute_tables if t.model == sig and t.seq == seq and t.dtype == dtype]
    return bool(mine) and (not compiled or any(t.compiled for t in mine))


def machine_profile(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str, log=print,
                    run_dir=None, resumed: bool = False) -> ProfileChoice:
    """The profile `--schedule auto` chooses with when none is given: the one profiling/store.py resolves
    ($MEGATRAIN_PROFILE, a resumed run's calibrated profile, this machine's cached one). When that is only the
    shipped default, or the cached profile has no compute tables of this model at `seq`, this machine is profiled
    quickly first (as `megatrain profile --quick`, said so) and the tables are merged into the cache for the next
    run."""
    choice = resolve_profile(backend, run_dir=run_dir, resumed=resumed)
    if choice.source in ("env", "run"):  # asked for, or fitted to this very run
        log(f"--schedule auto: {choice.line()}")
        return choice
    if choice.source == "cache":
        if covers(load_profile(choice.profile), spec, seq, knobs.compute_dtype, knobs.compile_layers):
            log(f"--schedule auto: using this machine's profile {choice.profile}")
            return choice
        why = f"this machine's profile {choice.profile} has no compute tables of {spec.name} at seq {seq}"
    else:
        why = f"no profile of this machine: {choice.reason}"
    cmd = reprofile_command(backend, spec.name, batch, seq)
    log(f"--schedule auto: {why}; so it is profiled quickly first (as `{cmd}`)")
    check_fits(spec.with_layers(min(2, spec.num_layers)), batch, seq, knobs, backend, f"profiling {spec.name}",
               "lower --batch / --seq, or give --set run.profile=FILE", profile_host_reserve(spec, backend, True))
    t0 = time.perf_counter()
    cal = measure_profile(ProfileRequest(spec, batch=batch, seqs=[seq], device=backend,
                                         dtypes=[knobs.compute_dtype], quick=True, knobs=knobs),
                          log=lambda _line: None)
    path, _ = save_measured(cal, log=lambda line: log(f"--schedule auto: {line}"))
    slowest = slowest_phases(cal.measurements)
    del cal
    if backend == "cuda":  # the profile's buffers are gone; give their cached blocks back before the run
        gc.collect()
        torch.cuda.empty_cache()
    log(f"--schedule auto: profiled this machine in {time.perf_counter() - t0:.1f} s: {path} (longest: {slowest})")
    return ProfileChoice(str(path), "this machine's profile in the cache, measured just now", "cache")
