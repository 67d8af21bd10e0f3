"""Out-of-sample accuracy of the simulator, as a standing benchmark (issue 24 item 3).

Two steps, so that the GPU machine only measures and every prediction is recomputed anywhere from the raw files:

    # on the GPU machine, once per shape (each writes OUT/<model>/: a fresh quick profile, rows.jsonl, timelines)
    PYTHONPATH=. python scripts/accuracy.py measure --model bench-3b --batch 8 --seq 2048 --out OUT
    PYTHONPATH=. python scripts/accuracy.py measure --model scripts/shapes/llama-4.5b --batch 4 --seq 4096 ...
    # anywhere (CPU is fine): the table of prediction errors
    PYTHONPATH=. python scripts/accuracy.py report OUT --calibrate-on bench-3b:arrival

`measure` profiles the machine for the shape (`megatrain profile --quick`, eager and compiled layer), then measures
every schedule of SCHEDULES in one process (megatrain/profiling/rounds.py: one host store, taken over in place by
each host layout, the schedules interleaved over rounds), writing each (schedule, round) row as it is measured.

`ablate DIR --model M` rebuilds one shape's quick profile from its measurements with parts of the profiler's method
left out (one weight wire; the default device redo; copies not slowed beside the update) or the CPU update rate
taken from one of its three estimates instead of their median, and prints each row's (a) error with each.
`report --rebuild VARIANT` evaluates a whole directory with profiles rebuilt that way (older measurements under
today's profiler).

`copies DIR...` measures, in the recorded steps, how much slower a layer's compute tasks ran while copies were in
flight than the quick profile's table for them (which is timed alone): per kind, the ratio against the fraction of
the task a copy overlapped, fitted as ratio = a + (k - 1) x fraction (k: the profile's `compute_beside_copy`).
`report --compute-beside-copy F=k,R=k,B=k` evaluates a directory with those factors in its quick profiles: taken
from another machine's steps, an out-of-sample test of the rule; from the same machine's, in-sample.

`report` predicts every measured row two ways and compares with the median over rounds:
  (a) "quick": from the fresh quick profiles of that machine (every shape's compute tables, no training run);
  (b) "transfer": from the quick profile calibrated (profiling/live.py) on the timed steps of ONE run of one
      schedule and shape (`--calibrate-on MODEL:SCHEDULE`, round 0). Rows of that shape or that schedule are
      labelled "same shape" / "same schedule"; the run itself is in-sample; the summary of (b) counts only rows of
      another shape and another schedule.
Per shape it gives Kendall's tau-b of predicted against measured order, and for every row whose error exceeds
10% the task groups the simulator got most wrong (median signed error per group, profiling/compare.py).
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

# The schedules of the standing benchmark: clipping on and off, compiled and eager, each placement family.
SCHEDULES: dict[str, tuple[str, list[str]]] = {
    "arrival": ("arrival", []),
    "arrival+clip": ("arrival", ["clip=1.0"]),
    "arrival-resident-2": ("arrival-resident", ["resident_layers=2"]),
    "arrival-resident-2+clip": ("arrival-resident", ["resident_layers=2", "clip=1.0"]),
    "overlap": ("overlap", []),
    "overlap-split+compiled": ("overlap-split", ["compile_layers=true"]),
    "lean": ("lean", []),
}


def _schedule_of(name: str) -> tuple[str, list[str]]:
    """A benchmark schedule's (named schedule, knob overrides): one of SCHEDULES, or `SCHEDULE+KNOB=VALUE+...`
    (e.g. `lean+compile_layers=true+resident_layers=2`) for the named schedules that `auto` is compared with."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    base, *sets = name.split("+")
    if not all("=" in s for s in sets):
        raise SystemExit(f"--schedules: {name!r} is neither one of {', '.join(SCHEDULES)} nor "
                         "SCHEDULE+KNOB=VALUE+...; write e.g. lean+compile_layers=true")
    return base, sets


def _slug(model: str) -> str:
    path = Path(model)
    return path.parent.name if path.name == "config.json" else path.name


def measure(a) -> int:
    import torch

    from megatrain.compile.knobs import resolve_knobs
    from megatrain.model.presets import get_model
    from megatrain.profiling.calibrate import ProfileRequest, measure_profile, slowest_phases
    from megatrain.profiling.rounds import measure_rounds

    spec = get_model(a.model)
    out = Path(a.out) / _slug(a.model)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "a")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    names = a.schedules.split(",") if a.schedules else list(SCHEDULES)
    schedules = {n: resolve_knobs(*_schedule_of(n))[1] for n in names}
    say(f"{spec.name}: {spec.num_params / 1e9:.2f} B parameters, batch {a.batch} x seq {a.seq}, "
        f"{len(schedules)} schedules x {a.rounds} rounds, device {a.device}")
    profile_path = out / "profile-quick.json"
    if a.profile:
        profile_path = Path(a.profile)
        say(f"profile: {profile_path} (given)")
    elif not profile_path.is_file():
        t0 = time.perf_counter()
        base = next(iter(schedules.values()))
        # compile_layers on: the quick profile measures the decoder layer compiled and eager (units.layer_variants)
        knobs = replace(base, compile_layers=True, clip=0.0)
        cal = measure_profile(ProfileRequest(spec, batch=a.batch, seqs=[a.seq], device=a.device,
                                             dtypes=[base.compute_dtype], quick=True, knobs=knobs),
                              log=lambda line: None)
        cal.save(profile_path)
        say(f"profile: {profile_path} (measured now, --quick, layer eager + compiled, "
            f"{time.perf_counter() - t0:.1f} s; longest: {slowest_phases(cal.measurements)})")
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.profile_only:
        return 0
    rows_path = out / "rows.jsonl"
    tl_parts: list = []
    done: set = set()
    if rows_path.is_file():  # a resumed measurement: keep what was measured, measure the rest
        import pandas as pd

        done = {(r["config"], r["round"]) for r in map(json.loads, rows_path.read_text().splitlines()) if r}
        if (out / "timelines.csv.gz").is_file():
            tl_parts.append(pd.read_csv(out / "timelines.csv.gz"))
        say(f"resuming: {len(done)} (schedule, round) rows already measured in {rows_path}")
    todo = {n: k for n, k in schedules.items() if any((n, r) not in done for r in range(a.rounds))}
    if not todo:
        say("every row is measured already")
        return 0

    def on_row(row) -> None:
        with open(rows_path, "a") as f:
            f.write(json.dumps(row.to_dict()) + "\n")
        for i, t in enumerate(row.timelines):
            tl_parts.append(t.assign(config=row.config, round=row.round, timed_step=i))
        import pandas as pd

        pd.concat(tl_parts).to_csv(out / "timelines.csv.gz", index=False)  # rewritten: an interruption keeps it

    t0 = time.perf_counter()
    rows = measure_rounds(spec, todo, a.batch, a.seq, rounds=a.rounds, warmup=a.warmup, steps=a.steps,
                          device=a.device, predict={"quick": str(profile_path)}, on_row=on_row, log=say, skip=done)
    total = time.perf_counter() - t0
    from megatrain.profiling.rounds import median_table

    say(median_table(rows).drop(columns="program_hash").to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    say(f"measured {len(rows)} rows in {total:.1f} s ({total / len(rows):.1f} s per row, host stores included)")
    return 0


# ---- report -------------------------------------------------------------------------------------------------------
def _load_shape(d: Path):
    import pandas as pd

    rows = [json.loads(line) for line in (d / "rows.jsonl").read_text().splitlines() if line.strip()]
    with gzip.open(d / "timelines.csv.gz", "rt") as f:
        tl = pd.read_csv(io.StringIO(f.read()))
    return rows, tl


def _steps_of(tl, config: str, rnd: int) -> list:
    part = tl[(tl["config"] == config) & (tl["round"] == rnd)]
    return [g.drop(columns=["config", "round", "timed_step"]).reset_index(drop=True)
            for _, g in part.groupby("timed_step")]


def _configs(rows: list[dict]):
    """Per measured config of one shape, in the order of its first row: (config, its rows, measured step s = the
    median over rounds of each round's median timed step, the Program its first row recorded, its StepFacts with
    the median clip share)."""
    from megatrain.compile.record import program_of
    from megatrain.ir.facts import StepFacts

    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    for config, rs in by.items():
        measured = statistics.median(r["median_step_s"] for r in rs)
        facts = StepFacts(clip_share=statistics.median(r["clip_share"] for r in rs))
        yield config, rs, measured, program_of(rs[0]["record"]), facts


def report(a) -> int:
    """`report`: print (and with --write, save) the table of `evaluate`."""
    root = Path(a.dir)
    if not any((d / "rows.jsonl").is_file() for d in root.iterdir()):
        print(f"{root}: no <shape>/rows.jsonl under it; run `scripts/accuracy.py measure --out {root}` first")
        return 2
    if a.rebuild and a.quick_file != "profile-quick.json":
        print("--rebuild builds each shape's profile from profile-quick.measurements.json (the latest quick "
              "profile's); drop --quick-file, or drop --rebuild to read an earlier run's saved profile")
        return 2
    result = evaluate(root, a.calibrate_on, a.quick_file, a.rebuild, _factors(a.compute_beside_copy))
    print(result["text"])
    if a.write:
        Path(a.write).write_text(result["text"])
        result["transfer"].save(Path(a.write).with_suffix(".transfer-profile.json"))
    return 0


def evaluate(root: Path, calibrate_on: str, quick_file: str = "profile-quick.json",
             rebuild: str | None = None, beside_copy: dict[str, float] | None = None) -> dict:
    """The errors of every measured row of `root` (module docstring): {"text": the markdown table and summary,
    "errors": {"a"|"b"|"b_all"|"c": [fractions]}, "taus": [(shape, tau a, tau b)], "transfer": the profile of (b)}.
    `rebuild`: each shape's quick profile rebuilt from its measurements by today's profiler (`rebuild_profile`'s
    variant) instead of the saved `quick_file`. `beside_copy`: the quick profiles' `compute_beside_copy` set to
    it (`copies`)."""
    from megatrain.compile.record import program_of
    from megatrain.profiling.compare import error_by_group, kendall_tau_b, task_table
    from megatrain.profiling.live import calibrate_run
    from megatrain.sim import load_profile, simulate, step_bound

    shapes = sorted(d for d in root.iterdir() if (d / "rows.jsonl").is_file())
    data = {d.name: _load_shape(d) for d in shapes}
    # (a) for a shape: the quick profile measured for that shape (its rates), with every shape's compute tables
    quick = {d.name: (rebuild_profile(d, _model_of(d), rebuild) if rebuild else load_profile(d / quick_file))
             for d in shapes}
    if beside_copy is not None:
        quick = {name: p.with_(compute_beside_copy=dict(beside_copy)) for name, p in quick.items()}
    tables = tuple({(t.key, t.seq): t for p in quick.values() for t in p.compute_tables}.values())
    machine = {name: replace(p, compute_tables=tables) for name, p in quick.items()}
    cal_shape, cal_config = calibrate_on.split(":", 1)
    rows, tl = data[cal_shape]
    cal_row = next(r for r in rows if r["config"] == cal_config and r["round"] == 0)
    cal_program = program_of(cal_row["record"])
    cal_steps = _steps_of(tl, cal_config, 0)
    clipped = [cal_row["clip_share"] >= 0.5] * len(cal_steps)  # the row's share: all or none of its steps clip
    try:
        cal = calibrate_run(cal_program, machine[cal_shape], cal_steps, warmup=0, clipped=clipped)
    except TypeError:  # a calibration that does not take the clip facts (before issue 24)
        cal = calibrate_run(cal_program, machine[cal_shape], cal_steps, warmup=0)
    transfer = cal.profile
    how = f" (profiles rebuilt from the measurements by today's profiler: {rebuild})" if rebuild else ""
    if beside_copy is not None:
        how += f" (compute beside copies: {', '.join(f'{k} x{v:.3f}' for k, v in beside_copy.items())})"
    lines = [f"# Prediction errors: {root}{how}", "",
             f"(a) quick: for each shape, the fresh `--quick` profile measured for it on this machine, with the "
             f"compute tables of every shape ({', '.join(d.name for d in shapes)}); no training run. (b) transfer: "
             "(a) calibrated on round 0 of "
             f"{cal_shape} {cal_config} ({len(_steps_of(tl, cal_config, 0))} timed steps). Error = predicted / "
             "measured - 1 of the step time (+ = predicted too slow); measured = median over rounds of each "
             "round's median timed step (min-max over rounds). (c) IN-SAMPLE: the row's own profile calibrated on "
             "its own round-0 steps, compared with those steps: how well calibration can fit what ran.", "",
             "| shape | schedule | measured s (min-max) | tok/s | clip share | (a) pred s | (a) err | (b) pred s "
             "| (b) err | (b) sample | (c) in-sample err | bound s, (a) profile (what binds) | measured / bound "
             "| task groups furthest off, when (a) or (b) exceeds 10% (predicted - measured, summed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {"a": [], "b": [], "b_all": [], "c": [], "efficiency": []}
    taus = []
    for shape, (rows, tl) in data.items():
        meas_l, pa_l, pb_l = [], [], []
        for config, rs, measured, program, facts in _configs(rows):
            meds = [r["median_step_s"] for r in rs]
            pa_sim = simulate(program, machine[shape], facts)
            pa, pb = pa_sim.mean_step_s, simulate(program, transfer, facts).mean_step_s
            ea, eb = pa / measured - 1, pb / measured - 1
            sample = ("in-sample" if (shape, config) == (cal_shape, cal_config) else "same shape"
                      if shape == cal_shape else "same schedule" if config == cal_config else "out-of-sample")
            summary["a"].append(ea)
            summary["b_all"].append(eb)
            if sample == "out-of-sample":
                summary["b"].append(eb)
            # (c) in-sample: the row's own quick profile fitted to its own round-0 steps, against those steps
            own = _steps_of(tl, config, 0)
            own_cal = calibrate_run(program, machine[shape], own, warmup=0,
                                    clipped=[facts.clip_share >= 0.5] * len(own))
            ec = own_cal.error_after
            summary["c"].append(ec)
            worst = ""
            if abs(ea) > 0.10 or abs(eb) > 0.10:
                steps = _steps_of(tl, config, 0)
                groups = error_by_group(task_table(program, pa_sim.timeline, steps))
                # the groups whose summed predicted time is furthest from the measured: what moved the step
                off = groups["n"] * (groups["pred_ms"] - groups["meas_ms"])
                groups = groups.assign(off_ms=off).reindex(off.abs().sort_values(ascending=False).index).head(3)
                worst = ", ".join(f"{g.group} {g.off_ms:+.0f} ms ({g.bias_pct:+.0f}%)" for g in groups.itertuples())
            bound = step_bound(program, machine[shape], facts)  # the physical bound (sim/bound.py), issue 24 item 6
            summary["efficiency"].append(bound.efficiency(measured))
            lines.append(f"| {shape} | {config} | {measured:.3f} ({min(meds):.3f}-{max(meds):.3f}) | "
                         f"{rs[0]['batch'] * rs[0]['seq'] / measured:,.0f} | {facts.clip_share:.2f} | {pa:.3f} | "
                         f"{ea:+.1%} | {pb:.3f} | {eb:+.1%} | {sample} | {ec:+.1%} | {bound.bound_s:.3f} "
                         f"({bound.binding}) | {bound.efficiency(measured):.0%} | {worst} |")
            meas_l.append(measured)
            pa_l.append(pa)
            pb_l.append(pb)
        ta, tb = kendall_tau_b(pa_l, meas_l), kendall_tau_b(pb_l, meas_l)
        taus.append((shape, ta, tb))

    def stats(errs):
        if not errs:
            return "no rows"
        ab = sorted(abs(e) for e in errs)
        return (f"median |err| {statistics.median(ab):.1%}, max |err| {ab[-1]:.1%}, within 10%: "
                f"{sum(e <= 0.10 for e in ab)}/{len(ab)}, within 5%: {sum(e <= 0.05 for e in ab)}/{len(ab)}, "
                f"within 3%: {sum(e <= 0.03 for e in ab)}/{len(ab)}")

    lines += ["", f"- (a) quick, all rows: {stats(summary['a'])}",
              f"- (b) transfer, out-of-sample rows (other shape and other schedule): {stats(summary['b'])}",
              f"- (b) transfer, every row (same shape/schedule and the in-sample run included): "
              f"{stats(summary['b_all'])}"]
    lines.append(f"- (c) IN-SAMPLE, each row's quick profile fitted to its own round-0 steps and compared with "
                 f"them (a fit, not a prediction): {stats(summary['c'])}")
    eff = sorted(summary["efficiency"])
    lines.append(f"- measured step against its physical bound (sim/bound.py, the (a) profile's rates): median "
                 f"{statistics.median(eff):.0%}, {eff[0]:.0%}-{eff[-1]:.0%}; at or above 85%: "
                 f"{sum(e >= 0.85 for e in eff)}/{len(eff)}")
    for shape, ta, tb in taus:
        lines.append(f"- Kendall tau-b, {shape}: (a) {ta if ta is None else round(ta, 2)}, "
                     f"(b) {tb if tb is None else round(tb, 2)}")
    lines.append(f"- calibration of (b): {cal.reason()}")
    return {"text": "\n".join(lines) + "\n", "errors": summary, "taus": taus, "transfer": transfer}


# ---- ablate ------------------------------------------------------------------------------------------------------
# The parts of the profiler's method `ablate` leaves out one at a time (and `report --rebuild` can): each rebuilds a
# shape's quick profile from its measurements with today's code, that part undone.
VARIANTS = ("as measured", "one weight wire", "redo = 2 updates", "copies not slowed by the update",
            "operating-point CPU rate", "in-step CPU rate", "isolated-loop CPU rate")
# the CPU update rate from one of its three estimates instead of their median (profiling/assemble.choose_cpu_rate)
CPU_RATE_OF_VARIANT = {"operating-point CPU rate": "operating point", "in-step CPU rate": "in-step",
                       "isolated-loop CPU rate": "isolated loop"}  # assemble.CPU_RATE_SOURCES (tested)


def profile_from_measurements(m: dict, model: str, cpu_rate_from: str | None = None):
    """The profile today's profiler builds from a `megatrain profile` measurements record `m` (its request, machine
    and timings), for `model` (its preset or HF model directory); `cpu_rate_from` as `build_profile` (default: the
    median of the three estimates)."""
    from megatrain.compile.knobs import ScheduleKnobs
    from megatrain.model.presets import get_model
    from megatrain.profiling.assemble import MEDIAN_OF_THREE, build_profile
    from megatrain.profiling.calibrate import ProfileRequest

    r = m["request"]
    spec = get_model(model)
    req = ProfileRequest(spec, batch=r["batch"], seqs=r["seqs"], device=m["machine"]["device"], dtypes=r["dtypes"],
                         quick=True, knobs=ScheduleKnobs(**r["knobs"]))
    return build_profile(m, spec, req, r["dtypes"], r["cpu_threads"], m["machine"],
                         cpu_rate_from=cpu_rate_from or MEDIAN_OF_THREE)


def rebuild_profile(d: Path, model: str, variant: str = "as measured"):
    """Shape directory `d`'s quick profile rebuilt from its `profile-quick.measurements.json` by today's profiler
    (`VARIANTS`: with one part of the method left out), with the compute tables of its saved profile (which holds
    the eager and the compiled layer's). `model`: its preset or HF model directory, as given to `measure`."""
    import copy

    from megatrain.sim import load_profile

    if variant not in VARIANTS:
        raise SystemExit(f"unknown profile variant {variant!r}; use one of {', '.join(VARIANTS)}")
    m = copy.deepcopy(json.loads((d / "profile-quick.measurements.json").read_text()))
    if variant == "one weight wire":
        m.get("operating_point", {}).pop("contention_other", None)
    if variant == "redo = 2 updates":
        for k in ("redo_updates", "redo_s"):
            m["gpu_adam"].pop(k, None)
    p = profile_from_measurements(m, model, CPU_RATE_OF_VARIANT.get(variant))
    if variant == "copies not slowed by the update":  # as the simulator ran before issue 24's third round
        p = p.with_(copy_beside_update={}, notes={k: v for k, v in p.notes.items() if k != "copy_beside_update"})
    saved = d / "profile-quick.json"
    return p.with_(compute_tables=load_profile(saved).compute_tables) if saved.is_file() else p


def _model_of(d: Path) -> str:
    """The preset or HF model directory of a measured shape directory: scripts/shapes/<name> when it exists."""
    shapes = Path(__file__).parent / "shapes" / d.name
    return str(shapes) if shapes.is_dir() else d.name


def ablate(a) -> int:
    """`ablate`: the (a) error of every row of one shape with its quick profile rebuilt from its measurements as
    measured and with parts of the method left out (what each part of the profiler is worth, on the same data)."""
    from megatrain.sim import simulate

    d = Path(a.dir)
    variants = {v: rebuild_profile(d, a.model, v) for v in VARIANTS}
    rows, _ = _load_shape(d)
    print(f"(a) error of each row of {d} (predicted / measured - 1), the quick profile rebuilt from its measurements")
    print("| schedule | measured s | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for config, _, measured, program, facts in _configs(rows):
        errs = [simulate(program, p, facts).mean_step_s / measured - 1 for p in variants.values()]
        print(f"| {config} | {measured:.3f} | " + " | ".join(f"{e:+.1%}" for e in errs) + " |")
    return 0


def _factors(text: str | None) -> dict[str, float] | None:
    """"F=1.05,R=1.05,B=1.08" -> {"F": 1.05, ...} (None for None)."""
    if text is None:
        return None
    from megatrain.sim.profile import COMPUTE_KINDS

    out = {}
    for part in text.split(","):
        kind, _, value = (x.strip() for x in part.partition("="))
        try:
            factor = float(value)
        except ValueError:
            factor = 0.0  # refused below
        if kind not in COMPUTE_KINDS or factor < 1.0:
            raise SystemExit(f"--compute-beside-copy {text!r}: give KIND=FACTOR pairs, KIND one of "
                             f"{', '.join(COMPUTE_KINDS)} and FACTOR >= 1, e.g. F=1.05,R=1.05,B=1.08")
        out[kind] = factor
    return out


def beside_copies(dirs: list[Path]) -> dict:
    """Per compute kind, the recorded layer tasks' duration over their quick profile's table (timed alone), and the
    fraction of each task during which a copy (either direction) was in flight (`fit.copied`, as the simulator
    slows it): {"tasks": DataFrame(kind, ratio, fraction),
    "fit": {kind: (intercept, slope, n)}} with ratio = intercept + slope x fraction by least squares (ratios
    outside 0.5-2, a task stalled by something else, left out)."""
    import numpy as np
    import pandas as pd

    from megatrain.compile.record import program_of
    from megatrain.profiling.fit import copied
    from megatrain.sim import load_profile
    from megatrain.sim.profile import COMPUTE_KINDS, model_signature

    out = []
    for root in dirs:
        for d in sorted(x for x in root.iterdir() if (x / "rows.jsonl").is_file()):
            rows, tl = _load_shape(d)
            program = program_of(rows[0]["record"])
            sig, dtype = model_signature(program.model), program.placement.compute_dtype
            tables = {(t.kind, t.compiled, tok): dur for t in load_profile(d / "profile-quick.json").compute_tables
                      if t.unit == "layer" and t.model == sig and t.dtype == dtype
                      for tok, dur in zip(t.tokens, t.dur_s)}
            for r in rows:
                k = r["record"]["knobs"]
                tokens = r["batch"] // k.get("micro_batches", 1) * r["seq"]
                part = tl[(tl["config"] == r["config"]) & (tl["round"] == r["round"])]
                for _, step in part.groupby("timed_step"):
                    step = copied(step)  # the simulator's measure: the union of the copy streams' busy time
                    comp = step[(step["stream"] == "compute") & step["kind"].isin(COMPUTE_KINDS)
                                & (step["layer"] >= 0)]
                    for t in comp.itertuples():
                        alone = tables.get((t.kind, bool(k.get("compile_layers")), tokens))
                        dur = t.end_s - t.start_s
                        if alone and dur > 0:
                            out.append((t.kind, dur / alone, t.copied))
    tasks = pd.DataFrame(out, columns=["kind", "ratio", "fraction"])
    fit = {}
    for kind, g in tasks[(tasks["ratio"] > 0.5) & (tasks["ratio"] < 2)].groupby("kind"):
        slope, intercept = np.polyfit(g["fraction"], g["ratio"], 1) if g["fraction"].nunique() > 1 else (0.0, 1.0)
        fit[kind] = (float(intercept), float(slope), len(g))
    return {"tasks": tasks, "fit": fit}


def copies_cmd(a) -> int:
    import pandas as pd

    r = beside_copies([Path(d) for d in a.dirs])
    t = r["tasks"]
    t["overlapped"] = pd.cut(t["fraction"], [-1, 0.001, 0.5, 1.0], labels=["none", "up to half", "over half"])
    print(f"layer compute tasks of {', '.join(a.dirs)}: duration in the steps / the quick profile's table (alone), "
          "by the fraction a copy overlapped")
    print(t.groupby(["kind", "overlapped"], observed=True)["ratio"].agg(["median", "count"]).round(3).to_string())
    print("fit ratio = a + (k - 1) x fraction:")
    for kind, (intercept, slope, n) in r["fit"].items():
        print(f"  {kind}: a {intercept:.3f}, k {1 + slope:.3f} ({n} tasks)")
    print("--compute-beside-copy " + ",".join(f"{kind}={1 + slope:.3f}" for kind, (_, slope, _n) in r["fit"].items()))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="profile the machine for one shape and measure every schedule in one process")
    m.add_argument("--model", required=True, help="preset or HF model directory (scripts/shapes/<name>)")
    m.add_argument("--batch", type=int, required=True)
    m.add_argument("--seq", type=int, required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--schedules", help=f"comma-separated subset of {', '.join(SCHEDULES)}, or "
                   "SCHEDULE+KNOB=VALUE+... entries")
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--device", default="cuda")
    m.add_argument("--profile", help="use this profile instead of measuring a quick one")
    m.add_argument("--profile-only", action="store_true",
                   help="measure the quick profile (OUT/<shape>/profile-quick.json) and stop: a new profiler's "
                        "profile of a machine whose rows are measured already")
    m.set_defaults(func=measure)
    r = sub.add_parser("report", help="the table of prediction errors of a measured directory")
    r.add_argument("dir")
    r.add_argument("--calibrate-on", required=True, metavar="SHAPE:SCHEDULE")
    r.add_argument("--quick-file", default="profile-quick.json",
                   help="the file name of each shape's quick profile (a resumed run keeps the earlier one as "
                        "profile-quick-<run>.json)")
    r.add_argument("--rebuild", choices=VARIANTS, metavar="VARIANT",
                   help="rebuild each shape's quick profile from its measurements by today's profiler, as measured "
                        f"or with one part left out ({'; '.join(VARIANTS)})")
    r.add_argument("--compute-beside-copy", metavar="F=k,R=k,B=k",
                   help="set the quick profiles' compute_beside_copy (factors from `copies` on other runs)")
    r.add_argument("--write", help="write the markdown table here (and the transfer profile beside it)")
    r.set_defaults(func=report)
    b = sub.add_parser("ablate", help="one shape's (a) errors with parts of the profiler's method left out")
    b.add_argument("dir", help="a measured shape's directory (OUT/<shape>)")
    b.add_argument("--model", required=True, help="its preset or HF model directory, as given to measure")
    b.set_defaults(func=ablate)
    c = sub.add_parser("copies", help="how much slower compute ran beside copies in the recorded steps, by kind")
    c.add_argument("dirs", nargs="+", help="measured directories (each with <shape>/rows.jsonl)")
    c.set_defaults(func=copies_cmd)
    a = p.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
