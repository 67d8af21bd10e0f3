"""`megatrain compare`: run real steps of schedules, simulate the same Programs, compare them task by task.

    megatrain compare --model debug --batch 4 --seq 64 --schedule overlap,arrival --steps 6 [--rounds 3]
        [--profile FILE | --measure-profile [--quick]] [--set knob=value] [--sweep knob=v1,v2] [--device auto]
        [--out DIR]

Every variant (`--sweep`, or a comma-separated --schedule) is measured in this one process by
`profiling.rounds.measure_rounds`: one host store, taken over in place by each host layout in turn, the variants
taking turns on it, interleaved over `--rounds` rounds; each (variant, round) is a line of DIR/rows.jsonl (knobs,
Program hash, step times, clipping share, prediction), written as it is measured, and its timed steps' timelines are
appended to DIR/timelines.csv.gz. Per variant, of its median round: step time, GPU idle % and tokens/s predicted vs
measured, the per-task error distribution by task group (median and p90 of |pred - meas| / meas of each task's
ready-to-done time), the tasks with the largest error; and in DIR/<variant>/ the timelines (CSV), tasks.csv,
by_group.csv, compare.json, trace.json (predicted and measured stacked, one process each) and gantt.png (side by
side). Then the step table (median over rounds, with min-max when there are several) and, with several variants, the
ranking by predicted and by measured step time and whether the orders agree.
"""
from __future__ import annotations

import gzip
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
    p.add_argument("--steps", type=positive_int, default=6,
                   help="steps per variant and round: after each switch to the variant one warm-up step (not "
                        "compared), then STEPS-1 timed steps")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="measure every variant this many times, interleaved (round r measures each variant once "
                        "before round r+1); the step table gives the median over rounds with min-max")
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
    from megatrain.ir.dag import ScheduleError
    from megatrain.compile.knobs import resolve_knobs
    from megatrain.model.presets import get_model
    from megatrain.profiling.compare import compare
    from megatrain.profiling.rounds import layout_groups, measure_rounds

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
    resolved = {}
    for v in runs:
        if v.label in resolved:
            raise UserError(f"variant {v.label} is asked for twice; give each schedule once")
        try:
            resolved[v.label] = resolve_knobs(v.schedule, v.overrides)[1]
        except ScheduleError as e:
            raise UserError(f"{v.label}: {e}") from None
    out = Path(args.out or f"runs/compare-{spec.name}")
    groups = layout_groups(spec, resolved)
    print(f"{spec.name}: {spec.num_params / 1e6:.2f} M parameters, batch {args.batch} x seq {args.seq}, device "
          f"{device}; {len(resolved)} variant(s) x {args.rounds} round(s), {args.steps} steps each (1 warm-up, "
          f"{args.steps - 1} timed)")  # the shape first, as every command that takes --batch
    _check_memory(args, spec, device, groups)
    if args.measure_profile:
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        from megatrain.profiling.calibrate import profile_host_reserve
        from megatrain.train.fit import check_fits  # imports torch: the CLI loads it only for a command that runs

        first = next(iter(resolved.values()))
        check_fits(spec.with_layers(min(2, spec.num_layers)), args.batch, args.seq, first, device,
                   "measuring the profile", ADVICE, profile_host_reserve(spec, device, args.quick))
    profile = _profile_for(args, spec, device, next(iter(resolved.values())), out)
    print(f"profile {profile.name}: {profile.description}")
    out.mkdir(parents=True, exist_ok=True)
    on_row = _row_writer(out)
    try:
        rows = measure_rounds(spec, resolved, args.batch, args.seq, rounds=args.rounds, warmup=1,
                              steps=args.steps - 1, device=device, predict={profile.name: profile}, on_row=on_row,
                              log=print)
    except (ScheduleError, ValueError) as e:
        raise UserError(str(e)) from None
    by: dict[str, list] = {}
    for row in rows:
        by.setdefault(row.config, []).append(row)
    results = {}
    for label in resolved:  # in the order asked for
        rs = sorted(by[label], key=lambda r: r.median_step_s)
        rep = rs[(len(rs) - 1) // 2]  # the median round (lower median)
        print(f"\n== {label} ==" + (f" (round {rep.round}: the median of {len(rs)} rounds)" if len(rs) > 1 else ""))
        c = compare(rep.program, rep.timelines, profile, warmup=0)
        print(c.report(args.worst))
        paths = c.write(out / slug(label), plots=not args.no_plots)
        print(f"artefacts in {paths['summary'].parent}/ (trace.json: predicted and measured stacked"
              f"{'; gantt.png side by side' if 'gantt' in paths else ''})")
        results[label] = c
    _step_table(rows, list(resolved), profile.name, args.rounds, out)
    pd.DataFrame([c.headline() for c in results.values()]).to_csv(out / "comparison.csv", index=False)
    print(f"\nsummary of every variant (its median round) in {out / 'comparison.csv'}; every (variant, round) in "
          f"{out / 'rows.jsonl'}, their timed steps in {out / 'timelines.csv.gz'}")
    return 0


def _check_memory(args, spec, device: str, groups: list[dict]) -> None:
    """Memory first, as `train` does. One host store lives at a time (the layout group's, measure_rounds), and a
    switch frees a variant's GPU buffers before the next variant's are allocated: so each variant is checked with
    its group's store and its own buffers and activations, nothing shared besides."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.ir.dag import ScheduleError
    from megatrain.train.fit import check_fits

    for g, group in enumerate(groups):
        for label, knobs in group.items():
            try:
                check_fits(spec, args.batch, args.seq, knobs, device, f"compare's variant {label}", ADVICE)
            except ScheduleError as e:
                raise UserError(f"{label}: {e}") from None
    print(f"memory: fits; one host store taken over in place by each of {len(groups)} host layout(s) in turn ("
          + "; ".join(f"{', '.join(group)}" for group in groups)
          + "), each variant checked with its layout's store and its own GPU buffers and activations")


def _row_writer(out: Path):
    """on_row for measure_rounds: one JSON line per (variant, round) in rows.jsonl and its timed steps' timelines
    in timelines.csv.gz (columns config, round, timed_step added), both appended as each row is measured, so an
    interrupted run keeps what it measured. Both files are started afresh by this run."""
    rows_path, tl_path = out / "rows.jsonl", out / "timelines.csv.gz"
    rows_path.write_text("")
    gzip.open(tl_path, "wt").close()
    columns: list[str] = []

    def on_row(row) -> None:
        with open(rows_path, "a") as f:
            f.write(json.dumps(row.to_dict()) + "\n")
        # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
        import pandas as pd

        steps = pd.concat([t.assign(config=row.config, round=row.round, timed_step=i)
                           for i, t in enumerate(row.timelines)], ignore_index=True)
        first = not columns
        columns[:] = columns or list(steps.columns)
        with gzip.open(tl_path, "at") as f:  # one gzip member per row: a reader sees one CSV
            steps.reindex(columns=columns).to_csv(f, header=first, index=False)

    return on_row


def _step_table(rows: list, order: list[str], label: str, rounds: int, out: Path) -> None:
    """Per variant the median over rounds of each round's median timed step (min-max over rounds when several),
    the prediction with the measured clipping share and its error; with several variants their ranks by predicted
    and by measured step, Kendall's tau, and DIR/ranking.json."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling.compare import kendall_tau
    from megatrain.profiling.rounds import median_table

    tab = median_table(rows, [label]).set_index("config").loc[order].reset_index()
    tab = tab.rename(columns={"config": "variant", "step_s": "meas_step_s", f"pred_s[{label}]": "pred_step_s"})
    tab["step_err_pct"] = 100 * tab.pop(f"error[{label}]")
    tab["pred_rank"] = tab["pred_step_s"].rank(method="min").astype(int)
    tab["meas_rank"] = tab["meas_step_s"].rank(method="min").astype(int)
    shown = tab.assign(wall_ms=tab["meas_step_s"] * 1e3, min_ms=tab["min_s"] * 1e3, max_ms=tab["max_s"] * 1e3,
                       pred_ms=tab["pred_step_s"] * 1e3)
    cols = ["variant", "wall_ms", *(["min_ms", "max_ms"] if rounds > 1 else []), "pred_ms", "step_err_pct",
            "tokens_per_s", "clip_share", *(["pred_rank", "meas_rank"] if len(tab) > 1 else [])]
    what = (f"median over {rounds} rounds of each round's median timed step, min-max over rounds" if rounds > 1
            else "median timed step")
    # Wall clock, as `train` and the benchmarks count a step (tokens/s); the per-variant reports above compare
    # timelines, first task start to last end, which leave out the host work between steps (0.4-1.6% of a GPU step:
    # median_step_s against median_span_s of the 63 rows in docs/runs/24-accuracy/h200-run1/acc-*.tgz rows.jsonl;
    # more of a short CPU-backend step): the two are different quantities, named so.
    print(f"\nwall-clock step time per variant ({what}; trainer.step's wall clock, which tokens/s counts; the "
          f"reports above compare timelines, which leave out host work between steps; predicted with {label} at "
          f"the measured clipping share{'; rank 1 = fastest' if len(tab) > 1 else ''}):")
    print(shown[cols].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    if len(tab) > 1:
        tau = kendall_tau(list(tab["pred_step_s"]), list(tab["meas_step_s"]))
        same = list(tab["pred_rank"]) == list(tab["meas_rank"])
        print(f"same order predicted and measured: {'yes' if same else 'no'} (Kendall tau {tau:.2f})")
        keep = ["variant", "rounds", "pred_step_s", "meas_step_s", "min_s", "max_s", "step_err_pct", "clip_share",
                "program_hash", "pred_rank", "meas_rank"]
        (out / "ranking.json").write_text(json.dumps({"same_order": same, "kendall_tau": tau, "rounds": rounds,
                                                      "rows": tab[keep].to_dict(orient="records")}, indent=1) + "\n")
