"""The device redo of speculative clipping (adamw_undo + adamw_update) by undo chunk size, against the fused update.

    PYTHONPATH=. python scripts/bench_undo.py [--params 177217536] [--device cuda]

Prints one row per chunk: the median of 5 timed calls (min-max) and the redo in updates (the profile's
clip_redo_updates): the update and the redo are those the profiler times (`profiling.rates.AdamTiles`, as
`measure_gpu_adam` does), the redo with the chunk of the row. The result does not depend on the chunk
(tests/test_speculative_clip.py)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatrain.profiling.rates import AdamTiles


def timed(fn, device: str, reps: int = 5) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--params", type=int, default=177_217_536, help="a llama-4.5b layer's parameters by default")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = a.parse_args()
    n = a.params
    tiles = AdamTiles(n, torch.device(a.device), streaming_copy=False)  # device tiles: no streaming copy
    upd = timed(tiles.update, a.device)
    u = statistics.median(upd)
    print(f"{n:,} parameters on {a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else 'host'})")
    print(f"{'what':<28} {'median ms':>10} {'min-max ms':>16} {'in updates':>11}")
    print(f"{'fused update':<28} {1e3 * u:>10.3f} {1e3 * min(upd):>7.3f}-{1e3 * max(upd):<8.3f} {1.0:>11.2f}")
    for chunk in (1 << 20, 1 << 22, 1 << 24, 1 << 26):
        t = timed(lambda chunk=chunk: tiles.redo(chunk), a.device)
        r = statistics.median(t)
        print(f"{'redo, undo chunk ' + str(chunk >> 20) + ' Mi':<28} {1e3 * r:>10.3f} "
              f"{1e3 * min(t):>7.3f}-{1e3 * max(t):<8.3f} {r / u:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
