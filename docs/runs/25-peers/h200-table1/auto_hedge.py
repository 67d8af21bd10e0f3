"""What `--schedule auto`'s host hedge (megatrain/tune/auto.py `host_hedge`) would have measured on the H200 start of
issue 25's first table, bench-3b 8 x 2048 without clipping.

auto ranks on the shipped `h200-measured` profile (what a run without a profile of its machine uses) and measures the
K best predicted plus those within its band (6 at most); the hedge takes the last slot. Each candidate it would
measure is then priced with that start's profile fitted to its three `arrival-resident` runs (predict_next.py), the
stand-in for what the machine would have measured: out of sample for every candidate but `resident_layers=4`, and
an idealisation (a run-off measures, it does not simulate).

    PYTHONPATH=. .venv/bin/python docs/runs/25-peers/h200-table1/auto_hedge.py \
        > docs/runs/25-peers/h200-table1/auto_hedge.md
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
import predict_next as pn  # noqa: E402  (the fit and the timelines of this start)

from megatrain.compile.knobs import ScheduleKnobs, resolve_knobs  # noqa: E402
from megatrain.profiling.live import calibrate_run  # noqa: E402
from megatrain.sim import load_profile, simulate  # noqa: E402
from megatrain.train.autoswitch import AutoChoice  # noqa: E402
from megatrain.tune.auto import AutoBudget, choose_auto  # noqa: E402
from megatrain.units import GiB  # noqa: E402

TOKENS = 8 * 2048
ALL_ON_GPU = 17_213  # the all-on-GPU peer without clipping, this start's median


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = pn.find_timelines(pn.extract_logs(Path(tmp)))
        spec = pn.get_model("bench-3b")
        prog = pn.program(spec, resolve_knobs("arrival-resident", ["resident_layers=4", "clip=0"])[1])
        tls = [pd.read_csv(files[f"r{r}-megatrain_arrival-resident_resident_layers_4_clip_0.timeline.csv"])
               for r in (1, 2, 3)]
    shipped = load_profile("h200-measured")
    fitted = calibrate_run(prog, shipped, tls, warmup=0).profile

    def here(c) -> float:  # tokens/s on this start's fitted profile
        return TOKENS / simulate(c.result.program, fitted).mean_step_s

    print("`PYTHONPATH=. .venv/bin/python docs/runs/25-peers/h200-table1/auto_hedge.py` (from the repository root)\n")
    print(__doc__.split("\n\n")[1].replace("\n", " ") + "\n")
    print("| GPU budget | measured without the hedge (this host, tokens/s) | best of them | the hedge | "
          "with the hedge: best measured | best candidate of all |")
    print("|---|---|---|---|---|---|")
    for gib in (16, 24, 32, 48):
        pick = choose_auto(spec, 8, 2048, ScheduleKnobs(clip=0.0), shipped, AutoBudget(gib * GiB, None, "given"),
                           vary_compile=True)
        ranked = pick.ranked
        auto = AutoChoice(spec, 8, 2048, pick.knobs, pick.label, ranked, shipped)  # the defaults train runs with
        auto.start(1000, lambda line: None)  # how many it measures (auto.limit) and its hedge, by its own rule
        plain = auto.pool[:auto.limit]
        hedge = next((c for c in auto.pool if c.label == auto.hedge), None)
        hedged = plain if hedge is None else [*plain[:-1], hedge]
        best_plain = max(plain, key=here)
        best_hedged = max(hedged, key=here)
        best_all = max(ranked, key=here)

        def cell(c) -> str:
            return f"{c.label} {here(c):,.0f} ({here(c) / ALL_ON_GPU:.2f}x)"
        print(f"| {gib} GiB | {', '.join(f'{here(c):,.0f}' for c in plain)} | {cell(best_plain)} | "
              f"{hedge.label if hedge is not None else '- (among them)'} | {cell(best_hedged)} | {cell(best_all)} |")


if __name__ == "__main__":
    main()
