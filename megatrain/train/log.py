"""A run's log: the same lines on the console and in `train.log` in the run directory, readable in a terminal
and in a pipe (`| tee`, CI logs).

    log = RunLog()                     # or RunLog(print) / RunLog(lines.append): where the console lines go
    log("model debug: ...")            # before the run directory exists: kept, written to train.log on open
    log.open(run_dir)                  # train.log (appended to on resume) gets every line so far, then the rest
    bar = log.progress_bar(total=120, initial=0, enabled=True, desc="debug")
    bar.update(1); log.close()

The progress bar is drawn only when stderr is a terminal: in a pipe it would write carriage returns and frames
glued into one long line, so there the step lines (`run.log_every`) are the progress. Log lines go above the bar
on a terminal (`tqdm.write`) and are flushed at once in a pipe, so `tail -f` and CI logs show them as they come.

A console that goes away (`megatrain train ... | head`: the reader of the pipe ended) is no reason to lose the run:
the lines go on into train.log, stderr gets one note, and `when_console_lost` tells the training loop, which stops
at the next step boundary with a checkpoint as on SIGTERM. A train.log that cannot be written (a directory in its
place, a full disk) is one line: refused when the log opens, a warning on the console once the run is going.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from tqdm import tqdm

from megatrain.train.config_values import ConfigError

LOG_FILE = "train.log"


class _NoBar:
    """The progress bar where none is drawn (a pipe, or run.progress=false)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass


def is_terminal(stream=None) -> bool:
    """Whether `stream` (default stderr, where tqdm draws) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream (notebooks, pytest capture)
        return False


class RunLog:
    """Log lines to the console (or `sink`) and to train.log in the run directory (see the module docstring)."""

    def __init__(self, sink: Callable[[str], None] | None = None):
        self._sink = sink
        self._file = None
        self._pending: list[str] = []
        self._bar = None
        self.path: Path | None = None
        self.console_lost = False  # stdout was closed (see the module docstring)
        self._on_console_lost: Callable[[], None] | None = None

    def __call__(self, line: str) -> None:
        if self._file is not None:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as e:  # a full disk mid-run: the console keeps the log; the run decides about its files
                self._file = None
                self._console(f"WARNING: cannot write {self.path} ({e.strerror or e}); the log goes on on the "
                              "console only")
        elif self.path is None:
            self._pending.append(line)
        self._console(line)

    def _console(self, line: str) -> None:
        if self.console_lost:
            return
        try:
            if self._sink is not None:
                self._sink(line)
            elif self._bar is not None:
                tqdm.write(line)  # above the bar, which is redrawn below it
            else:
                print(line, flush=True)
        except BrokenPipeError:
            self._lose_console()

    def _lose_console(self) -> None:
        """stdout was closed: note it once on stderr, send what follows to /dev/null (a later print, or Python's
        flush at exit, would raise again), and tell the loop to stop at the step boundary."""
        self.console_lost = True
        stdout_to_devnull()
        where = f"the log goes on in {self.path}" if self.path else "the log goes on in the run's train.log"
        print(f"megatrain: stdout was closed: stopping at the next step boundary with a checkpoint; {where}",
              file=sys.stderr, flush=True)
        if self._on_console_lost is not None:
            self._on_console_lost()

    def when_console_lost(self, fn: Callable[[], None] | None) -> None:
        """Call `fn` when stdout closes (at once if it already has); None: no longer."""
        self._on_console_lost = fn
        if fn is not None and self.console_lost:
            fn()

    def open(self, run_dir: str | Path) -> Path:
        """Start writing train.log in `run_dir` (appending: a resumed run continues its log), with every line
        logged so far."""
        self.path = Path(run_dir) / LOG_FILE
        try:
            self._file = open(self.path, "a", encoding="utf-8")
            for line in self._pending:
                self._file.write(line + "\n")
            self._file.flush()
        except OSError as e:
            self._file = None
            raise ConfigError(f"cannot write the run's log {self.path} ({e.strerror or e}); it must be a writable "
                              "file: move what is there away, or choose another run.name") from None
        self._pending = []
        return self.path

    def progress_bar(self, total: int, initial: int, enabled: bool, desc: str):
        """A tqdm bar when `enabled`, the console is a terminal and no sink was given; else one that draws
        nothing."""
        if not enabled or self._sink is not None or not is_terminal():
            return _NoBar()

        self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc=desc)
        return self._bar

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.close_bar()
        if self._file is not None:
            self._file.close()
            self._file = None


def config_line(cfg, run_dir: str | Path) -> str:
    """The first line of a run: what it trains, in a few words, and where every key of the config is written."""
    m, d, s, o, r = cfg.model, cfg.data, cfg.schedule, cfg.optimizer, cfg.run
    data = d.path or "the bundled corpus"
    accum = f" x {r.grad_accum} accumulated" if r.grad_accum > 1 else ""
    return (f"config: model {m.name}, data {data}, schedule {s.name}, batch {d.batch_size}{accum} x seq "
            f"{d.seq_len}, {r.steps} steps, lr {o.lr:g} (every key: {Path(run_dir) / 'config.toml'})")


def compile_note(knobs, backend: str) -> str | None:
    """The line before a step that compiles (torch.compile of the decoder layer), which is otherwise silent."""
    if not getattr(knobs, "compile_layers", False):
        return None
    took = "about a minute on the CPU backend" if backend == "cpu" else "tens of seconds"
    return (f"the first step compiles the decoder layer (schedule.compile_layers=true): {took} with no output; the "
            "steps after it run compiled")


def stdout_to_devnull() -> None:
    """Point this process's stdout at /dev/null: after the reader of a pipe went away (`megatrain ... | head`),
    a later print, or Python's flush at exit, would raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a replaced sys.stdout without a file descriptor
        pass
