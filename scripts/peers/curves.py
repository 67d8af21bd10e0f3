"""Loss curves side by side: a table aligned by step, the mean over the last steps, the gap to the reference.

    python3 scripts/peers/curves.py REF CURVE [CURVE ...] --out curves.md [--png curves.png]

Each CURVE is a file, or LABEL=FILE (the label defaults to the file's stem, or the run directory's name):
  * run_peer.py's `--losses` file: a JSON list of {"step", "loss", ...} (peercurve.write_losses);
  * megatrain's metrics.jsonl (one JSON object a line with "step" and "loss"), or the run directory holding it.
The first curve is the reference (the exact AdamW run). The table has every `--every`-th step (10) and the last
common step; the summary has each curve's mean loss over the last `--tail` (50) steps all curves share, and its
relative gap to the reference's mean over the same steps: (mean - mean_ref) / mean_ref. Where the curves carry
their batches' digests (run_peer's files), steps whose batches differ are reported: a curve compared on other data
says nothing. The markdown goes to `--out` and to stdout; `--png` also plots the curves (matplotlib, Agg).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path


class CurveError(ValueError):
    """A curve file that cannot be read as one; the message names the file and what is wrong."""


@dataclass
class Curve:
    label: str
    source: str
    loss: dict[int, float]  # step (1-based) -> loss
    digests: dict[int, str] = field(default_factory=dict)  # step -> SHA-1 of its inputs, where the file has them


def _rows(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".jsonl":
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise CurveError(f"{path}: a line is not JSON ({e})") from None
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise CurveError(f"{path}: not JSON ({e}); give run_peer's --losses file or megatrain's metrics.jsonl") \
            from None
    if not isinstance(rows, list):
        raise CurveError(f"{path}: a JSON {type(rows).__name__}, not a list of steps; give run_peer's --losses file")
    return rows


def load_curve(spec: str) -> Curve:
    """A curve from `FILE`, `RUN_DIR` (its metrics.jsonl) or `LABEL=FILE`."""
    label, _, name = spec.partition("=") if "=" in spec else ("", "", spec)
    path = Path(name)
    if path.is_dir():
        label = label or path.name
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise CurveError(f"{path}: no such file; give run_peer's --losses file, megatrain's metrics.jsonl or its "
                         "run directory")
    label = label or path.stem
    loss, digests = {}, {}
    for i, row in enumerate(_rows(path), 1):
        if not isinstance(row, dict) or "step" not in row or "loss" not in row:
            raise CurveError(f"{path}: entry {i} has no 'step' and 'loss'")
        step = int(row["step"])  # a step twice (a resumed megatrain run): the later record counts
        if row["loss"] is not None and math.isfinite(float(row["loss"])):
            loss[step] = float(row["loss"])
        if row.get("batch_sha1"):
            digests[step] = row["batch_sha1"]
    if not loss:
        raise CurveError(f"{path}: no finite loss in it")
    return Curve(label, str(path), loss, digests)


@dataclass
class Comparison:
    curves: list[Curve]
    steps: list[int]  # the table's steps
    tail_steps: list[int]  # the steps the means are over (the last `tail` common steps)
    means: list[float]
    gaps: list[float | None]  # relative to the reference (None for the reference itself)
    data_mismatch: dict[str, list[int]]  # label -> steps whose batch differs from the reference's


def compare(curves: list[Curve], every: int = 10, tail: int = 50) -> Comparison:
    """Align `curves` by step (the first is the reference); see the module docstring."""
    if len(curves) < 2:
        raise CurveError("give at least two curves: the reference first, then the ones compared with it")
    common = sorted(set.intersection(*(set(c.loss) for c in curves)))
    if not common:
        raise CurveError("the curves share no step: " + "; ".join(f"{c.label} steps {min(c.loss)}-{max(c.loss)}"
                                                                  for c in curves))
    every_steps = sorted(set().union(*(c.loss for c in curves)))
    steps = [s for s in every_steps if s % every == 0 or s == 1]
    if common[-1] not in steps:
        steps.append(common[-1])
    tail_steps = common[-tail:]
    means = [statistics.fmean(c.loss[s] for s in tail_steps) for c in curves]
    gaps = [None] + [(m - means[0]) / means[0] for m in means[1:]]
    ref = curves[0]
    mismatch = {}
    for c in curves[1:]:
        both = sorted(set(ref.digests) & set(c.digests))
        bad = [s for s in both if ref.digests[s] != c.digests[s]]
        if bad:
            mismatch[c.label] = bad
    return Comparison(curves, sorted(steps), tail_steps, means, gaps, mismatch)


def markdown(cmp: Comparison) -> str:
    """The table, the summary and any data mismatch, as markdown."""
    cs = cmp.curves
    lines = ["| step | " + " | ".join(c.label for c in cs) + " |", "|---:|" + "---:|" * len(cs)]
    for s in cmp.steps:
        lines.append(f"| {s} | " + " | ".join(f"{c.loss[s]:.4f}" if s in c.loss else "-" for c in cs) + " |")
    t = cmp.tail_steps
    lines += ["", f"Mean loss over steps {t[0]}-{t[-1]} ({len(t)} steps, the last the curves share); gap relative "
                  f"to {cs[0].label} (the reference):", "",
              "| curve | mean loss | gap |", "|---|---:|---:|"]
    for c, m, g in zip(cs, cmp.means, cmp.gaps):
        lines.append(f"| {c.label} | {m:.4f} | " + ("reference" if g is None else f"{100 * g:+.2f} %") + " |")
    lines += ["", "Sources: " + "; ".join(f"{c.label} = {c.source}" for c in cs)]
    checked = [c.label for c in cs[1:] if c.digests and cs[0].digests]
    if cmp.data_mismatch:
        for label, bad in cmp.data_mismatch.items():
            lines.append(f"\n**{label} trained on other batches than {cs[0].label}** at {len(bad)} step(s), first "
                         f"step {bad[0]}: its curve is not comparable.")
    elif checked:
        lines.append(f"\nSame batches, step by step (input-id digests): {', '.join(checked)} and {cs[0].label}.")
    return "\n".join(lines) + "\n"


def plot(cmp: Comparison, path: str | Path) -> None:
    """The curves, one line each, the reference first; the tail's means as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the bench machines or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for c, m in zip(cmp.curves, cmp.means):
        steps = sorted(c.loss)
        (line,) = ax.plot(steps, [c.loss[s] for s in steps], label=f"{c.label} (mean of last {len(cmp.tail_steps)}:"
                                                                     f" {m:.3f})", linewidth=1.2)
        ax.hlines(m, cmp.tail_steps[0], cmp.tail_steps[-1], colors=line.get_color(), linestyles="dashed",
                  linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("curves", nargs="+", metavar="[LABEL=]FILE", help="the reference first")
    ap.add_argument("--out", required=True, help="the markdown file to write")
    ap.add_argument("--png", help="also plot the curves here")
    ap.add_argument("--every", type=int, default=10, help="table rows every N steps (plus step 1 and the last)")
    ap.add_argument("--tail", type=int, default=50, help="the mean is over the last N steps the curves share")
    a = ap.parse_args(argv)
    if a.every < 1 or a.tail < 1:
        ap.error("--every and --tail must be at least 1")
    try:
        cmp = compare([load_curve(s) for s in a.curves], a.every, a.tail)
    except CurveError as e:
        print(f"curves: {e}", file=sys.stderr)
        return 2
    text = markdown(cmp)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    if a.png:
        plot(cmp, a.png)
    print(text, end="")
    return 1 if cmp.data_mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
