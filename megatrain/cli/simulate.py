"""`megatrain simulate`: predict step time and GPU idle time of one schedule or a sweep of variants.

    megatrain simulate --model bench-3b --batch 8 --seq 2048 --schedule overlap \\
        --sweep buffers=1,2,3 --sweep optimizer=after,overlap [--set micro_batches=2] [--profile h200] [--out DIR]

The hardware profile is profiling/store.py's: --profile, else $MEGATRAIN_PROFILE, else this machine's profile in
the per-user cache, else the shipped h200-measured; one line says which and why.

Prints a comparison table (one row per variant, fastest first, times in milliseconds) and writes, per variant,
the predicted timeline (CSV and JSON), a Chrome trace, a Gantt chart, the summary and the resolved configuration;
`comparison.csv` holds the table (sweep order, seconds, as every file of the project). `--sweep` takes
knob=v1,v2,... (any ScheduleKnobs field, or `schedule` to compare named schedules / TOML files); several sweeps
multiply.

The output directory holds the latest simulation: the variant folders of an earlier `simulate` into the same
directory that this one does not write again are removed (only folders that `simulate` wrote: a config.json with
a "variant" key beside a timeline_sim.csv), so the folders always match comparison.csv.
"""
from __future__ import annotations

import itertools
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatrain.cli import UserError
from megatrain.cli.common import add_run_arguments, positive_float
from megatrain.units import GiB


def register(sub) -> None:
    p = sub.add_parser("simulate", help="predict step time and GPU idle time of schedules (no GPU needed)")
    add_run_arguments(p, model="bench-3b", batch=8, seq=2048)
    p.add_argument("--profile",
                   help="hardware profile: a profile JSON path, or a shipped one: h200-measured (run 7 of "
                        "docs/calibration.md), h200 (copy, matmul and AdamW ceilings of the GPU machine; not "
                        "calibrated), cpu. Default: $MEGATRAIN_PROFILE, else this machine's profile in the per-user "
                        "cache (`megatrain profile` writes it), else h200-measured (docs/profiles.md)")
    p.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2",
                   help="simulate every value (repeat to sweep several knobs; KNOB may be 'schedule')")
    p.add_argument("--out", help="artefact directory (default runs/simulate-<model>)")
    p.add_argument("--no-plots", action="store_true", help="skip the Gantt PNGs (the slowest artefact)")
    p.add_argument("--gpus", type=int, default=1, help="data parallel over this many GPUs of one host (--batch is "
                                                       "per GPU; the ranks share host memory bandwidth and CPU)")
    p.add_argument("--hosts", type=int, default=1,
                   help="data parallel over this many hosts of --gpus GPUs each (world = hosts x gpus): a rank shares "
                        "its host with --gpus ranks, collectives cross the network (the profile's inter_host_Bps "
                        "and inter_host_latency_s; defaults are assumptions, docs/multigpu.md)")
    p.add_argument("--clip-share", type=float, default=0.0, metavar="SHARE",
                   help="speculative clipping (clip > 0 with an arrival placement): the share of steps whose gradient "
                        "norm exceeds the max, so every update is undone and redone. 1: the timeline is of a step "
                        "that clips; between 0 and 1 the table's step_s is the mean over both kinds of step "
                        "(default 0: no step clips)")
    p.add_argument("--clip-activates", dest="clip_share", action="store_const", const=1.0,
                   help="the same as --clip-share 1: predict a step that clips")
    p.add_argument("--gpu-budget-gib", type=positive_float,
                   help="--schedule auto: the GPU memory the chosen schedule may plan for (default: this GPU's free "
                        "memory less 10%%)")
    p.set_defaults(func=run)


@dataclass
class Variant:
    """One simulation of a sweep: a schedule (name or TOML), the --set overrides and the swept knob values."""

    schedule: str
    sets: list[str]
    swept: list[tuple[str, str]]  # (knob, value) of the sweeps, schedule excluded

    @property
    def schedule_label(self) -> str:
        name = Path(self.schedule).stem if self.schedule.endswith(".toml") else self.schedule
        return name + (f"[{','.join(self.sets)}]" if self.sets else "")

    @property
    def knobs_label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.swept) or "-"

    @property
    def label(self) -> str:
        return self.schedule_label + ("" if not self.swept else f" {self.knobs_label}")

    @property
    def overrides(self) -> list[str]:
        return self.sets + [f"{k}={v}" for k, v in self.swept]


def parse_sweeps(items: list[str]) -> list[tuple[str, list[str]]]:
    """`knob=v1,v2` strings -> [(knob, [v1, v2])], values checked against the knob's type."""
    sweeps = []
    for item in items:
        if "=" not in item or not item.split("=", 1)[1].strip():
            raise UserError(f"--sweep {item!r} is not knob=v1,v2,... (e.g. --sweep buffers=1,2,3)")
        key, values = (s.strip() for s in item.split("=", 1))
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if key != "schedule":
            # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
            from megatrain.compile.knobs import parse_knob_value

            for v in vals:
                parse_knob_value(key, v)  # raises ScheduleError naming the knob and the expected type
        if any(key == k for k, _ in sweeps):
            raise UserError(f"--sweep {key} is given twice; list all its values in one --sweep")
        sweeps.append((key, vals))
    return sweeps


def variants(schedule: str, sets: list[str], sweeps: list[tuple[str, list[str]]]) -> list[Variant]:
    """The cartesian product of the sweeps, each on top of the schedule and the --set overrides."""
    out = []
    for combo in itertools.product(*[[(k, v) for v in vals] for k, vals in sweeps]):
        sched = next((v for k, v in combo if k == "schedule"), schedule)
        out.append(Variant(sched, list(sets), [(k, v) for k, v in combo if k != "schedule"]))
    return out


def slug(label: str) -> str:
    """Directory name of a variant: "overlap buffers=2,optimizer=after" -> overlap_buffers-2_optimizer-after."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label.replace("=", "-")).strip("_") or "variant"


# Printed column -> (row key, scale, format): rows hold seconds, as every file does; the table shows milliseconds.
COLUMNS = {"step ms": ("step_s", 1e3, "{:.2f}"), "tokens/s": ("tokens/s", 1, "{:,.0f}"),
           "TFLOP/s": ("TFLOP/s", 1, "{:.1f}"), "GPU idle %": ("GPU idle %", 1, "{:.1f}"),
           "wait weights ms": ("wait weights s", 1e3, "{:.2f}"),
           "wait optimizer ms": ("wait optimizer s", 1e3, "{:.2f}"),
           "wait gradients ms": ("wait gradients s", 1e3, "{:.2f}"), "GPU peak GiB": ("GPU peak GiB", 1, "{:.2f}"),
           # the physical bound of the step (sim/bound.py), what binds it, and the predicted step's share of it
           "bound ms": ("bound_s", 1e3, "{:.2f}"), "binds": ("bound_binds", 1, "{}"),
           "eff %": ("efficiency", 100, "{:.0f}")}


def table(rows: list[dict]) -> str:
    """Aligned text table of the comparison rows, fastest first, times in milliseconds (a failed variant shows
    its error instead of numbers, after the others)."""
    rows = sorted(rows, key=lambda r: (1, 0.0) if "error" in r else (0, r["step_s"]))
    header = ["schedule", "knobs", *COLUMNS]
    cells = [[r["schedule"], r["knobs"]] + ([fmt.format(r[key] * scale) for key, scale, fmt in COLUMNS.values()]
                                            if "error" not in r else []) for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells if i < len(c)]) for i, h in enumerate(header)]

    def line(xs):
        return "  ".join(x.rjust(w) if i > 1 else x.ljust(w) for i, (x, w) in enumerate(zip(xs, widths))).rstrip()

    out = [line(header)]
    for r, c in zip(rows, cells):
        out.append(line(c) + ("  " + r["error"] if "error" in r else ""))
    return "\n".join(out)


def row_of(v: Variant, result) -> dict:
    """The comparison row of one simulated variant (a megatrain.sim.SimResult), in seconds."""
    s, mean = result.summary, result.mean_step_s  # mean: over steps that clip and steps that do not (--clip-share)
    return {"schedule": v.schedule_label, "knobs": v.knobs_label, "step_s": mean,
            "tokens/s": s.tokens_per_s * s.step_s / mean if mean > 0 else s.tokens_per_s,
            "TFLOP/s": s.model_tflops, "GPU idle %": 100 * s.gpu_idle_frac, "wait weights s": s.wait_s["weights"],
            "wait optimizer s": s.wait_s["optimizer"], "wait gradients s": s.wait_s["gradients"],
            "GPU peak GiB": s.gpu_peak_bytes / GiB, **bound_fields(result)}


def bound_fields(result) -> dict:
    """The bound's fields of a row (sim/bound.py), the efficiency of the mean predicted step against it, and the
    compute tasks priced from FLOPs (sim/estimates.py): count and share of the simulated step."""
    bound = result.bound
    return {**bound.to_dict(), "efficiency": bound.efficiency(result.mean_step_s),
            "estimated_tasks": sum(result.estimated.values()), "compute_tasks": result.compute_tasks,
            "estimated_share": result.estimated_s / result.step_s if result.step_s > 0 else 0.0}


def write_artefacts(directory: Path, result, config: dict, plots: bool = True) -> None:
    """timeline_sim.csv / .json, trace.json, gantt.png, summary.json, config.json of one variant."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.analysis.viz import gantt, write_chrome_trace

    directory.mkdir(parents=True, exist_ok=True)
    tl = result.timeline
    tl.to_csv(directory / "timeline_sim.csv", index=False)
    tl.astype(object).where(tl.notna(), None).to_json(directory / "timeline_sim.json", orient="records", indent=1)
    write_chrome_trace(directory / "trace.json", tl, result.program)
    summary = {**result.summary.to_dict(), **bound_fields(result), "estimated": result.estimated}
    (directory / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if plots:
        s = result.summary
        gantt(tl, directory / "gantt.png", title=f"{config['variant']}: step {s.step_s * 1e3:.1f} ms, "
                                                 f"GPU idle {100 * s.gpu_idle_frac:.1f}%")


def remove_stale_variants(out: Path, keep: set[str]) -> list[Path]:
    """Remove the variant folders an earlier `simulate` wrote into `out` that are not in `keep` (folder names)."""
    removed = []
    if not out.is_dir():
        return removed
    for d in sorted(out.iterdir()):
        if d.name in keep or not d.is_dir() or not (d / "timeline_sim.csv").is_file():
            continue
        try:
            written_by_simulate = "variant" in json.loads((d / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            written_by_simulate = False
        if written_by_simulate:
            shutil.rmtree(d)
            removed.append(d)
    return removed


def _choose(args, spec, profile, out: Path) -> Path:
    """`--schedule auto`: the fastest predicted schedule that fits the GPU budget and keeps the numerics of the
    --set knobs (megatrain/tune/auto.py, the rule every `auto` follows); printed with the next best, and written as
    a schedule file. The host is not checked: the prediction is for the profile's machine."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.ir.dag import ScheduleError
    from megatrain.compile.knobs import DEFAULT_SCHEDULE, resolve_knobs
    from megatrain.tune.auto import BudgetError, auto_budget, choose_auto
    from megatrain.sim.estimates import estimate_line
    from megatrain.cli.common import write_schedule_file

    try:
        budget = auto_budget("cuda", args.gpu_budget_gib, with_host=False)
        pick = choose_auto(spec, args.batch, args.seq, resolve_knobs(DEFAULT_SCHEDULE, args.set)[1], profile, budget,
                           world=args.gpus)
    except (BudgetError, ScheduleError) as e:
        raise UserError(str(e)) from None
    table = pick.table.head(5).assign(step_ms=lambda d: (1e3 * d.step_s).round(1)).drop(columns="step_s")
    print(f"--schedule auto ({budget.gpu_bytes / GiB:.1f} GiB GPU budget, profile {pick.profile}): "
          f"{len(pick.table)} schedules fit; the fastest five:")
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.1f}"))
    path = write_schedule_file(out / "auto_schedule.toml", pick.knobs)
    print(f"chosen: {pick.label} (written to {path})")
    estimated = estimate_line(pick.predicted, args.model)  # no silent FLOP fallback: auto's ranking rests on it
    if estimated:
        print(estimated)
    return path


def print_limits(results: dict, model: str) -> None:
    """The physical bound of the fastest variant (the table has every variant's) and, when the prediction rests on
    compute tasks priced from FLOPs, the line that says so (the fastest variant's, else the first that has one)."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.sim.estimates import estimate_line

    if not results:
        return
    label, best = min(results.items(), key=lambda kv: kv[1].mean_step_s)
    b, which = best.bound, f" of {label}" if len(results) > 1 else ""
    print(f"limit{which}: {b.describe()}; predicted step {1e3 * best.mean_step_s:.2f} ms, efficiency "
          f"{100 * b.efficiency(best.mean_step_s):.0f}% (bound / step)")
    lines = [(k, estimate_line(r, model)) for k, r in [(label, best), *results.items()]]
    shown = next(((k, text) for k, text in lines if text), None)
    if shown:
        print((f"{shown[0]}: " if len(results) > 1 else "") + shown[1])


def check_world(args) -> int:
    """The world size of `--gpus` per host x `--hosts` (both at least 1)."""
    for flag, n in (("--gpus", args.gpus), ("--hosts", args.hosts)):
        if n < 1:
            raise UserError(f"{flag} {n}: give at least 1")
    return args.gpus * args.hosts


def parallelism_of(args):
    """The run's Parallelism of `--gpus` per host x `--hosts` (what the resolver takes, megatrain/ir/placement.py)."""
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.ir.placement import Parallelism

    return Parallelism(world=check_world(args), hosts=args.hosts)


def run(args) -> int:
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    import pandas as pd

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.compile.builders import build_schedule
    from megatrain.ir.dag import ScheduleError
    from megatrain.compile.knobs import resolve_knobs
    from megatrain.compile.lower import lower
    from megatrain.model.presets import get_model
    from megatrain.sim import ProfileError, SimulationError, load_profile, simulate

    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    import megatrain.parallel  # noqa: F401  (registers the collective strategies' passes and costs)
    from megatrain.ir.facts import StepFacts

    spec = get_model(args.model)
    world = check_world(args)
    try:
        facts = StepFacts(clip_share=args.clip_share)
    except ValueError as e:
        raise UserError(f"--clip-share: {e}") from None
    # imported when the command runs: building the parser (`megatrain --help`) loads no torch, pandas or simpy
    from megatrain.profiling.machine import mismatch_line
    from megatrain.profiling.store import reprofile_command, resolve_profile

    # simulate predicts a GPU run: without a profile of this machine, the shipped GPU profile (said so)
    choice = resolve_profile("cuda", flag=args.profile)
    try:
        profile = load_profile(choice.profile)
    except ProfileError as e:
        raise UserError(str(e)) from None
    out = Path(args.out or f"runs/simulate-{spec.name}")
    line = choice.explicit and mismatch_line(profile, profile.name, reprofile_command(
        "cuda", args.model, args.batch, args.seq), " (into this machine's cache, which simulate then uses)")
    hosts = f" x {args.hosts} hosts" if args.hosts > 1 else ""
    # the shape first, as every command that takes --batch (each has its own default: --help)
    print(f"{spec.name}, batch {args.batch} x seq {args.seq}" + (f" per GPU x {args.gpus} GPUs{hosts}" if world > 1
                                                                 else "") + f", profile {profile.name}")
    if args.schedule == "auto":
        if args.hosts > 1:
            raise UserError("--schedule auto chooses for one host; with --hosts > 1 name a schedule (e.g. "
                            "--schedule arrival), or choose one with --hosts 1 first")
        args.schedule, args.set = str(_choose(args, spec, profile, out)), []
    runs = variants(args.schedule, args.set, parse_sweeps(args.sweep))
    rows, written, notes, results = [], set(), set(), {}
    for v in runs:
        try:
            name, knobs = resolve_knobs(v.schedule, v.overrides)
            program = lower(build_schedule(spec, args.batch, args.seq, knobs, world=parallelism_of(args)))
            program.name = name
            result = simulate(program, profile, facts)
            notes.update(program.placement.notes)
        except (ScheduleError, SimulationError) as e:
            if len(runs) == 1:
                raise UserError(str(e)) from None
            rows.append({"schedule": v.schedule_label, "knobs": v.knobs_label,
                         "error": "skipped: " + str(e).splitlines()[0]})
            continue
        config = {"variant": v.label, "schedule": name, "model": spec.name, "batch": args.batch, "seq": args.seq,
                  "knobs": knobs.to_dict(), "profile": profile.name}
        write_artefacts(out / slug(v.label), result, config, plots=not args.no_plots)
        written.add(slug(v.label))
        rows.append(row_of(v, result))
        results[v.label] = result
    stale = remove_stale_variants(out, written)
    print(table(rows))
    print(choice.line())  # which profile and why, below the table (the table's header is the second line)
    if args.hosts > 1:
        print(f"(one rank's step: tokens/s and TFLOP/s are per GPU; each host trains {args.gpus}x the tokens, the "
              f"job {world}x; collectives cross hosts at most {args.gpus} x {profile.inter_host_Bps / 1e9:g} GB/s, "
              f"latency {profile.inter_host_latency_s * 1e6:g} us)")
    elif args.gpus > 1:
        print(f"(one rank's step: tokens/s and TFLOP/s are per GPU; the host trains {args.gpus}x the tokens)")
    for note in sorted(notes):  # settings the model's shape clamps (Placement.notes)
        print(f"note: {note}")
    if line:  # the profile was measured on another machine (or records none)
        print(line)
    print_limits(results, args.model)
    good = [r for r in rows if "error" not in r]
    if good:
        pd.DataFrame(rows).to_csv(out / "comparison.csv", index=False)
        if len(good) > 1:
            best = min(good, key=lambda r: r["step_s"])
            print(f"fastest: {best['schedule']} {best['knobs']} ({best['step_s'] * 1e3:.1f} ms)")
        print(f"artefacts (timeline_sim.csv/.json, trace.json, gantt.png per variant) in {out}/"
              + (f"; removed {len(stale)} variant folder(s) of an earlier simulate there" if stale else ""))
    return 0 if good else 1
