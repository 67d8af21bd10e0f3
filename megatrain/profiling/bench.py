"""Timing primitives of `megatrain profile`: time a body where and how the runtime runs it.

Where: the runtime enqueues every task from a long-lived non-main thread, one per stream, under `torch.no_grad()`
(exec/runtime.py). That matters: on the CPU backend torch's OpenMP parallel regions cost more when entered from such
a thread than from the main thread (a debug-model layer forward took 2.0 ms in a worker thread against 0.75 ms in
the main thread on the 2-core CI machine), so each measurement runs in a `Worker` that stands in for one stream's
issuing thread.

How: like the runtime, a start event is recorded on the stream, the body enqueued, a done event recorded; calls
are issued back to back without synchronizing in between, so on a GPU a call that the host issues faster than the
device runs it is timed by the device (and one the host cannot keep up with shows its launch cost, as in a real
step). On the CPU backend the events are `perf_counter` stamps.
"""
from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from megatrain.exec.backend import Backend, ExecError, HostEvent

WAIT_TIMEOUT_S = 600.0  # bound of every wait of a measurement (`megatrain profile --wait-timeout`)


def result(future: Future, what: str, timeout_s: float | None = None):
    """`future.result()` with a bound: an ExecError naming the measurement when it does not finish in time."""
    timeout_s = WAIT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        raise ExecError(f"profile: {what} did not finish within {timeout_s:.0f} s (--wait-timeout); a copy, kernel "
                        "or update is hung") from None


def elapsed_s(backend: Backend, start, end) -> float:
    """Seconds between two events of `backend.record` (device events, or host events for host streams)."""
    if isinstance(start, HostEvent):
        return end.t - start.t
    return backend.elapsed_s(start, end)


class Worker:
    """A long-lived thread standing in for the runtime's issuing thread of one stream ("h2d", "compute", ...)."""

    def __init__(self, backend: Backend, stream: str):
        self.backend, self.stream_name = backend, stream
        self.stream = backend.stream(stream)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"megatrain-profile-{stream}",
                                        initializer=backend.enter_thread)

    def call(self, fn: Callable, *args):
        """Run fn(*args) in this thread, on this stream, without autograd; returns its result (re-raises)."""
        def body():
            with torch.no_grad(), self.backend.use(self.stream):
                return fn(*args)
        return result(self._pool.submit(body), f"{getattr(fn, '__name__', 'a call')} on stream {self.stream_name}")

    def submit(self, fn: Callable, *args):
        """Like `call`, but returns a Future."""
        def body():
            with torch.no_grad(), self.backend.use(self.stream):
                return fn(*args)
        return self._pool.submit(body)

    def time(self, fn: Callable, reps: int, warmup: int = 1) -> list[float]:
        """Seconds of each of `reps` calls of fn(), issued back to back after `warmup` untimed calls."""
        return self.call(self._time, fn, reps, warmup)

    def time_sequence(self, calls: list[tuple[str, Callable]]) -> list[tuple[str, float]]:
        """(label, seconds) of each of `calls` ((label, fn) pairs), issued back to back in order, as a step issues its
        tasks on one stream: no wait between them, so the device runs them without idling."""
        return self.call(self._time_sequence, calls)

    def _time_sequence(self, calls: list[tuple[str, Callable]]) -> list[tuple[str, float]]:
        be, stream = self.backend, self.stream
        marks = []
        for label, fn in calls:
            start = be.record(stream)
            fn()
            marks.append((label, start, be.record(stream)))
        be.synchronize(WAIT_TIMEOUT_S)
        return [(label, elapsed_s(be, s, e)) for label, s, e in marks]

    def time_for(self, fn: Callable, budget_s: float, min_reps: int = 3, max_reps: int = 50, warmup: int = 1,
                 rounds: int = 3) -> list[float]:
        """Time fn() for about `budget_s` seconds in all, in `rounds` rounds; returns the round with the lowest
        median. The first timed call sets the number of repetitions. On a shared machine another process can slow
        a whole round down many times over (two OpenMP teams spinning on the same cores); the least disturbed
        round is the machine's own speed."""
        first = self.time(fn, 1, warmup)
        reps = int(min(max_reps, max(min_reps, budget_s / rounds / max(first[0], 1e-7))))
        best = None
        for _ in range(rounds):
            times = self.time(fn, reps, 0)
            if best is None or median(times) < median(best):
                best = times
        return best

    def _time(self, fn: Callable, reps: int, warmup: int) -> list[float]:
        for _ in range(warmup):
            fn()
        self.backend.synchronize(WAIT_TIMEOUT_S)
        return [s for _, s in self._time_sequence([("", fn)] * reps)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Background:
    """Runs `fn` in a loop in a worker while a measurement runs in another: `with Background(w, fn): ...`.

    Used for contention: copies while a CPU AdamW update runs, a layer forward while one runs, and so on. The loop
    synchronizes its stream after each call, so a device stream never queues more than one call ahead."""

    def __init__(self, worker: Worker, fn: Callable):
        self.worker, self.fn = worker, fn
        self._stop = threading.Event()
        self._started = threading.Event()
        self.calls = 0

    def _loop(self) -> None:
        be, stream = self.worker.backend, self.worker.stream
        while not self._stop.is_set():
            self.fn()
            ev = be.record(stream)
            if not be.host_wait(ev, WAIT_TIMEOUT_S):
                raise ExecError(f"profile: a background call on stream {self.worker.stream_name} did not finish "
                                f"within {WAIT_TIMEOUT_S:.0f} s (--wait-timeout)")
            self.calls += 1
            self._started.set()

    def __enter__(self) -> Background:
        self._future = self.worker.submit(self._loop)
        deadline = time.perf_counter() + WAIT_TIMEOUT_S
        while not self._started.wait(0.01):
            if self._future.done():
                self._future.result()  # raise the loop's error
            if time.perf_counter() > deadline:
                self._stop.set()
                raise ExecError(f"profile: the background loop on stream {self.worker.stream_name} did not complete "
                                f"a call within {WAIT_TIMEOUT_S:.0f} s (--wait-timeout)")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        result(self._future, f"the background loop on stream {self.worker.stream_name}")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class Progress:
    """Announces the plan (how many measurements, about how long) and reports each one as it finishes."""

    def __init__(self, items: list[tuple[str, float]], log: Callable[[str], None] | None = None):
        self.items = items
        self.log = log or (lambda s: print(s, file=sys.stdout, flush=True))
        self.total_est_s = sum(e for _, e in items)
        self.i = 0
        self.t0 = time.perf_counter()

    def announce(self, what: str) -> None:
        self.log(f"{what}: {len(self.items)} measurements, about {_fmt_s(self.total_est_s)} "
                 "(estimated from a first probe of this machine)")

    def done(self, label: str, result: str) -> None:
        self.i += 1
        elapsed = time.perf_counter() - self.t0
        self.log(f"  [{self.i}/{len(self.items)}] {label}: {result}  ({_fmt_s(elapsed)} elapsed)")


def _fmt_s(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"
