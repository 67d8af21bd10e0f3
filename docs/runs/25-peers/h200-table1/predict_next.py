"""Predict megatrain on this H200 machine start with more decoder layers resident on the GPU: an out-of-sample
prediction for the next run, made before it, from the runs of this start only.

    PYTHONPATH=. .venv/bin/python docs/runs/25-peers/h200-table1/predict_next.py [--logs DIR]

What it does (bench-3b, batch 8 x seq 2048, the rows of docs/runs/25-peers/bench3b-8x2048.jsonl):

1. Rebuilds the Program of every megatrain row twice: from its ProgramRecord (`program_of`, which checks the
   fingerprint) and from its config label the way scripts/bench_megatrain.py does (`resolve_knobs(schedule, --set)`,
   `build_schedule`, `lower`), and checks both against the recorded program_hash and each timeline's task ids.
2. Fits the shipped profile `h200-measured` to the 3 timelines (one median timed step per run) of
   `arrival-resident` resident_layers=4 clip=0 with `calibrate_run(program, profile, timelines, warmup=0)`, as
   bench_megatrain.py does per run. Its error on those runs is IN-SAMPLE. It then predicts the two other configs of
   the same start (overlap-split compile_layers=true; arrival-resident rl=4 clip=1 at clip_share 1.0, every measured
   step clipped): out of sample, fitted on another config of the same start.
3. Predicts with the fitted profile what has not run: arrival-resident with resident_layers 0..28 at clip 0 and at
   clip 1 (clip_share 1.0 and 0.0), and the named schedules (compiled layer, since the fit measured only the
   compiled layer's compute tables). These predictions are out of sample for the next run. Each row gives the
   tokens/s (8 * 2048 tokens per step), its ratio to the all-on-GPU PyTorch peer measured on the same start, the
   GPU idle share, the planner's GPU peak and host total, the physical bound and the efficiency (bound / step).

--logs DIR: a folder holding the runs' `r{round}-megatrain_<slug>.timeline.csv` (searched recursively); without it,
the four call*-logs.tgz beside this script are extracted into a temporary folder (later calls' copies of a file
must equal earlier ones).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
import sys
import tarfile
import tempfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pandas as pd

from megatrain.compile.advice import plan_memory
from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import NAMED_SCHEDULES, ScheduleKnobs, resolve_knobs
from megatrain.compile.lower import lower
from megatrain.compile.record import ProgramRecord, program_of
from megatrain.ir.dag import ScheduleError
from megatrain.ir.facts import StepFacts
from megatrain.model.presets import get_model
from megatrain.model.spec import ModelSpec
from megatrain.profiling.live import calibrate_run
from megatrain.sim import load_profile, simulate
from megatrain.units import GiB

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "bench3b-8x2048.jsonl"
FIT_CONFIG = "megatrain arrival-resident:resident_layers=4;clip=0"
CHECK_CONFIGS = ("megatrain overlap-split:compile_layers=true", "megatrain arrival-resident:resident_layers=4;clip=1")
PEERS = {0.0: "all-on-gpu:clip=0", 1.0: "all-on-gpu"}  # the peer each clip setting is compared with
TARGET = 1.1  # the ratio to the all-on-GPU peer the next run is to reach
RESIDENT = (0, 4, 8, 10, 12, 14, 16, 20, 22, 24, 28, 32)  # 14: `--schedule auto`'s L // 2; 32: > 28 layers, refused


def slug(label: str) -> str:
    """scripts/bench.py `slug`: the file name of a config label."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def parse_label(config: str) -> tuple[str, list[str]]:
    """"megatrain arrival-resident:resident_layers=4;clip=0" -> ("arrival-resident", ["resident_layers=4", ...])."""
    name, _, sets = config.removeprefix("megatrain ").partition(":")
    return name, [s for s in sets.split(";") if s]


def extract_logs(dest: Path) -> Path:
    """Extract call1..4-logs.tgz into dest/callN; returns dest."""
    for tgz in sorted(HERE.glob("call*-logs.tgz")):
        with tarfile.open(tgz) as tar:
            tar.extractall(dest / tgz.name.split("-")[0], filter="data")
    return dest


def find_timelines(logs: Path) -> dict[str, Path]:
    """file name -> one path of it under `logs`; refuses copies of one name whose contents differ."""
    found: dict[str, tuple[Path, str]] = {}
    for path in sorted(logs.rglob("r*-megatrain_*.timeline.csv")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.name in found and found[path.name][1] != digest:
            sys.exit(f"{path} differs from {found[path.name][0]}: which run is it?")
        found.setdefault(path.name, (path, digest))
    return {name: p for name, (p, _) in found.items()}


def program(spec: ModelSpec, knobs: ScheduleKnobs):
    return lower(build_schedule(spec, 8, 2048, knobs))


def span_s(timeline: pd.DataFrame) -> float:
    """A timeline's step time: first start to last end (what the simulator predicts)."""
    return float(timeline["end_s"].max() - timeline["start_s"].min())


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def say(text: str = "") -> None:
    """Print markdown: prose wrapped at 120 columns, table rows and headings as they are."""
    for line in text.split("\n"):
        if len(line) <= 120 or line.startswith(("|", "#")):
            print(line)
        else:
            print(textwrap.fill(line, 120, subsequent_indent="  " if line.startswith("- ") else "",
                                break_long_words=False, break_on_hyphens=False))


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--logs", type=Path, help="folder with the runs' timeline CSVs (default: extract the tarballs)")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--profile", default="h200-measured", help="the profile fitted (default: the shipped one)")
    a = ap.parse_args()
    say(f"`PYTHONPATH=. .venv/bin/python docs/runs/25-peers/h200-table1/predict_next.py"
          f"{' --logs ' + str(a.logs) if a.logs else ''}` (from the repository root)\n")
    tmp = None
    if a.logs is None:
        tmp = tempfile.TemporaryDirectory(prefix="predict_next-")
        a.logs = extract_logs(Path(tmp.name))
    files = find_timelines(a.logs)

    rows = [json.loads(line) for line in a.results.read_text().splitlines() if line.strip()]
    mt = [r for r in rows if r["config"].startswith("megatrain ")]
    tokens = 8 * 2048
    peer = {clip: statistics.median(r["tokens_per_s"] for r in rows if r["config"] == cfg)
            for clip, cfg in PEERS.items()}
    peer_gib = max(r["peak_gpu_GiB"] for r in rows if r["config"] in PEERS.values())
    spec = get_model("bench-3b")
    base = load_profile(a.profile)

    # ---- 1. the Programs that ran, rebuilt two ways, and their timelines ----------------------------------------
    runs: dict[str, list[dict]] = {}
    checks = []
    for r in mt:
        rec = ProgramRecord.from_dict(r["record"])
        name, sets = parse_label(r["config"])
        from_record = program_of(rec)  # RecordError if the code no longer builds what ran
        rebuilt = program(spec, resolve_knobs(name, sets)[1])
        tl_name = f"r{r['round']}-{slug(r['config'])}.timeline.csv"
        tl = pd.read_csv(files[tl_name]) if tl_name in files else None
        ok = rebuilt.fingerprint() == from_record.fingerprint() == rec.program_hash
        same_tasks = tl is not None and set(tl["task"]) == set(rebuilt.tasks)
        checks.append({"config": r["config"].removeprefix("megatrain "), "round": r["round"],
                       "rebuilt = record hash": "yes" if ok else "NO",
                       "timeline": tl_name if tl is not None else "MISSING",
                       "tasks match": "yes" if same_tasks else "NO",
                       "timeline span s": f"{span_s(tl):.4f}" if tl is not None else "",
                       "measured wall s": r["median_step_s"]})
        if not ok or not same_tasks:
            sys.exit(f"{r['config']} round {r['round']}: the rebuilt Program or its timeline does not match")
        runs.setdefault(r["config"], []).append({**r, "program": rebuilt, "timeline": tl})
    say("## Programs rebuilt and timelines\n")
    say("Each megatrain row's Program rebuilt from its label (`resolve_knobs` + `build_schedule` + `lower`, as "
          "scripts/bench_megatrain.py builds it) and from its ProgramRecord; both equal the recorded `program_hash`, "
          "and each timeline (the run's median timed step) has exactly the Program's tasks. The timeline span "
          "(first start to last end, what the simulator predicts) is shorter than the measured wall step time that "
          "tokens/s is computed from.\n")
    say(table(checks) + "\n")

    # ---- 2. the fit, in sample and out of sample ------------------------------------------------------------------
    fit_runs = sorted(runs[FIT_CONFIG], key=lambda r: r["round"])
    prog = fit_runs[0]["program"]
    cal = calibrate_run(prog, base, [r["timeline"] for r in fit_runs], warmup=0)
    fitted = cal.profile
    pred = cal.after.mean_step_s
    say(f"## Fit: `{a.profile}` calibrated on the {len(fit_runs)} timelines of "
          f"`{FIT_CONFIG.removeprefix('megatrain ')}`\n")
    say("\n".join(f"- {line}" for line in cal.lines(a.profile)))
    say(f"- calibrate_run keeps the middle step of 3 by step time (profiling/fit.py `step_classes`): the fit "
          f"rests on one step, round {sorted(fit_runs, key=lambda r: span_s(r['timeline']))[1]['round']}'s\n")
    kinds = cal.kinds.assign(pred_s=cal.kinds["pred_s"].round(4), meas_s=cal.kinds["meas_s"].round(4))
    say("Per task kind and stream, summed ready-to-done seconds per step, fitted profile against measured:\n")
    say(table(kinds.to_dict("records")) + "\n")
    shipped_cpu = base.cpu_adam_params_per_s[base.cpu_threads]
    fit_cpu = fitted.cpu_adam_params_per_s[fitted.cpu_threads]
    say(f"CPU AdamW rate at {base.cpu_threads} threads: {shipped_cpu / 1e9:.3f} G params/s shipped -> "
          f"{fit_cpu / 1e9:.3f} fitted ({shipped_cpu / fit_cpu:.2f}x slower); host memory "
          f"{base.host_memory_Bps / 1e9:.0f} -> {fitted.host_memory_Bps / 1e9:.0f} GB/s.\n")

    say("### IN-SAMPLE: the fitted profile on the runs it was fitted to\n")
    ins = []
    for r in fit_runs:
        span = span_s(r["timeline"])
        ins.append({"run": f"round {r['round']}", "measured wall s": r["median_step_s"],
                    "measured tok/s": r["tokens_per_s"], "timeline span s": round(span, 4),
                    "shipped pred s": round(cal.before.mean_step_s, 4), "fitted pred s": round(pred, 4),
                    "fitted pred tok/s": round(tokens / pred), "error vs wall": pct(pred / r["median_step_s"] - 1),
                    "error vs span": pct(pred / span - 1),
                    "shipped error vs wall": pct(cal.before.mean_step_s / r["median_step_s"] - 1)})
    med_wall = statistics.median(r["median_step_s"] for r in fit_runs)
    ins.append({"run": "median", "measured wall s": med_wall, "measured tok/s": round(tokens / med_wall),
                "timeline span s": round(cal.measured_step_s, 4), "shipped pred s": round(cal.before.mean_step_s, 4),
                "fitted pred s": round(pred, 4), "fitted pred tok/s": round(tokens / pred),
                "error vs wall": pct(pred / med_wall - 1), "error vs span": pct(pred / cal.measured_step_s - 1),
                "shipped error vs wall": pct(cal.before.mean_step_s / med_wall - 1)})
    say(table(ins) + "\n")

    say("### Out of sample: fitted on another config of the same start\n")
    oos = []
    for cfg in CHECK_CONFIGS:
        rs = runs[cfg]
        p = rs[0]["program"]
        share = 1.0 if p.placement.speculative_clip else 0.0  # every measured step of these runs clipped
        assert all(r["clipped_steps"] == "4/4" for r in rs), cfg
        t = simulate(p, fitted, StepFacts(clip_share=share)).mean_step_s
        s = simulate(p, base, StepFacts(clip_share=share)).mean_step_s
        wall = statistics.median(r["median_step_s"] for r in rs)
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        oos.append({"config": cfg.removeprefix("megatrain "), "clip_share": share,
                    "measured median s": wall, "measured tok/s": tps,
                    "runs' tok/s": ", ".join(f"{r['tokens_per_s']:,.0f}" for r in rs),
                    "fitted pred s": round(t, 4), "fitted pred tok/s": round(tokens / t),
                    "step error": pct(t / wall - 1), "tok/s error": pct(wall / t - 1),
                    "shipped pred tok/s": round(tokens / s), "shipped tok/s error": pct(wall / s - 1)})
    say(table(oos) + "\n")

    # ---- 3. predictions for the next run --------------------------------------------------------------------------
    def row(label: str, knobs: ScheduleKnobs, share: float | None) -> dict:
        out = {"schedule": label, "clip": knobs.clip, "clip_share": "" if share is None else share}
        try:
            p = program(spec, knobs)
        except ScheduleError as e:
            return {**out, "tok/s": f"refused: {e}".replace("|", "/")[:110]}
        plan = plan_memory(spec, 8, 2048, knobs)
        facts = StepFacts(clip_share=share or 0.0)
        res = simulate(p, fitted, facts)
        step = res.mean_step_s
        ratio = tokens / step / peer[1.0 if knobs.clip else 0.0]
        b = res.bound
        if not p.placement.speculative_clip:
            out["clip_share"] = "-"  # exact clipping after the norm, or none: the share changes nothing
        return {**out, "pred step s": f"{step:.4f}", "tok/s": f"{tokens / step:,.0f}",
                "x all-on-GPU": f"{ratio:.3f}" + (" **>=1.1**" if ratio >= TARGET else ""),
                "GPU idle %": f"{100 * res.summary.gpu_idle_frac:.1f}",
                "plan GPU GiB": f"{plan.gpu.peak_bytes / GiB:.2f}",
                "plan host GiB": f"{plan.host.total_bytes / GiB:.2f}",
                "bound s": f"{b.bound_s:.4f}", "binds": b.binding, "efficiency": f"{100 * b.efficiency(step):.0f}%"}

    say("## Predictions for the next run (OUT OF SAMPLE): fitted profile, bench-3b 8 x 2048\n")
    say(f"All-on-GPU peer on this start (median of 3): {peer[0.0]:,.0f} tok/s at clip 0, {peer[1.0]:,.0f} at clip 1 "
          f"(peak GPU {peer_gib:.1f} GiB); 1.1x is {TARGET * peer[0.0]:,.0f} / {TARGET * peer[1.0]:,.0f} tok/s. "
          "Ratios at clip 1 are to the clip-1 peer. Predicted times are timeline spans; the measured wall step was "
          "1.0-1.4% longer than its span in the fitted runs, but the fitted prediction already sits above both in "
          f"sample ({ins[-1]['error vs wall']} on the wall median). Out of sample it was "
          f"{' and '.join(o['step error'] for o in oos)} on the step ({', '.join(o['config'] for o in oos)}).\n")
    ar = NAMED_SCHEDULES["arrival-resident"]
    for title, clip, share in (("clip 0", 0.0, None),
                               ("clip 1, clip_share 1.0 (every step clips, as measured)", 1.0, 1.0),
                               ("clip 1, clip_share 0.0 (no step clips)", 1.0, 0.0)):
        say(f"### arrival-resident (embedding + head resident, compiled layer, fp32 wire), {title}\n"
            if len(title) < 20 else f"### arrival-resident, {title}\n")
        say(table([row(f"arrival-resident rl={n}", replace(ar, resident_layers=n, clip=clip), share)
                     for n in RESIDENT]) + "\n")
    say("### Named schedules, with compile_layers=true (the fit measured the compiled layer's tables only)\n")
    named = []
    for name, knobs in NAMED_SCHEDULES.items():
        k = replace(knobs, compile_layers=True)
        named.append(row(name, replace(k, clip=0.0), None))
        named.append(row(name, replace(k, clip=1.0), 1.0))
    say(table(named) + "\n")
    fit_kinds = {(t.kind, t.stream) for t in prog.tasks.values()}
    say("Task kinds the fit measured (kind, stream): " + ", ".join(f"{k} {s}" for k, s in sorted(fit_kinds))
          + ". A named schedule with other kinds (S/W state copies and GPU updates of the split placements, "
          "the CLIP_REDO V, checkpoint copies X/Y) prices them with the shipped profile's rates, as the "
          f"overlap-split check above does ({oos[0]['step error']} on its step).\n")
    say("## Smallest resident_layers predicted to reach 1.1x the all-on-GPU peer\n")
    worst = min(o["fitted pred s"] / o["measured median s"] - 1 for o in oos)  # the most optimistic check
    for title, clip, share in (("clip 0", 0.0, 0.0), ("clip 1, clip_share 1.0", 1.0, 1.0),
                               ("clip 1, clip_share 0.0", 1.0, 0.0)):
        hits = []  # the smallest reaching 1.1x as predicted, and as predicted less the worst out-of-sample error
        for n in range(spec.num_layers + 1):
            k = replace(ar, resident_layers=n, clip=clip)
            t = simulate(program(spec, k), fitted, StepFacts(clip_share=share)).mean_step_s
            for i, factor in enumerate((1.0, 1.0 + worst)):
                if len(hits) == i and tokens / t * factor >= TARGET * peer[clip]:
                    hits.append((n, t, plan_memory(spec, 8, 2048, k).gpu.peak_bytes / GiB))
        if not hits:
            say(f"- {title}: none up to resident_layers={spec.num_layers}")
            continue
        parts = []
        for (n, t, gib), what in zip(hits, ("as predicted", f"even {pct(worst)} on the step")):
            parts.append(f"{what}: resident_layers={n}, {tokens / t:,.0f} tok/s ({tokens / t / peer[clip]:.3f}x; "
                         f"{tokens / t * (1 + worst):,.0f} = {tokens / t * (1 + worst) / peer[clip]:.3f}x at "
                         f"{pct(worst)}), planned GPU peak {gib:.2f} GiB (`--gpu-limit-gib {math.ceil(gib)}`)")
        say(f"- {title}: " + "; ".join(parts))
    say(f"\n({pct(worst)}: the most optimistic out-of-sample check above, overlap-split, whose state copies and "
          f"GPU updates the fit never saw; the check of the same schedule family, rl=4 clip=1, was "
          f"{oos[1]['step error']}.)")
    say("\n`--gpu-limit-gib` (scripts/bench.py passes 16 by default) bounds only `--schedule auto` and `--tune`; "
          "a run of `arrival-resident --set resident_layers=N` is not checked against it (the rl=4 runs planned "
          "16.72 GiB with a limit of 16). `--schedule auto` tries resident_layers 0, 2, 4, 8 and 14 only "
          "(tune/auto.py). The host plan stays 45.78 GiB at every resident_layers: resident units keep their host "
          "master, moments and gradient space.")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
