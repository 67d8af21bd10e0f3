"""Pictures of Timelines: a Chrome trace (Perfetto / chrome://tracing) and a Gantt chart (matplotlib).

Both take one Timeline, or several to compare (a predicted + measured pair, or schedule variants): a list, a
tuple or a dict {label: Timeline}. In the trace each timeline is a process (pid) and each stream a thread (tid),
with a counter of the GPU bytes in use when the Program is given. In the Gantt chart each stream is a row, each
task kind a colour, and the compute stream's idle stretches are shaded so the gaps stand out; several timelines
are drawn stacked on one time axis (`layout="stacked"`) or side by side (`layout="side"`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence, Union

import pandas as pd

from megatrain.ir.program import Program
from megatrain.ir.streams import STREAMS
from megatrain.ir.tasks import TaskKind
from megatrain.analysis.summary import gpu_memory_curve
from matplotlib.figure import Figure

Timelines = Union[pd.DataFrame, Sequence[pd.DataFrame], Mapping[str, pd.DataFrame]]

# Derived from TaskKind (ir/tasks.py), keyed by the letter a Timeline carries.
KIND_COLORS = {k.value: k.colour for k in TaskKind}
KIND_NAMES = {k.value: k.label for k in TaskKind}
IDLE_COLOR = "#e45756"


def labelled(timelines: Timelines) -> list[tuple[str, pd.DataFrame]]:
    """[(label, Timeline)]: dict keys, else each timeline's source ("predicted", "measured"), made unique."""
    if isinstance(timelines, pd.DataFrame):
        timelines = [timelines]
    if isinstance(timelines, Mapping):
        return [(str(k), v) for k, v in timelines.items()]
    out, seen = [], {}
    for df in timelines:
        label = str(df["source"].iloc[0]) if len(df) else "timeline"
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} {seen[label]}", df))
    return out


# ---- Chrome trace --------------------------------------------------------------------------------------------
def _py(v):
    """JSON-friendly scalar (pandas NA -> None, numpy -> Python)."""
    if v is None or v is pd.NA or (isinstance(v, float) and v != v):
        return None
    return v.item() if hasattr(v, "item") else v


def chrome_trace(timelines: Timelines, program: Program | None = None) -> dict:
    """The trace as a dict: `{"traceEvents": [...], "displayTimeUnit": "ms"}`, times in µs."""
    events = []
    for pid, (label, df) in enumerate(labelled(timelines), start=1):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, stream in enumerate(STREAMS, start=1):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": stream}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
        tids = {s: i for i, s in enumerate(STREAMS, start=1)}
        cols = [df[c].tolist() for c in ("task", "kind", "layer", "micro", "stream", "start_s", "end_s", "bytes",
                                         "flops", "step")]
        for task, kind, layer, micro, stream, start, end, nbytes, flops, step in zip(*cols):
            events.append({
                "name": task, "cat": KIND_NAMES.get(kind, kind), "ph": "X", "pid": pid,
                "tid": tids.get(stream, len(tids) + 1), "ts": start * 1e6, "dur": (end - start) * 1e6,
                "args": {"kind": kind, "layer": _py(layer), "micro": _py(micro), "bytes": _py(nbytes),
                         "flops": _py(flops), "step": _py(step)},
            })
        if program is not None and len(df):
            for step, part in df.groupby("step"):
                t0 = float(part["start_s"].min())
                curve = gpu_memory_curve(part, program)
                for t, b in zip(curve["t_s"], curve["bytes"]):
                    events.append({"name": "GPU bytes in use", "ph": "C", "pid": pid, "tid": 0,
                                   "ts": (t0 + float(t)) * 1e6, "args": {"bytes": int(b)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, timelines: Timelines, program: Program | None = None) -> Path:
    """Write the trace JSON (open it at https://ui.perfetto.dev or chrome://tracing)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines, program)))
    return path


# ---- Gantt chart ---------------------------------------------------------------------------------------------
def _compute_idle(df: pd.DataFrame, t0: float, t1: float) -> list[tuple[float, float]]:
    """(start, width) of the stretches of [t0, t1] with no compute task running."""
    gaps, cur = [], t0
    comp = df[df["stream"] == "compute"].sort_values("start_s")
    for s, e in zip(comp["start_s"], comp["end_s"]):
        if s > cur:
            gaps.append((cur, s - cur))
        cur = max(cur, e)
    if t1 > cur:
        gaps.append((cur, t1 - cur))
    return gaps


def _draw(ax, rows: list[tuple[str, pd.DataFrame]], scale: float) -> None:
    """One row per (timeline, stream): bars by kind, shaded compute idle time."""
    n = len(rows) * len(STREAMS)
    ylabels, y = [], n - 1
    kinds_drawn = set()
    for label, df in rows:
        t0, t1 = (df["start_s"].min(), df["end_s"].max()) if len(df) else (0.0, 0.0)
        for stream in STREAMS:
            part = df[df["stream"] == stream]
            ax.axhspan(y - 0.45, y + 0.45, color="#f4f4f4", zorder=0)
            if stream == "compute":
                gaps = [(s * scale, w * scale) for s, w in _compute_idle(df, t0, t1)]
                ax.broken_barh(gaps, (y - 0.45, 0.9), facecolors=IDLE_COLOR, alpha=0.25, zorder=1,
                               label="GPU idle" if "idle" not in kinds_drawn else None)
                kinds_drawn.add("idle")
            for kind, g in part.groupby("kind", sort=True):
                bars = list(zip(g["start_s"] * scale, (g["end_s"] - g["start_s"]) * scale))
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=KIND_COLORS.get(kind, "#333333"),
                               edgecolors="white", linewidth=0.3, zorder=2,
                               label=KIND_NAMES.get(kind, kind) if kind not in kinds_drawn else None)
                kinds_drawn.add(kind)
            ylabels.append((y, f"{label} · {stream}" if len(rows) > 1 else stream))
            y -= 1
    ax.set_yticks([p for p, _ in ylabels], [t for _, t in ylabels])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5, zorder=0)


def gantt(timelines: Timelines, path: str | Path | None = None, layout: str = "stacked", title: str | None = None,
          width: float = 12.0):
    """Gantt chart of one or several Timelines; returns the matplotlib Figure (saved to `path` when given).

    layout="stacked": all timelines on one time axis, one block of stream rows each (compare a predicted and a
    measured step task by task); layout="side": one panel per timeline, side by side, on a shared time axis.
    """

    rows = labelled(timelines)
    if layout not in ("stacked", "side"):
        raise ValueError(f"layout must be 'stacked' or 'side', got {layout!r}")
    scale = 1e3  # seconds -> ms
    if layout == "stacked" or len(rows) == 1:
        fig = Figure(figsize=(width, 0.45 * len(STREAMS) * len(rows) + 1.6))
        axes = [fig.add_subplot(1, 1, 1)]
        _draw(axes[0], rows, scale)
    else:
        fig = Figure(figsize=(width, 0.45 * len(STREAMS) + 1.8))
        axes = [fig.add_subplot(1, len(rows), 1)]
        axes += [fig.add_subplot(1, len(rows), i + 1, sharex=axes[0]) for i in range(1, len(rows))]
        for ax, row in zip(axes, rows):
            _draw(ax, [row], scale)
            ax.set_title(row[0], fontsize=9)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8, frameon=False)
    if title and len(axes) == 1:
        axes[0].set_title(title, fontsize=10)
    elif title:
        fig.suptitle(title, fontsize=10)
    height = fig.get_figheight()
    top = 1 - min(0.1, 0.3 / height) if title and len(axes) > 1 else 1
    fig.tight_layout(rect=(0, min(0.4, 0.5 / height), 1, top))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
