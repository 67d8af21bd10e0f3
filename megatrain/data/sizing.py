"""Does the data fill a run's windows, and if not, which settings would: advice the next run accepts.

A stream of n tokens holds (n - 1) // T windows of T + 1 tokens (data/batches.py: consecutive windows share one
token). Training needs `batch_size` windows (one batch); a held-out split needs one window (evaluation runs a
smaller batch when it has fewer than `batch_size`, Data.eval_batches). The held-out split is either a file of its
own (`eval_path`, or a nanoGPT directory's val.bin) or the last int(n * eval_fraction) tokens of the data, so
`eval_fraction` moves tokens between the two and `seq_len` / `batch_size` change what each side needs.

Every suggestion of `shortfall` is checked here with the same arithmetic open_data uses before it is offered
(issue 23: "set data.eval_fraction to 0" was advised for data whose whole could not fill one batch either, and was
then refused). What this module cannot see, the schedule's rule that `batch_size` splits into micro-batches, comes
in as `batch_multiple`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# eval_fraction suggestions are the nearest fitting value on the coarsest grid that has one (0.01, then 0.001).
_FRACTION_GRIDS = (100, 1000)


def windows_in(tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens that `tokens` tokens hold (consecutive windows share one token)."""
    return (tokens - 1) // seq_len if tokens > 0 else 0


def held_out_tokens(tokens: int, eval_fraction: float) -> int:
    """Tokens of `tokens` held out for eval by `eval_fraction`: the tail of the stream (open_data splits there)."""
    return int(tokens * eval_fraction) if eval_fraction > 0 else 0


@dataclass(frozen=True)
class DataShape:
    """The sizes that decide whether a run's data fills one training batch and one held-out window."""

    tokens: int  # tokens of the training file, before an eval_fraction split
    eval_tokens: int | None  # tokens of a held-out file of its own (eval_path, val.bin); None: the fraction's split
    eval_fraction: float
    seq_len: int
    batch_size: int

    def split(self) -> tuple[int, int | None]:
        """(tokens trained on, tokens held out; None when there is no held-out split)."""
        if self.eval_tokens is not None:
            return self.tokens, self.eval_tokens
        held = held_out_tokens(self.tokens, self.eval_fraction)
        return self.tokens - held, held if self.eval_fraction > 0 else None

    def problems(self) -> list[str]:
        """What does not fill, one clause each; [] when the data fits."""
        train, held = self.split()
        T, out = self.seq_len, []
        if held is not None and windows_in(held, T) == 0:
            where = ("the held-out file" if self.eval_tokens is not None else
                     f"the held-out split (data.eval_fraction={self.eval_fraction:g} of {self.tokens:,})")
            out.append(f"{where} has {held:,} tokens, less than one window of {T + 1}")
        if windows_in(train, T) < self.batch_size:
            out.append(f"{windows_in(train, T)} windows of {T + 1} tokens cannot fill one batch of {self.batch_size}"
                       f" (the {train:,} tokens trained on)")
        return out

    def fits(self) -> bool:
        return not self.problems()


def suggestions(shape: DataShape, batch_multiple: int = 1) -> list[tuple[str, str]]:
    """(`--set` setting, what it costs) of each single data setting that makes `shape` fit, every one checked; a
    suggested batch_size is a multiple of `batch_multiple` (the schedule's micro-batches)."""
    out: list[tuple[str, str]] = []
    train, held = shape.split()
    # seq_len: the split does not depend on it, so the longest window both sides hold is a direct bound.
    seq = (train - 1) // shape.batch_size
    if held is not None:
        seq = min(seq, held - 1)
    if 1 <= seq < shape.seq_len and shape_fits(shape, seq_len=seq):
        out.append((f"data.seq_len={seq}", "the longest that fits"))
    # batch_size: only where the held-out side already fits at this seq_len.
    batch = windows_in(train, shape.seq_len) // batch_multiple * batch_multiple
    if 1 <= batch < shape.batch_size and shape_fits(shape, batch_size=batch):
        out.append((f"data.batch_size={batch}", "the largest that fits"))
    if shape.eval_tokens is None:  # the held-out split is a fraction of the data: move tokens between the sides
        fraction = _nearest_fraction(shape)
        if fraction is not None:
            out.append((f"data.eval_fraction={fraction:g}", "the nearest that fits"))
        if shape.eval_fraction > 0 and shape_fits(shape, eval_fraction=0.0):
            out.append(("data.eval_fraction=0", "no held-out eval"))
    return out


def shape_fits(shape: DataShape, **changes) -> bool:
    """Whether `shape` with `changes` (DataShape fields) fits."""
    return replace(shape, **changes).fits()


def _nearest_fraction(shape: DataShape) -> float | None:
    """The positive eval_fraction nearest the current one (other than it) that fits, on the coarsest grid with one."""
    for grid in _FRACTION_GRIDS:
        fitting = [k / grid for k in range(1, grid) if k / grid != shape.eval_fraction
                   and shape_fits(shape, eval_fraction=k / grid)]
        if fitting:
            return min(fitting, key=lambda f: (abs(f - shape.eval_fraction), f))
    return None


def tokens_needed(shape: DataShape) -> int:
    """The fewest tokens of the training file that fit `shape`'s settings as they are."""
    T, B = shape.seq_len, shape.batch_size
    if shape.eval_tokens is not None or shape.eval_fraction == 0:
        return B * T + 1  # one batch of windows; a held-out file is counted apart
    # Necessary: n * f >= T + 1 (int() rounds down) and n - int(n * f) >= B * T + 1, so n * (1 - f) > B * T - 1.
    # From just below both bounds, count up to the first n that fits (a few steps: int() of a float product).
    f = shape.eval_fraction
    need = max(math.floor((T + 1) / f), math.floor((B * T - 1) / (1 - f)), B * T + T + 2) - 2
    while not shape_fits(shape, tokens=need):
        need += 1
    return need


def shortfall(shape: DataShape, source: str, batch_multiple: int = 1) -> str | None:
    """None when `shape` fits; else one line: what is short in `source`, and every setting that would fit."""
    problems = shape.problems()
    if not problems:
        return None
    fixes = [f"--set {setting} ({why})" for setting, why in suggestions(shape, batch_multiple)]
    if shape.eval_tokens is not None and shape.eval_tokens <= shape.seq_len:
        fixes.append(f"a held-out file of at least {shape.seq_len + 1} tokens")
    if shape.tokens < tokens_needed(shape):
        fixes.append(f"more data (at least {tokens_needed(shape):,} tokens at these settings)")
    return f"{source}: {'; '.join(problems)}; any one of these fits: {' | '.join(fixes)}"
