"""Timeline: one row per executed task, the same columns whether predicted (simulator) or measured (executor).

    task     str    task id ("F3.1")
    kind     str    task kind letter ("F")
    layer    Int64  unit: layer number, -1 embedding, -2 head, <NA> for tasks of no unit
    micro    Int64  micro-batch, <NA> for tasks without one
    stream   str    "h2d" | "compute" | "d2h" | "cpu"
    start_s  float  seconds from the start of the step
    end_s    float
    bytes    int    bytes moved (copies)
    flops    float  floating-point operations (compute)
    source   str    "predicted" | "measured"
    step     int    training step the row belongs to (0 for a simulated step)
"""
from __future__ import annotations

from typing import Iterable, Mapping

import pandas as pd

TIMELINE_COLUMNS = ["task", "kind", "layer", "micro", "stream", "start_s", "end_s", "bytes", "flops", "source", "step"]


def make_timeline(rows: Iterable[Mapping], source: str) -> pd.DataFrame:
    """Build a Timeline DataFrame from dict rows with the columns above (source is filled in)."""
    df = pd.DataFrame([{**r, "source": source} for r in rows], columns=TIMELINE_COLUMNS)
    if "step" in df and df["step"].isna().all():
        df["step"] = 0
    df = df.astype({"task": str, "kind": str, "stream": str, "start_s": float, "end_s": float,
                    "bytes": "int64", "flops": float, "source": str, "step": "int64"})
    df["layer"] = df["layer"].astype("Int64")
    df["micro"] = df["micro"].astype("Int64")
    return df.sort_values(["step", "start_s", "stream", "task"], kind="stable").reset_index(drop=True)
