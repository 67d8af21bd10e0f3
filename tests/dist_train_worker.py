"""One rank of `run_training` under a torchrun-like environment (tests/test_dist_cpu.py starts two): the config is
the debug model with the given `key=value` overrides; `--stop-rank0-at N` asks only rank 0 to stop after step N
(as if only it had been sent SIGTERM), so the test sees whether the ranks agree on where to stop."""
import argparse
import os

from megatrain.train.config import load_config
from megatrain.train.loop import run_training


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="unused (the launcher's common argument)")
    ap.add_argument("--stop-rank0-at", type=int)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    stop = a.stop_rank0_at if os.environ.get("RANK") == "0" else None
    summary = run_training(load_config(None, a.overrides), stop_at_step=stop)
    print(f"RESULT rank={os.environ.get('RANK')} steps={summary.steps} stopped_early={summary.stopped_early}")


if __name__ == "__main__":
    main()
