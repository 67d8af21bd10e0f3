"""Exact clipping against no clipping, on the GPU machine: the same schedule at clip=0, at a max norm the run never
reaches (exact clipping that does not activate: the global norm is taken, the coefficient is 1) and at one it
always exceeds (every step clips), each configuration `--rounds` times in its own process, interleaved round-robin
so that the host's drift hits all of them alike. Prints a table: median tokens/s (min-max), the ratio to clip=0,
the median gradient norm, steps that clipped, and the simulator's prediction for a quiet and a clipping step.

    PYTHONPATH=.:/tmp/site python3 scripts/bench_clip.py --model bench-3b --batch 8 --seq 2048 \\
        --schedule arrival-resident --set resident_layers=4 --rounds 3 --clips 0,100,1.0
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_once(args: argparse.Namespace, clip: str) -> dict:
    cmd = [sys.executable, "scripts/bench_megatrain.py", "--model", args.model, "--batch", str(args.batch), "--seq",
           str(args.seq), "--schedule", args.schedule, "--steps", str(args.steps), "--set", f"clip={clip}"]
    for s in args.set:
        cmd += ["--set", s]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout_s:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: " + (p.stderr.strip().splitlines() or ["no output"])[-1]}
    out = json.loads(lines[-1][len("RESULT "):])
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench-3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--schedule", default="arrival-resident")
    ap.add_argument("--set", action="append", default=[], help="more schedule knobs (repeat)")
    ap.add_argument("--clips", default="0,100,1.0", help="max norms to compare; the first is the reference")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=400)
    ap.add_argument("--log", help="append every RESULT (JSON lines) here")
    args = ap.parse_args()
    clips = args.clips.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in clips}
    for r in range(args.rounds):
        for c in clips:
            res = run_once(args, c)
            res.update(round=r + 1, clip=c)
            runs[c].append(res)
            print(f"round {r + 1} clip={c}: " + (res.get("error") or f"{res['tokens_per_s']:,.0f} tok/s, "
                  f"grad norm {res.get('grad_norm_median')}, clipped {res.get('clipped_steps')}, "
                  f"{res['wall_s']} s"), flush=True)
            if args.log:
                with Path(args.log).open("a") as f:
                    f.write(json.dumps(res) + "\n")
    ref = [x["tokens_per_s"] for x in runs[clips[0]] if "tokens_per_s" in x]
    ref_med = statistics.median(ref) if ref else float("nan")
    print(f"\n{args.model} {args.batch}x{args.seq}, {args.schedule} {' '.join(args.set)}, {args.rounds} rounds "
          f"interleaved, {args.steps} timed steps each (median step per process)")
    print("| clip | tokens/s median (min-max) | vs clip=" + clips[0] + " | grad norm | clipped steps | redone / "
          "deferred updates | predicted quiet / clipping step s | measured step s |")
    print("|---|---|---|---|---|---|---|---|")
    for c in clips:
        ok = [x for x in runs[c] if "tokens_per_s" in x]
        if not ok:
            print(f"| {c} | failed: {runs[c][0].get('error')} | | | | | | |")
            continue
        tps = [x["tokens_per_s"] for x in ok]
        med = statistics.median(tps)
        last = ok[-1]
        pred = f"{last.get('predicted_step_s', '-')} / {last.get('predicted_clipping_step_s', '-')}"
        print(f"| {c} | {med:,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | {med / ref_med:.3f} | "
              f"{last.get('grad_norm_median', '-')} | {last.get('clipped_steps', '-')} | "
              f"{last.get('redone_updates', '-')} / {last.get('deferred_updates', '-')} | {pred} | "
              f"{statistics.median(x['median_step_s'] for x in ok):.3f} |")


if __name__ == "__main__":
    main()
