"""`megatrain compare`: run real steps of a schedule, simulate the same Program, compare them task by task.

    megatrain compare --model debug --batch 4 --seq 64 --schedule overlap --steps 6 [--profile FILE |
        --measure-profile [--quick]] [--set knob=value] [--sweep knob=v1,v2] [--device auto] [--out DIR]

Per variant: step time, GPU idle % and tokens/s predicted vs measured, the per-task error distribution by task
group (median and p90 of |pred - meas| / meas of each task's ready-to-done time), the tasks with the largest
error; and in DIR/<variant>/ the timelines (CSV), tasks.csv, by_group.csv, compare.json, trace.json (predicted
and measured stacked, one process each) and gantt.png (side by side). With several variants (`--sweep`, or a
comma-separated --schedule) it ranks them by predicted and by measured step time and says whether the orders agree.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

from megatrain.cli import UserError
from megatrain.cli.common import add_run_arguments, positive_int
from megatrain.cli.simulate import parse_sweeps, slug, variants

ADVICE = ("lower --batch / --seq, compare a smaller model (a preset such as debug, or fewer layers in a copy of "
          "the HF config), or set a knob that the planner lists with --set knob=value; `megatrain plan` shows the "
          "full table")


def register(sub) -> None:
    p = sub.add_parser("compare", help="run real steps and the simulator on the same Program; compare task by task")
    add_run_arguments(p, model="debug", batch=4, seq=64,
                      schedule_help="named schedule or TOML file; several, comma-separated, are compared and ranked")
    p.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2",
                   help="compare every value (repeat to sweep several knobs)")
    p.add_argument("--steps", type=positive_int, default=6, help="measured steps per variant (the first is a warm-up)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="hardware profile: a JSON from `megatrain profile`, or h200-measured, h200, "
                     "cpu (default: $MEGATRAIN_PROFILE, else this machine's profile in the per-user cache, else the "
                     "shipped profile of the device: docs/profiles.md)")
    src.add_argument("--measure-profile", action="store_true",
                     help="run `megatrain profile` for this model and batch first (written to DIR/profile.json)")
    p.add_argument("--quick", action="store_true", help="with --measure-profile: the quick profile")
    p.add_argument("--worst", type=int, default=8, help="how many largest-error tasks to list")
    p.add_argument("--out", help="artefact directory (default runs/compare-<model>)")
    p.add_argument("--no-plots", action="store_true", help="skip the Gantt PNGs")
    p.set_defaults(func=run)


def _profile_for(args, spec, device: str, first_knobs, out: Path):
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling import ProfileRequest, measure_profile
    from megatrain.sim import ProfileError, load_profile

    if args.measure_profile:
        req = ProfileRequest(spec, batch=args.batch, seqs=[args.seq], device=device,
                             dtypes=[first_knobs.compute_dtype], quick=args.quick, knobs=first_knobs)
        cal = measure_profile(req)
        path, _ = cal.save(out / "profile.json")
        print(f"profile: {path} (--measure-profile: measured just now)")
        return cal.profile
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling.machine import mismatch_line
    from megatrain.profiling.store import reprofile_command, resolve_profile

    choice = resolve_profile(device, flag=args.profile)
    print(choice.line())
    try:
        profile = load_profile(choice.profile)
    except ProfileError as e:
        raise UserError(str(e)) from None
    line = choice.explicit and mismatch_line(profile, profile.name, reprofile_command(
        device, args.model, args.batch, args.seq), " (into this machine's cache, which compare then uses)")
    if line:
        print(line)
    return profile


def run(args) -> int:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    import pandas as pd
    import torch

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.model.init import init_tiles
    from megatrain.ir.dag import ScheduleError
    from megatrain.compile.knobs import resolve_knobs
    from megatrain.model.presets import get_model
    from megatrain.profiling.compare import compare, kendall_tau, measure_steps, ranking

    if args.steps < 2:
        raise UserError(f"--steps {args.steps}: compare needs at least 2 steps (the first is a warm-up)")
    if args.batch < 1 or args.seq < 1:
        raise UserError("--batch and --seq must be positive")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {args.device}: no CUDA device here; use --device cpu")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_model(args.model)
    schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
    runs = [v for s in schedules for v in variants(s, args.set, parse_sweeps(args.sweep))]
    resolved = []
    for v in runs:
        try:
            resolved.append((v, *resolve_knobs(v.schedule, v.overrides)))
        except ScheduleError as e:
            raise UserError(f"{v.label}: {e}") from None
    out = Path(args.out or f"runs/compare-{spec.name}")
    # Memory first, as `train` does: every variant's host store, buffers and activations against this machine
    # (with several variants, one fp32 copy of the initial weights is shared by all of them and held throughout).
    shared = 4 * spec.num_params if len(resolved) > 1 else 0
    print(f"{spec.name}: {spec.num_params / 1e6:.2f} M parameters, batch {args.batch} x seq {args.seq}, device "
          f"{device}; {args.steps} steps per variant")  # the shape first, as every command that takes --batch
    from megatrain.train.fit import check_fits  # imports torch: the CLI loads it only for a command that runs
    for v, _, knobs in resolved:
        check_fits(spec, args.batch, args.seq, knobs, device, f"compare's variant {v.label}", ADVICE, shared)
    if args.measure_profile:
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        from megatrain.profiling.calibrate import profile_host_reserve

        check_fits(spec.with_layers(min(2, spec.num_layers)), args.batch, args.seq, resolved[0][2], device,
                   "measuring the profile", ADVICE, profile_host_reserve(spec, device, args.quick))
    profile = _profile_for(args, spec, device, resolved[0][2], out)
    print(f"profile {profile.name}: {profile.description}")
    tiles = init_tiles(spec) if len(resolved) > 1 else None  # one initialization shared by every variant
    results = {}
    for v, name, knobs in resolved:
        print(f"\n== {v.label} ==")
        try:
            program, steps = measure_steps(spec, knobs, args.batch, args.seq, args.steps, device, name=v.label,
                                           tiles=tiles, log=print)
        except (ScheduleError, ValueError) as e:
            raise UserError(f"{v.label}: {e}") from None
        c = compare(program, steps, profile)
        gc.collect()  # free this variant's host store (and its page-locking) before the next one's
        print(c.report(args.worst))
        paths = c.write(out / slug(v.label), plots=not args.no_plots)
        print(f"artefacts in {paths['summary'].parent}/ (trace.json: predicted and measured stacked"
              f"{'; gantt.png side by side' if 'gantt' in paths else ''})")
        results[v.label] = c
    heads = pd.DataFrame([c.headline() for c in results.values()])
    out.mkdir(parents=True, exist_ok=True)
    heads.to_csv(out / "comparison.csv", index=False)
    if len(results) > 1:
        rk = ranking(results)
        tau = kendall_tau(list(rk["pred_step_s"]), list(rk["meas_step_s"]))
        print("\nranking (1 = fastest):")
        print(rk.assign(pred_ms=rk["pred_step_s"] * 1e3, meas_ms=rk["meas_step_s"] * 1e3)[
            ["variant", "pred_ms", "meas_ms", "step_err_pct", "pred_rank", "meas_rank"]].to_string(
            index=False, float_format=lambda x: f"{x:.2f}"))
        same = list(rk["pred_rank"]) == list(rk["meas_rank"])
        print(f"same order predicted and measured: {'yes' if same else 'no'} (Kendall tau {tau:.2f})")
        (out / "ranking.json").write_text(json.dumps({"same_order": same, "kendall_tau": tau,
                                                      "rows": rk.to_dict(orient="records")}, indent=1) + "\n")
    print(f"\nsummary of every variant in {out / 'comparison.csv'}")
    return 0
