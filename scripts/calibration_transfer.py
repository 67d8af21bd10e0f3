"""How well a profile calibrated on one run predicts the others: the out-of-sample check of live calibration.

`scripts/bench.py --save-calibrated-dir DIR` leaves one live-calibrated profile per megatrain config (fitted to that
config's own timed steps). This script needs no GPU: it rebuilds every megatrain config of the results file(s) as
the Program that ran, simulates it with each calibrated profile, and prints a matrix of predicted tokens/s against
the measured median (rows: the run a profile was calibrated on; columns: the config predicted). The diagonal is in
sample (a profile predicting the run it was fitted to); everything off it is a prediction for a schedule the profile
never saw. Under the matrix: the largest out-of-sample error of each profile and the Kendall tau of its ranking.

    python scripts/calibration_transfer.py --results docs/runs/18-issue13/a.jsonl docs/runs/18-issue13/a2.jsonl \\
        --cal-dir docs/runs/18-issue13/cal
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import megatrain.parallel  # noqa: F401  (registers the collective strategies: a record may be of several ranks)
from megatrain.compile.record import RecordError, program_of
from megatrain.profiling.compare import kendall_tau_b as kendall_tau
from megatrain.sim import load_profile, simulate

PREFIX = "megatrain "


def measured_runs(paths: list[str]) -> dict[str, list[dict]]:
    """config label (without "megatrain ") -> its successful runs, from bench.py's results files."""
    runs: dict[str, list[dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if row.get("mode") == "megatrain" and "tokens_per_s" in row and not row.get("error"):
                runs.setdefault(row["config"].removeprefix(PREFIX), []).append(row)
    if not runs:
        raise SystemExit(f"no successful megatrain runs in {', '.join(paths)}")
    return runs


def program_of_runs(label: str, row: dict):
    """The Program a config ran, from its run's program record (never from its label)."""
    if "record" not in row:
        raise SystemExit(f"{label!r}: its results have no program record (they predate them); run bench.py again")
    try:
        return program_of(row["record"])
    except RecordError as e:
        raise SystemExit(f"{label!r}: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", nargs="+", required=True, help="bench.py results JSON lines")
    ap.add_argument("--cal-dir", required=True, help="bench.py --save-calibrated-dir")
    ap.add_argument("--profile", default="h200-measured", help="the uncalibrated profile, for its row")
    a = ap.parse_args(argv)

    runs = measured_runs(a.results)
    labels = list(runs)
    measured = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    programs = {k: program_of_runs(k, v[0]) for k, v in runs.items()}
    tokens = {k: v[0]["batch"] * v[0]["seq"] for k, v in runs.items()}
    for k, v in runs.items():  # the rebuilt Program is the one that ran: its shipped prediction matches the run's
        recorded, rebuilt = v[0]["predicted_step_s"], simulate(programs[k], load_profile(a.profile)).step_s
        if abs(rebuilt / recorded - 1) > 0.005:
            raise SystemExit(f"{k}: rebuilt Program predicts {rebuilt:.4f} s with {a.profile}, the run recorded "
                             f"{recorded:.4f} s: not the Program that ran (other code or knobs)")
    profiles = {a.profile + " (uncalibrated)": load_profile(a.profile)}
    for k in labels:
        name = runs[k][0].get("calibrated_file")  # bench.py records where it saved the run's profile
        path = Path(a.cal_dir) / name if name else None
        if path is not None and path.is_file():
            profiles[f"calibrated on {k}"] = load_profile(path)
    if len(profiles) == 1:
        raise SystemExit(f"no calibrated profile in {a.cal_dir} matches a config of the results")

    head = ["profile \\ predicted (tok/s, error vs measured median)", *labels]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("| measured median (runs) | " + " | ".join(f"{measured[k]:,.0f} ({len(runs[k])})" for k in labels) + " |")
    summary = []
    for name, prof in profiles.items():
        pred = {k: tokens[k] / simulate(programs[k], prof).step_s for k in labels}
        err = {k: pred[k] / measured[k] - 1 for k in labels}
        cells = [f"{pred[k]:,.0f} ({100 * err[k]:+.1f}%)" + (" *" if name.endswith(f" {k}") else "") for k in labels]
        print(f"| {name} | " + " | ".join(cells) + " |")
        outside = [abs(e) for k, e in err.items() if not name.endswith(f" {k}")]
        tau = kendall_tau([pred[k] for k in labels], [measured[k] for k in labels])
        summary.append(f"{name}: largest error on configs it was not fitted to {100 * max(outside):.1f}%, "
                       f"Kendall tau {tau:.2f}" if tau is not None else f"{name}: largest error {max(outside):.1%}")
    print("\n(* in sample: the profile predicting the run it was fitted to)\n")
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
