"""`megatrain profile`: measure this machine for a model shape and write a hardware profile for the simulator.

    megatrain profile --model bench-3b --batch 8 --seq 2048 [--device cuda] [--out FILE] [--quick]

Writes this machine's profile into the per-user cache ($MEGATRAIN_CACHE, else $XDG_CACHE_HOME/megatrain, else
~/.cache/megatrain; profiles/<machine key>.json), which simulate, compare, train and --schedule auto then use
(profiling/store.py, docs/profiles.md); a profile of this machine already there keeps its compute tables of other
model shapes and sequence lengths. `--out FILE` writes FILE instead.

Measures copy bandwidth (by size, each direction, both at once), the model's per-unit forward / recompute /
backward times at 1..batch sequences, AdamW rates (host threads, device), the runtime's per-task overheads and the
contention between streams, with the executor's own code. Says up front how long it will take, reports each
measurement as it finishes, and prints a summary for docs/calibration.md. The JSON loads with `--profile FILE`
in `megatrain simulate` and `megatrain compare`; every timing goes to `<FILE stem>.measurements.json` beside it.

Under torchrun (several ranks) it also measures the collectives between the ranks (all-gather, reduce-scatter,
all-reduce by message size: the profile's `collectives` table, profiling/collectives.py); rank 0 measures the rest
and writes the file. `--collectives-only` measures just those and writes them into the fields of `--base`:

    torchrun --standalone --nproc_per_node=2 -m megatrain profile --collectives-only --device cuda --out FILE
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

from megatrain.cli import UserError
from megatrain.cli.common import DEFAULT_SCHEDULE, positive_float, positive_int


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 1 for x in out):
        raise UserError(f"{what} {text!r} is not a positive integer (or a comma-separated list of them)")
    return out


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine for a model shape; write a hardware profile JSON",
                       description="Measure this machine for a model shape and write its hardware profile into the "
                                   "per-user cache ($MEGATRAIN_CACHE, else $XDG_CACHE_HOME/megatrain, else "
                                   "~/.cache/megatrain: profiles/<machine key>.json). simulate, compare, train and "
                                   "--schedule auto on this machine then use it, unless --profile, run.profile or "
                                   "$MEGATRAIN_PROFILE name another; each prints `profile: ... (why)`. Measuring "
                                   "again keeps the cached compute tables of other shapes. --out FILE writes FILE "
                                   "instead of the cache.")
    p.add_argument("--model", default="bench-3b",
                   help="preset name or HF model dir / config.json; more, comma-separated, add compute tables for "
                        "their shapes too (copies, optimizer and overheads are measured for the first)")
    p.add_argument("--batch", default="8", help="largest batch to measure (tables at 1, 2, 4, ... up to it; default "
                                                "8)")
    p.add_argument("--seq", default="2048", help="sequence length, or a comma-separated list of them (default 2048)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", help="compute dtype(s) of the tables: bf16, fp32 or bf16,fp32 "
                                   "(default: bf16 on CUDA, fp32,bf16 on CPU)")
    p.add_argument("--schedule", default=DEFAULT_SCHEDULE,
                   help="schedule whose wire dtypes, loss chunk and real steps the profile measures")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")
    p.add_argument("--cpu-threads", type=positive_int, help="AdamW threads of the runtime (default: the trainer's choice)")
    p.add_argument("--quick", action="store_true",
                   help="fewer sizes, token counts and repetitions (the compiled layer at the run's micro-batch only)")
    p.add_argument("--name", help="profile name (default: from the device)")
    p.add_argument("--out", help="profile JSON to write (default: this machine's profile in the per-user cache, "
                                 "$MEGATRAIN_CACHE or ~/.cache/megatrain/profiles/<machine key>.json, which every "
                                 "command on this machine then uses; compute tables of other shapes measured before "
                                 "are kept)")
    p.add_argument("--wait-timeout", dest="wait_timeout", type=positive_float, default=600.0, metavar="SECONDS",
                   help="bound of every wait of a measurement; a hung copy or kernel ends with an error")
    p.add_argument("--collectives-only", dest="collectives_only", action="store_true",
                   help="under torchrun: measure only the collectives between the ranks (seconds) and write them "
                        "into the profile --base")
    p.add_argument("--base", help="with --collectives-only: the profile (shipped name or JSON) whose other fields the "
                                  "written profile keeps (default: the profile every command resolves: "
                                  "$MEGATRAIN_PROFILE, this machine's cached one, else h200-measured on CUDA, cpu)")
    p.set_defaults(func=run)


ADVICE = ("lower --batch / --seq, or profile on a machine with more memory; `megatrain plan --model ... --batch ... "
          "--seq ...` shows the full table")


def run(args) -> int:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    import torch

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.compile.knobs import resolve_knobs
    from megatrain.model.presets import get_model
    from megatrain.profiling import ProfileRequest, measure_profile
    from megatrain.profiling.calibrate import profile_host_reserve
    from megatrain.profiling.report import calibration_report

    models = [get_model(m.strip()) for m in args.model.split(",") if m.strip()]
    if not models:
        raise UserError("--model is empty")
    spec = models[0]
    batch = _ints(args.batch, "--batch")
    if len(batch) != 1:
        raise UserError("--batch takes one number (the largest batch; smaller ones are measured too)")
    seqs = _ints(args.seq, "--seq")
    dtypes = None
    if args.dtype:
        dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
        bad = [d for d in dtypes if d not in ("bf16", "fp32")]
        if bad or not dtypes:
            raise UserError(f"--dtype {args.dtype!r}: use bf16, fp32 or bf16,fp32")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device here; use --device cpu")
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise UserError("--cpu-threads must be at least 1")
    if not args.wait_timeout > 0:
        raise UserError("--wait-timeout must be a positive number of seconds")
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling import bench

    bench.WAIT_TIMEOUT_S = args.wait_timeout  # read by every bounded wait of the measurement
    _, knobs = resolve_knobs(args.schedule, args.set)
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.collectives_only:
        if ranks <= 1:
            raise UserError("--collectives-only measures collectives between ranks, and this is one process: launch "
                            "it under torchrun, e.g. `torchrun --standalone --nproc_per_node=2 -m megatrain profile "
                            "--collectives-only --device cuda --out FILE`")
        return _collectives_only(args, device, knobs, ranks)
    if args.base:
        raise UserError("--base goes with --collectives-only (a full profile measures every field)")
    _check_rank_device(args, device, ranks)
    if ranks > 1 and device == "cuda":  # this rank's GPU, before the memory check looks at one
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # Memory first, as `train` does: the real steps of a 2-layer cut at the largest batch and sequence (the
    # per-unit compute tables need no more than that), plus the copy buffers.
    from megatrain.train.fit import check_fits  # imports torch: the CLI loads it only for a command that runs
    from megatrain.profiling.overhead import profile_cut  # the cut the profile runs (torch: as above)
    print(f"profiling {', '.join(m.name for m in models)}, batch up to {batch[0]} x seq "
          f"{','.join(map(str, seqs))}, device {device}")  # the shape first, as every command that takes --batch
    note = host_measurement_note(models)
    if note:
        print(note)
    for shape in models:
        cut, cut_knobs = profile_cut(shape, knobs)
        check_fits(cut, batch[0], max(seqs), cut_knobs, device,
                   f"profiling {shape.name}", ADVICE, profile_host_reserve(spec, device, args.quick))
    req = ProfileRequest(spec, batch=batch[0], seqs=seqs, device=device, dtypes=dtypes, quick=args.quick,
                         knobs=knobs, cpu_threads=args.cpu_threads, name=args.name, also_models=models[1:])
    t0 = time.perf_counter()
    rec = None
    if ranks > 1:  # every rank measures the collectives; then rank 0 alone measures the rest
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        from megatrain.profiling.collectives import measure_launch, report

        rank, rec = measure_launch(device, knobs.weight_wire, args.wait_timeout, args.quick)
        if rank != 0:
            return 0
        print(report(rec))
    cal = measure_profile(req)
    if rec is not None:
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        from megatrain.profiling.collectives import with_collectives

        cal = replace(cal, profile=with_collectives(cal.profile, rec), measurements=dict(cal.measurements,
                                                                                           collectives=rec))
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling.store import save_measured

    path, raw = save_measured(cal, args.out)  # default: this machine's cache, earlier tables of other shapes kept
    print()
    print(calibration_report(cal))
    print()
    print(f"profile written to {path} (every timing in {raw}) after {time.perf_counter() - t0:.1f} s")
    if args.out:
        print(f"use it: megatrain simulate --profile {path} ...   megatrain compare --profile {path} ...   "
              f"(or export MEGATRAIN_PROFILE={path})")
    else:
        print("it is this machine's profile in the per-user cache: simulate, compare, train and --schedule auto on "
              "this machine use it unless --profile / run.profile / $MEGATRAIN_PROFILE say otherwise")
    return 0


def host_measurement_note(models) -> str | None:
    """The line `profile` prints when it measures several models whose layers differ in size: the host's
    measurements (the CPU update rate's estimates) use the first model's layer, and on two H200s the runtime's
    update of llama3-8b's layers ran 23% faster per parameter than bench-3b's (docs/accuracy.md), so the other
    models' host-bound predictions may be off by that much."""
    first, others = models[0], [m for m in models[1:] if m.layer_params != models[0].layer_params]
    if not others:
        return None
    names = ", ".join(m.name for m in others)
    return (f"note: the host's update rate is measured on {first.name}'s layer ({first.layer_params / 1e6:.1f} M "
            f"parameters) only; {names} will be predicted with it, though the update's rate per parameter varies "
            f"with the layer's size (docs/accuracy.md, 'Two GPUs on two H200s'): profile each alone (--model NAME) "
            f"for predictions its host update bounds")


def _check_rank_device(args, device: str, ranks: int) -> None:
    if ranks > 1 and device not in ("cuda", "cpu"):
        raise UserError(f"--device {args.device} under torchrun: give cuda (each rank measures the GPU of its "
                        "LOCAL_RANK) or cpu")


def _collectives_only(args, device: str, knobs, ranks: int) -> int:
    """`--collectives-only` (every rank): measure the collectives; rank 0 writes them into `--base`'s fields."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling.calibrate import Calibration
    from megatrain.profiling.collectives import measure_launch, report, with_collectives
    from megatrain.profiling.machine import this_machine
    from megatrain.profiling.store import resolve_profile
    from megatrain.sim.profile import load_profile

    _check_rank_device(args, device, ranks)
    choice = resolve_profile(device, flag=args.base, flag_name="--base")
    base_name = choice.profile
    if int(os.environ.get("RANK", "0")) == 0:
        print(choice.line())
    base = load_profile(base_name)  # before joining: a bad --base fails every rank alike, at once
    out = Path(args.out or f"runs/profile-collectives-{ranks}x{device}.json")
    t0 = time.perf_counter()
    rank, rec = measure_launch(device, knobs.weight_wire, args.wait_timeout, args.quick)
    if rank != 0:
        return 0
    profile = with_collectives(base, rec)
    notes = dict(profile.notes, measured=f"only the collectives (megatrain profile --collectives-only, {ranks} "
                 f"ranks); every other field is the profile {base_name}'s")
    profile = replace(profile, name=args.name or f"{base.name}-collectives-{ranks}", notes=notes)
    path, raw = Calibration(profile, {"machine": this_machine(device), "collectives": rec}).save(out)
    print()
    print(report(rec))
    print()
    print(f"profile written to {path} ({base_name} with the measured collectives; every timing in {raw}) after "
          f"{time.perf_counter() - t0:.1f} s")
    print(f"use it: megatrain simulate --gpus {ranks} --profile {path} ...")
    return 0
