"""Benchmarks a reader can reproduce: megatrain schedules and the peers, each run several times in its own process,
interleaved round-robin (round 1 runs every configuration once, then round 2, ...), reported as the median with its
min-max, ratios to a reference, and megatrain's predictions beside the measurement.

Configurations (`--configs`, comma-separated, in the order each round runs them):

    PEER[:clip=C;layout_fix=1]   the project's own peer benchmark (scripts/peers/run_peer.py, docs/peers.md): one
                             peer per config file in scripts/peers/configs/ (`--help` lists them), each with the same
                             model, data, AdamW and clipping (default 1.0) as megatrain; the DeepSpeed ones under
                             DeepSpeed's launcher (`--ds-bind`: core binding). `layout_fix=1` (ZenFlow peers only):
                             run_peer's `--zenflow-layout-fix`, the repair of DeepSpeed 0.19.8's view of ZenFlow's
                             weights (docs/peers.md, "ZenFlow's step 1")
    resident, zero3, fsdp2   the older peers of bench/baseline_train.py (not in the repository; kept so the earlier
                             runs can be repeated: no clipping, a Llama of vocab 32000, not the model's own shape)
    authors                  the MegaTrain authors' own trainer (scripts/peers/authors_peer.py, their default
                             clipping; their code from an external checkout: docs/peers.md gives its commit and fetch
                             command), as they ship it
    authors-fixed            the same with our fix of their head gradients' copy (`--record-head-grad-streams`)
    NAME[:k=v;k=v]           megatrain (scripts/bench_megatrain.py) with a named schedule (or `auto`) and knobs;
                             clipping at 1.0 unless a knob says `clip=` (the peers' default: one default per table)

Every process prints one `RESULT {json}` line; a process that fails or times out is marked in its row and the rest
go on. megatrain rows carry the prediction with `--profile` (uncalibrated), with that profile fitted to the run's
own steps (live calibration; in-sample), and with `--calibrated-profile` (calibrated on another run: out of
sample); the Kendall tau between predicted and measured medians of the megatrain rows is printed under the table.

On the GPU machine (`carry: [".bench"]`, .bench/ a copy of shared/bench: baseline_train.py, megatrain_repo/,
wheels/):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .bench/wheels/*.whl
    PYTHONPATH=.:/tmp/site python3 scripts/bench.py --model bench-3b --batch 8 --seq 2048 --rounds 3 \\
        --configs all-on-gpu,zero3-offload,superoffload,superoffload:clip=0,authors,arrival-resident:resident_layers=4

`--dry-run` prints the commands, in the order they would run, and exits.

Long benchmarks over several calls (one call of the GPU machine runs 10 minutes at most): `--results FILE` keeps
every run's RESULT in FILE (JSON lines) and skips the (round, config) pairs already there; `--budget-s S` starts no
process that would likely end after S seconds (the guess: the config's longest earlier run, else the longest run
of this call) and exits with status 3, "run the same command again"; a run that does not fit holds back the later
rounds, so the runs stay in round order across calls. The table is made from every run in FILE.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatrain.profiling.compare import kendall_tau_b as kendall_tau
from megatrain.units import GiB

PEERS = ("resident", "zero3", "fsdp2")  # modes of baseline_train.py
AUTHORS = "authors"
AUTHORS_FIXED = "authors-fixed"  # with our fix of their head gradients' copy (scripts/peers/authors_peer.py)


def _load_peerconf():
    """scripts/peers/peerconf.py (the peers' configs and launch commands): loaded from its file, scripts/ being no
    package, so that bench.py and run_peer.py build the same commands."""
    spec = importlib.util.spec_from_file_location("peerconf", Path(__file__).resolve().parent / "peers" / "peerconf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peerconf = _load_peerconf()
OUR_PEERS = tuple(peerconf.peer_names())
DEFAULT_CLIP = str(peerconf.DEFAULT_CLIP)  # every row's max norm unless its config sets clip=


@dataclass
class Config:
    """One configuration: its label and the command that runs it once."""

    label: str
    kind: str  # "peer", "authors" or "megatrain"
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the environment
    calibrated: str = ""  # megatrain: the file its live-calibrated profile is saved to (--save-calibrated-dir)


def parse_configs(text: str) -> list[tuple[str, str, list[str]]]:
    """`--configs` -> [(label, kind, knob settings)]; one error naming a malformed item."""
    out = []
    for item in [s.strip() for s in text.split(",") if s.strip()]:
        name, _, sets = item.partition(":")
        if name in OUR_PEERS:
            kvs = [kv.strip() for kv in sets.split(";") if kv.strip()]
            bad = [kv for kv in kvs if not _peer_knob_ok(*(x.strip() for x in kv.partition("=")[::2]))]
            if bad:
                raise SystemExit(f"--configs: {item!r}: a peer takes only clip=MAX_NORM (0 = none) and, for ZenFlow, "
                                 f"layout_fix=1; got {bad[0]!r}")
            if any(kv.partition("=")[0].strip() == "layout_fix" for kv in kvs) and not peerconf.zenflow(
                    peerconf.load(name)):
                raise SystemExit(f"--configs: {item!r}: layout_fix repairs ZenFlow's weight layout; {name} has no "
                                 "zenflow section")
            out.append((item, "ours", kvs))
        elif item in PEERS:
            out.append((item, "peer", []))
        elif item in (AUTHORS, AUTHORS_FIXED):
            out.append((item, "authors", []))
        else:
            name, _, sets = item.partition(":")
            kvs = [kv.strip() for kv in sets.split(";") if kv.strip()]
            bad = [kv for kv in kvs if "=" not in kv]
            if not re.fullmatch(r"[A-Za-z0-9_.\-/]+", name) or bad:
                known = ", ".join(OUR_PEERS + PEERS + (AUTHORS, AUTHORS_FIXED))
                raise SystemExit(f"--configs: {item!r} is not a peer ({known}) or SCHEDULE[:knob=value;knob=value]")
            out.append((item, "megatrain", kvs))
    if not out:
        raise SystemExit("--configs is empty")
    return out


def _peer_knob_ok(key: str, value: str) -> bool:
    """A peer's knob of `--configs`: clip=MAX_NORM or layout_fix=1."""
    return (key == "clip" and _is_number(value)) or (key == "layout_fix" and value == "1")


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def ds_binding(a) -> bool:
    """Whether DeepSpeed peers get --bind_cores_to_rank (their docs' advice): `--ds-bind yes/no`, or with `auto` when
    numactl, which DeepSpeed's launcher binds with, is on this machine."""
    return a.ds_bind == "yes" or (a.ds_bind == "auto" and shutil.which("numactl") is not None)


def build_configs(a) -> list[Config]:
    """The command of each configuration (module docstring)."""
    from megatrain.model.presets import get_model

    spec = get_model(a.model)
    py, bench = a.python, Path(a.bench_dir)
    shape = ["--batch", str(a.batch), "--seq", str(a.seq), "--steps", str(a.steps)]
    peer_shape = ["--layers", str(spec.num_layers), "--hidden", str(spec.hidden_size), "--ffn",
                  str(spec.intermediate_size), *shape]
    out = []
    bind = ds_binding(a)
    for label, kind, kvs in parse_configs(a.configs):
        if kind == "ours":
            cfg = peerconf.load(label.partition(":")[0])
            knobs = {k.strip(): v.strip() for k, _, v in (kv.partition("=") for kv in kvs)}
            args = ["--model", a.model, *shape, "--clip", knobs.get("clip", DEFAULT_CLIP)]
            if knobs.get("layout_fix") == "1":
                args.append("--zenflow-layout-fix")
            out.append(Config(label, kind, peerconf.launch_argv(cfg, args, py, bind)))
        elif kind == "peer":
            out.append(Config(label, kind, [py, str(bench / "baseline_train.py"), label, *peer_shape]))
        elif kind == "authors":
            repo = Path(a.authors_dir) if a.authors_dir else bench / "megatrain_repo"
            fix = ["--record-head-grad-streams"] if label == AUTHORS_FIXED else []
            out.append(Config(label, kind, [py, "scripts/peers/authors_peer.py", label, *peer_shape, *fix],
                              {"PYTHONPATH": str(repo)}))
        else:
            name = label.partition(":")[0]
            argv = [py, "scripts/bench_megatrain.py", "--model", a.model, *shape, "--schedule", name,
                    "--device", a.device, "--gpu-limit-gib", str(a.gpu_limit_gib)]
            if not any(kv.partition("=")[0].strip() == "clip" for kv in kvs):  # the peers' default, not the
                kvs = [*kvs, f"clip={DEFAULT_CLIP}"]  # schedule's: no row is compared unclipped unawares
            argv += [x for kv in kvs for x in ("--set", kv)]
            if a.profile is not None:
                argv += ["--profile", a.profile]
            if a.calibrated_profile:
                argv += ["--calibrated-profile", a.calibrated_profile]
            path = ""
            if a.save_calibrated_dir:  # the last round's calibrated profile of each config stays
                path = str(Path(a.save_calibrated_dir) / (slug(f"megatrain {label}") + ".json"))
                argv += ["--save-calibrated", path]
            out.append(Config(f"megatrain {label}", kind, argv, calibrated=path))
    return out


def peer_shape_note(spec) -> str | None:
    """baseline_train.py and peer.py build a Llama of --layers/--hidden/--ffn with vocab 32000, hidden/128 heads
    and a quarter as many KV heads: say so when that is not the model megatrain runs."""
    heads = spec.hidden_size // 128
    same = (spec.model_type == "llama" and spec.vocab_size == 32000 and spec.num_heads == heads
            and spec.num_kv_heads == max(1, heads // 4) and not spec.tie_word_embeddings)
    return None if same else (f"note: the peers build a Llama with vocab 32000 and {heads} heads / "
                              f"{max(1, heads // 4)} KV heads, not {spec.name}'s shape")


def run_once(cfg: Config, timeout_s: float, log_path: Path | None) -> dict:
    """Run one process; its `RESULT {...}` line as a dict, or {"error": why}."""
    env = os.environ.copy()
    for k, v in cfg.env.items():
        env[k] = v + (os.pathsep + env[k] if env.get(k) else "")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cfg.argv, capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = f"timed out after {timeout_s:.0f} s", None
    wall = time.perf_counter() - t0
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {shlex.join(cfg.argv)}\n# {wall:.1f} s, exit {rc}\n{stdout}\n--- stderr\n{stderr}")
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            try:
                return {**json.loads(line[len("RESULT "):]), "wall_s": round(wall, 1)}
            except json.JSONDecodeError:
                break
    if rc is None:
        return {"error": stderr, "wall_s": round(wall, 1)}
    tail = " | ".join((stderr or stdout).strip().splitlines()[-2:])
    return {"error": f"exit {rc}: {tail}"[:300], "wall_s": round(wall, 1)}


def slug(label: str) -> str:
    """A file name for a config label: "megatrain arrival:resident_layers=4" -> megatrain_arrival_resident_layers_4
    (letters, digits, `_ . -` only: the GPU machine's tool does not bring back files whose names hold `=`)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label)


def expected_s(runs: list[dict], longest: float) -> float:
    """How long the next run of a config is likely to take, for `--budget-s`: its longest earlier run (this call's
    or the results file's; a config's first process can be longer, e.g. DeepSpeed building its CPU Adam), else the
    longest run of this call (a config not run yet), else 1 s."""
    walls = [r["wall_s"] for r in runs if isinstance(r.get("wall_s"), (int, float))]
    return max(walls) if walls else max(longest, 1.0)


def rounds_order(configs: list[Config], rounds: int) -> list[tuple[int, Config]]:
    """(round, config) in the order they run: every config once per round, rounds one after the other."""
    return [(r, c) for r in range(1, rounds + 1) for c in configs]


# ---- the table ---------------------------------------------------------------------------------------------------
def _spread(xs: list[float], fmt: str = "{:,.0f}") -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)
    return fmt.format(med) + (f" ({fmt.format(min(xs))}-{fmt.format(max(xs))})" if len(xs) > 1 else "")


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per config: runs, failures, and the medians of what its successful runs report."""
    out = {}
    for label, runs in results.items():
        ok = [r for r in runs if "tokens_per_s" in r]
        s = {"runs": len(runs), "ok": len(ok), "errors": [r["error"] for r in runs if "error" in r],
             "tps": [r["tokens_per_s"] for r in ok]}
        for key in ("model_TFLOPs", "peak_gpu_GiB", "host_rss_GiB", "host_B_per_param", "gpu_idle_pct",
                    "predicted_tokens_per_s", "bound_tokens_per_s",
                    "calibrated_tokens_per_s", "transfer_tokens_per_s"):
            vals = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
            s[key] = statistics.median(vals) if vals else None
        if s["host_B_per_param"] is None and s["host_rss_GiB"] is not None:  # megatrain and the older peers
            per = [r["host_rss_GiB"] * GiB / (r["params_B"] * 1e9) for r in ok if r.get("params_B")]
            s["host_B_per_param"] = statistics.median(per) if per else None
        s["bound_binds"] = next((r["bound_binds"] for r in ok if "bound_binds" in r), None)
        # a run that ended with its loss NaN or inf did not train, however fast it ran (the authors' trainer on
        # the H100 table's start: grad norm NaN from its second step on)
        s["not_trained"] = sum(1 for r in ok if isinstance(r.get("loss"), float) and not math.isfinite(r["loss"]))
        s["clip"] = next((c for c in map(_max_norm, ok) if c is not None), None)
        counts = [tuple(map(int, r["clipped_steps"].split("/"))) for r in ok if "clipped_steps" in r]
        s["clipped_steps"] = (sum(c for c, _ in counts), sum(n for _, n in counts)) if counts else None
        s["schedule"] = next((r["schedule"] for r in ok if "schedule" in r), None)
        s["settings"] = next((f"{r['settings']} ({r.get('config_file', r['config'])})" for r in ok if "settings" in r),
                             None)
        out[label] = s
    return out


def _max_norm(result: dict) -> float | None:
    """The max gradient norm a run clipped at (0: none): a peer's RESULT says it (the authors' trainer as
    grad_clip, None for none), megatrain's record has it, baseline_train.py never clips."""
    if isinstance(result.get("clip"), (int, float)):
        return float(result["clip"])
    if "grad_clip" in result:
        return float(result["grad_clip"] or 0.0)
    if result.get("mode") in PEERS:
        return 0.0
    knobs = (result.get("record") or {}).get("knobs") or {}
    return float(knobs["clip"]) if isinstance(knobs.get("clip"), (int, float)) else None


def _clipping(s: dict) -> str:
    """The clipping a row ran with, and for megatrain how many timed steps it scaled (all runs together)."""
    if s.get("clip") is None:
        return "?"
    text = "none" if s["clip"] == 0 else f"{s['clip']:g}"
    if s["clip"] and s.get("clipped_steps"):
        text += " ({}/{} steps clipped)".format(*s["clipped_steps"])
    return text


def _pred(p: float | None, meas: float | None) -> str:
    return "-" if p is None or not meas else f"{p:,.0f} ({p / meas - 1:+.1%})"


def _bound(s: dict, meas: float | None) -> str:
    """megatrain rows: the physical bound in tokens/s (what binds) and the measured median's share of it."""
    b = s.get("bound_tokens_per_s")
    if b is None or not meas:
        return "-"
    return f"{b:,.0f} ({s['bound_binds']}): {meas / b:.0%}"


def table(summary: dict[str, dict], reference: str | None) -> str:
    ref = summary.get(reference or "", {})
    ref_tps = statistics.median(ref["tps"]) if ref.get("tps") else None
    cols = ["config", "clipping", "runs ok", "tokens/s median (min-max)", f"x {reference}" if reference else "x ref",
            "model TFLOP/s", "peak GPU GiB", "host RSS GiB", "host B/param", "GPU idle %",
            "physical bound tok/s (binds): efficiency", "predicted, profile (out of sample; at the run's clip share)",
            "IN-SAMPLE: live-calibrated on its own steps", "predicted, calibrated elsewhere"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, s in summary.items():
        med = statistics.median(s["tps"]) if s["tps"] else None
        def num(key, fmt="{:.1f}"):
            return "-" if s[key] is None else fmt.format(s[key])
        cells = [label + (f" (ran as {s['schedule']})" if s["schedule"] and s["schedule"].startswith("auto") else ""),
                 _clipping(s), f"{s['ok']}/{s['runs']}" + (f", {s['not_trained']} diverged" if s["not_trained"]
                                                           else ""),
                 _spread(s["tps"]),
                 f"{med / ref_tps:.2f}" if med and ref_tps else "-", num("model_TFLOPs"), num("peak_gpu_GiB"),
                 num("host_rss_GiB"), num("host_B_per_param"), num("gpu_idle_pct"), _bound(s, med),
                 _pred(s["predicted_tokens_per_s"], med),
                 _pred(s["calibrated_tokens_per_s"], med), _pred(s["transfer_tokens_per_s"], med)]
        lines.append("| " + " | ".join(cells) + " |")
        if s["errors"]:
            lines.append(f"|  ↳ {len(s['errors'])} failed: {s['errors'][0][:160]} |" + " |" * (len(cols) - 1))
        if s["not_trained"]:
            lines.append(f"|  ↳ {s['not_trained']} run(s) ended with the loss NaN or inf: their tokens/s are not "
                         "those of training |" + " |" * (len(cols) - 1))
    return "\n".join(lines)


def settings_lines(summary: dict[str, dict]) -> list[str]:
    """Each peer row's settings (the config it ran with), printed under the table."""
    return [f"- {label}: {s['settings']}" for label, s in summary.items() if s.get("settings")]


def tau_lines(summary: dict[str, dict]) -> list[str]:
    """Kendall tau between each prediction column and the measured medians of the megatrain rows."""
    rows = {k: s for k, s in summary.items() if k.startswith("megatrain ") and s["tps"]}
    out = []
    for key, what, label in (("predicted_tokens_per_s", "profile", ""),
                             ("calibrated_tokens_per_s", "live-calibrated on each run's own steps", "IN-SAMPLE: "),
                             ("transfer_tokens_per_s", "calibrated elsewhere", "")):
        pairs = [(s[key], statistics.median(s["tps"])) for s in rows.values() if s[key] is not None]
        tau = kendall_tau([p for p, _ in pairs], [m for _, m in pairs]) if len(pairs) >= 2 else None
        if tau is not None:
            out.append(f"{label}Kendall tau, predicted ({what}) vs measured medians of {len(pairs)} megatrain "
                       f"configs: {tau:.2f}")
    return out


# ---- main --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="resident,zero3,fsdp2,arrival-resident:resident_layers=4",
                    help=f"comma-separated: a peer of scripts/peers ({', '.join(OUR_PEERS)}; PEER:clip=0 for no "
                         f"clipping, ZenFlow peers :layout_fix=1 for the layout repair), {', '.join(PEERS)}, "
                         f"{AUTHORS}, {AUTHORS_FIXED}, or a megatrain SCHEDULE[:k=v;k=v]")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every config, interleaved round-robin (>= 1)")
    ap.add_argument("--model", default="bench-3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (after 2 warm-up steps)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per process; a slower one is marked failed")
    ap.add_argument("--reference", help="config the ratio column divides by (default: the first)")
    ap.add_argument("--bench-dir", default=".bench", help="folder with baseline_train.py and megatrain_repo/")
    ap.add_argument("--authors-dir", help="checkout of the MegaTrain authors' code with the harness peer.py in it "
                                          "(default BENCH_DIR/megatrain_repo; docs/peers.md: commit and fetch)")
    ap.add_argument("--profile", help="megatrain's profile for the predictions (bench_megatrain.py's default)")
    ap.add_argument("--calibrated-profile", help="a profile calibrated on another run: the last prediction column")
    ap.add_argument("--save-calibrated-dir", help="each megatrain run writes its live-calibrated profile here, "
                                                  "as <config slug>.json (for --calibrated-profile of a later call)")
    ap.add_argument("--gpu-limit-gib", type=float, default=16.0, help="GPU budget of megatrain's --schedule auto")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="megatrain's backend (cpu: CI)")
    ap.add_argument("--python", default=sys.executable, help="interpreter of every process")
    ap.add_argument("--ds-bind", default="auto", choices=("auto", "yes", "no"),
                    help="DeepSpeed peers: --bind_cores_to_rank (needs numactl; auto: when numactl is found)")
    ap.add_argument("--log-dir", help="each process's output and RESULT lines (default $OUT/bench if $OUT is set)")
    ap.add_argument("--out", help="also append the table, with this command, to this markdown file")
    ap.add_argument("--dry-run", action="store_true", help="print the commands in the order they would run")
    ap.add_argument("--results", help="JSON lines of every run: runs already there are not run again")
    ap.add_argument("--budget-s", type=float, help="start no process likely to end after this many seconds")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    from megatrain.model.presets import get_model

    spec = get_model(a.model)
    configs = build_configs(a)
    order = rounds_order(configs, a.rounds)
    # a peer may warm up longer (run_peer's default, peerconf.warmup_steps: ZenFlow two update intervals)
    peers = {c.label.partition(":")[0] for c in configs if c.kind == "ours"}
    warmups = {peer: peerconf.warmup_steps(peerconf.load(peer)) for peer in peers}
    longer = sorted(f"{peer} {w}" for peer, w in warmups.items() if w != peerconf.DEFAULT_WARMUP)
    warmup = f"{peerconf.DEFAULT_WARMUP} warm-up" + (f" ({', '.join(longer)})" if longer else "")
    head = (f"{spec.name}: {spec.num_params / 1e9:.3f} B params, {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"ffn {spec.intermediate_size}; batch {a.batch} x seq {a.seq}; {a.steps} timed steps after {warmup}; "
            f"{a.rounds} rounds of {len(configs)} configs, each run its own process")
    print(head)
    note = peer_shape_note(spec) if any(c.kind in ("peer", "authors") for c in configs) else None
    if note:
        print(note)
    if any(c.kind == "ours" and "deepspeed.launcher.runner" in c.argv for c in configs) and not ds_binding(a):
        print("note: DeepSpeed peers run without --bind_cores_to_rank (their docs' advice): "
              + ("no numactl on this machine" if a.ds_bind == "auto" else "--ds-bind no"))
    if a.dry_run:
        for r, c in order:
            env = " ".join(f"{k}={v}:$PYTHONPATH" for k, v in c.env.items())
            print(f"round {r}: {env + ' ' if env else ''}{shlex.join(c.argv)}")
        return 0
    log_dir = Path(a.log_dir) if a.log_dir else (Path(os.environ["OUT"]) / "bench" if os.environ.get("OUT") else None)
    results: dict[str, list[dict]] = {c.label: [] for c in configs}
    done = set()
    if a.results and Path(a.results).is_file():  # runs of an earlier call of the same command
        for line in Path(a.results).read_text().splitlines():
            rec = json.loads(line)
            if rec.get("config") in results and (rec["round"], rec["config"]) not in done:
                done.add((rec["round"], rec["config"]))
                results[rec["config"]].append(rec)
        print(f"{len(done)} run(s) already in {a.results}")
    t0, longest, unfinished, held_round = time.perf_counter(), 0.0, 0, None
    for i, (r, c) in enumerate(order, 1):
        if (r, c.label) in done:
            continue
        if held_round is not None and r > held_round:  # a run of an earlier round is left for the next call
            unfinished += 1
            continue
        if a.budget_s and time.perf_counter() - t0 + expected_s(results[c.label], longest) > a.budget_s:
            unfinished += 1
            held_round = r  # later configs of this round may still fit; later rounds wait, to keep the order
            continue
        run = c
        if log_dir and c.kind == "megatrain":  # its last timed step, task by task, beside its log
            run = replace(c, argv=[*c.argv, "--timeline", str(log_dir / f"r{r}-{slug(c.label)}.timeline.csv")])
        res = run_once(run, a.timeout, log_dir / f"r{r}-{slug(c.label)}.log" if log_dir else None)
        longest = max(longest, res["wall_s"])
        results[c.label].append(res)
        what = f"{res['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in res else f"FAILED ({res['error'][:200]})"
        print(f"[{i}/{len(order)}] round {r} {c.label}: {what} in {res['wall_s']:.0f} s", flush=True)
        for path in [p for p in (a.results, log_dir and log_dir / "results.jsonl") if p]:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                # res carries the run's program record (scripts/bench_megatrain.py); calibrated_file: its profile
                extra = {"calibrated_file": Path(c.calibrated).name} if c.calibrated else {}
                # a peer's RESULT names its config file `config`: kept as `config_file`, the label stays the key
                rec = {k: v for k, v in res.items() if k != "config"}
                if "config" in res:
                    extra["config_file"] = res["config"]
                f.write(json.dumps({"round": r, "config": c.label, **rec, **extra}) + "\n")
    if unfinished:
        print(f"{unfinished} run(s) left for the time budget: run the same command again to continue")
    summary = summarize(results)
    settings = settings_lines(summary)
    text = "\n".join([table(summary, a.reference or configs[0].label), "", *tau_lines(summary),
                      *(["", "Peer settings:", *settings] if settings else [])])
    print()
    print(text)
    if a.out:
        cmd = shlex.join(["python3", "scripts/bench.py", *(argv if argv is not None else sys.argv[1:])])
        with open(a.out, "a") as f:
            f.write(f"\n## {head} — {datetime.date.today()}\n\nCommand: `{cmd}`\n\n{text}\n")
    if unfinished:
        return 3
    return 0 if all(s["ok"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
