"""Side-by-side benchmark on the GPU machine: megatrain schedules and the peers of BENCHMARKS.md, same model,
batch and sequence length, in one run. Prints one table and appends it, with the exact command, to
docs/benchmarks.md (or --out).

Peers run through bench/baseline_train.py (copied from shared/bench into an ignored folder; DeepSpeed from its
wheels, see BENCHMARKS.md); each run is its own process so peak GPU memory and host RSS are its own.

    PYTHONPATH=.:/tmp/site python scripts/bench.py --bench-dir .bench --model bench-3b --batch 8 --seq 2048 \
        --peers resident,zero3,fsdp2 --schedules overlap,arrival
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from megatrain.presets import get_model


def run_json(cmd: list[str], timeout_s: float, log) -> dict:
    """Run a command, stream its output to the log, return its `RESULT {...}` line (or an error record)."""
    print("$ " + shlex.join(cmd), file=log, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    log.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    log.flush()
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def table(rows: list[dict], peers: dict[str, dict]) -> str:
    cols = ["run", "tokens/s", "model TFLOP/s", "peak GPU GiB", "host RSS GiB", "GPU idle %", "predicted tokens/s"]
    cols += [f"x {p}" for p in peers]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'][:120]} |" + " |" * (len(cols) - 2))
            continue
        cells = [r["run"], f"{r['tokens_per_s']:,.0f}", f"{r['model_TFLOPs']:.1f}", f"{r['peak_gpu_GiB']:.1f}",
                 f"{r['host_rss_GiB']:.1f}", f"{r['gpu_idle_pct']:.1f}" if "gpu_idle_pct" in r else "-",
                 f"{r['predicted_tokens_per_s']:,.0f} ({r['predicted_tokens_per_s'] / r['tokens_per_s'] - 1:+.1%})"
                 if "predicted_tokens_per_s" in r else "-"]
        for p, pr in peers.items():
            cells.append(f"{r['tokens_per_s'] / pr['tokens_per_s']:.2f}" if "tokens_per_s" in pr else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-dir", default=".bench", help="folder holding baseline_train.py")
    ap.add_argument("--model", default="bench-3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--peers", default="resident,zero3,fsdp2")
    ap.add_argument("--schedules", default="overlap", help="comma-separated megatrain schedules (name[:k=v;k=v])")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--out", default="docs/benchmarks.md")
    ap.add_argument("--log", default="bench.log")
    ap.add_argument("--profile", default="h200-measured", help="hardware profile for megatrain's predicted column")
    ap.add_argument("--timelines", help="folder to write each megatrain run's measured timeline CSV into")
    a = ap.parse_args()
    spec = get_model(a.model)
    shape = ["--batch", str(a.batch), "--seq", str(a.seq)]
    with open(a.log, "a") as log:
        peers = {}
        for peer in [p for p in a.peers.split(",") if p]:
            cmd = [sys.executable, str(Path(a.bench_dir) / "baseline_train.py"), peer, "--layers",
                   str(spec.num_layers), "--hidden", str(spec.hidden_size), "--ffn", str(spec.intermediate_size),
                   *shape, "--steps", str(a.steps)]
            peers[peer] = run_json(cmd, a.timeout, log)
            print(peer, peers[peer], flush=True)
        rows = [{"run": p, **r} for p, r in peers.items()]
        for item in [s for s in a.schedules.split(",") if s]:
            name, _, sets = item.partition(":")
            extra = [x for kv in sets.split(";") if kv for x in ("--set", kv)]
            cmd = [sys.executable, "scripts/bench_megatrain.py", "--model", a.model, *shape, "--schedule", name,
                   *extra, "--steps", str(a.steps), "--profile", a.profile]
            if a.timelines:
                Path(a.timelines).mkdir(parents=True, exist_ok=True)
                cmd += ["--timeline", str(Path(a.timelines) / f"timeline-{len(rows)}.csv")]
            r = run_json(cmd, a.timeout, log)
            print(item, r, flush=True)
            rows.append({"run": f"megatrain {item}", **r})
    ok_peers = {p: r for p, r in peers.items() if "tokens_per_s" in r}
    text = table(rows, ok_peers)
    print(text)
    head = (f"\n## {a.model} ({spec.num_params / 1e9:.3f} B params, {spec.num_layers} layers, hidden "
            f"{spec.hidden_size}), batch {a.batch} x seq {a.seq} — {datetime.date.today()}\n\n"
            f"Command: `{shlex.join(['python', *sys.argv])}`\n\n")
    with open(a.out, "a") as f:
        f.write(head + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
