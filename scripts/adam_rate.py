"""CPU AdamW rate of the executor's update (megatrain.exec.optim.adamw_update on a layer-sized fp32 tile, plus the
bf16 streaming-copy refresh the runtime does after it), by thread count. Prints one JSON line per setting.

    python scripts/adam_rate.py --params 99e6 --threads 4,8,13,16
"""
import argparse
import json
import time

import torch

from megatrain.exec.optim import AdamWConfig, adamw_update


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=99e6)
    ap.add_argument("--threads", default="4,8,13,16")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    n = int(a.params)
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    shadow = torch.empty(n, dtype=torch.bfloat16)
    cfg = AdamWConfig(lr=1e-4, weight_decay=0.1)
    for threads in [int(t) for t in a.threads.split(",")]:
        torch.set_num_threads(threads)
        for refresh in (False, True):
            times = []
            for i in range(a.repeat + 1):
                t0 = time.perf_counter()
                adamw_update(p, g, m, v, i + 1, n - 10_000, 1e-4, cfg, clip_coef=0.5)
                if refresh:
                    shadow.copy_(p)
                times.append(time.perf_counter() - t0)
            best = sorted(times[1:])[len(times[1:]) // 2]
            print(json.dumps({"threads": threads, "refresh_bf16": refresh, "params": n,
                              "Gparam_per_s": round(n / best / 1e9, 2), "ms": round(best * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
