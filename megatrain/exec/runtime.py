"""The runtime: interprets a Program, one issuing thread per stream, on a `Backend`.

Each thread walks its stream's queue in Program order. For each task it

1. waits, with a timeout, until every task in `waits` has been ISSUED (its work enqueued and its done event
   recorded);
2. makes the work wait for those producers: a device stream waits on the producer's device event
   (`Stream.wait_event`, no host blocking); a host stream ("cpu") blocks on it (polling with a timeout); a producer
   on a host stream is complete once issued, because host work runs synchronously;
3. records a start event, enqueues the task's work (`work(task)`), records the done event, marks it issued.

On the CPU backend "enqueue" is "run", so issued means done and the same code is a plain threaded interpreter.
The stream threads live as long as the Runtime and are woken once per step: a new thread pays for its own cuBLAS
handle and OpenMP pool on its first task (+43 ms on the first forward of every step on the H200, measured by
`megatrain profile`).
Every wait has a timeout; a timeout or a failing task aborts all streams and raises `ExecError` naming the task,
its stream, what it waited for and what every stream was doing. The calling thread supervises the streams: a task
body that runs longer than the timeout (a hung copy, a deadlocked kernel launch, an injected `sleep`) aborts the
step too, so `run()` returns or raises within about the timeout plus a short grace, never hangs. A thread cannot be
killed, so a stream still stuck in a task body after the grace marks the Runtime unusable: the next `run()` raises
unless that task has returned by then. The start/done events give the measured Timeline,
with the simulator's columns (`megatrain.analysis.timeline`).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import pandas as pd
import torch

from megatrain.analysis.timeline import make_timeline
from megatrain.ir.program import STREAMS, Program, ProgramTask
from megatrain.exec.backend import Backend, ExecError, HostEvent

POLL_S = 0.02  # how often a waiting thread checks for an abort
ABORT_GRACE_S = 5.0  # after an abort, how long the other streams get to notice it and stop (capped by the timeout)


class Runtime:
    """Runs one step of `program` per `run()` call; `work(task)` enqueues a task's body on the current stream."""

    def __init__(self, program: Program, backend: Backend, work: Callable[[ProgramTask], None],
                 timeout_s: float = 300.0):
        self.program, self.backend, self.work, self.timeout_s = program, backend, work, timeout_s
        backend.timeout_s = timeout_s  # bounds the backend's own synchronize() calls (work.py's too)
        for t in program.tasks.values():
            for w in t.waits:
                if w not in program.tasks:
                    raise ExecError(f"task {t.id} waits for {w}, which is not a task of the Program")
                if program.tasks[w].stream == t.stream:
                    raise ExecError(f"task {t.id} waits for {w} on its own stream {t.stream}; "
                                    "same-stream order is the queue order")

        self._workers: dict[str, _StreamWorker] = {}
        self._finalizer: weakref.finalize | None = None

    def run(self, step: int = 0) -> pd.DataFrame:
        """Execute every task of the Program once; returns the measured Timeline of the step."""
        p, be = self.program, self.backend
        self._check_not_stuck()
        self._issued = {t: threading.Event() for t in p.tasks}
        self._start: dict[str, object] = {}
        self._done: dict[str, object] = {}
        self._abort = threading.Event()
        self._errors: list[BaseException] = []
        self._status = {s: "idle" for s in STREAMS}
        self._running: dict[str, tuple[str, float] | None] = {s: None for s in STREAMS}

        be.synchronize(self.timeout_s)
        ref_stream = be.stream("compute")
        t0 = be.record(ref_stream)  # the step's time origin on the device
        be.host_wait(t0, self.timeout_s)
        host_t0 = time.perf_counter() if not isinstance(t0, HostEvent) else t0.t

        active = [s for s in STREAMS if p.streams.get(s)]
        for s in active:
            if s not in self._workers or not self._workers[s].thread.is_alive():
                # The worker holds the Runtime weakly: a dropped trainer frees its store (tens of GB) and the
                # finalizer below stops the threads.
                self._workers[s] = _StreamWorker(s, weakref.WeakMethod(self._walk))
                if self._finalizer is None:
                    self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
            self._workers[s].start_step()
        try:
            self._supervise(active)
        except BaseException:  # KeyboardInterrupt: stop the streams before leaving
            self._abort.set()
            self._await_streams(active, time.perf_counter() + self._grace_s())
            raise
        if self._errors:
            raise self._errors[0]
        be.synchronize(self.timeout_s)

        def at(ev) -> float:
            return ev.t - host_t0 if isinstance(ev, HostEvent) else be.elapsed_s(t0, ev)

        rows = []
        for tid, t in p.tasks.items():
            rows.append(dict(task=tid, kind=t.kind, layer=t.unit, micro=t.micro, stream=t.stream,
                             start_s=at(self._start[tid]), end_s=at(self._done[tid]), bytes=t.bytes,
                             flops=t.flops, step=step))
        return make_timeline(rows, "measured")

    def close(self) -> None:
        """Stop the stream threads (a new `run` would start them again)."""
        _stop_workers(self._workers)

    # ---- supervision (the calling thread) -------------------------------------------------------------------------
    def _grace_s(self) -> float:
        return min(self.timeout_s, ABORT_GRACE_S)

    def _supervise(self, active: list[str]) -> None:
        """Wait for every stream's walk; abort the step when a task body outlives the timeout. After an abort the
        streams get a short grace to stop, then this returns with the error recorded (never blocks for good)."""
        grace_end = None
        while True:
            pending = [s for s in active if not self._workers[s].finished]
            if not pending:
                return
            now = time.perf_counter()
            if self._abort.is_set():
                grace_end = grace_end or now + self._grace_s()
                if now > grace_end:
                    self._note_stuck(pending)
                    return
            else:
                self._check_hung(now)
            self._workers[pending[0]].wait_finished(POLL_S)

    def _check_hung(self, now: float) -> None:
        for s, running in list(self._running.items()):
            if running is not None and now - running[1] > self.timeout_s:
                self._fail(ExecError(f"task {running[0]} on stream {s} has been running for {now - running[1]:.1f} s,"
                                     f" longer than the wait timeout of {self.timeout_s:.1f} s (run.wait_timeout_s, "
                                     f"--wait-timeout). Streams: {self._doing()}"))
                return

    def _await_streams(self, active: list[str], deadline: float) -> None:
        for s in active:
            while not self._workers[s].wait_finished(POLL_S) and time.perf_counter() < deadline:
                pass
        self._note_stuck([s for s in active if not self._workers[s].finished])

    def _note_stuck(self, streams: list[str]) -> None:
        if not streams:
            return
        self._stuck = {s: self._workers[s] for s in streams}
        stuck = ", ".join(f"{s} ({self._status.get(s)})" for s in streams)
        if self._errors:
            first = self._errors[0]
            self._errors[0] = type(first)(f"{first} [still stuck after the abort: {stuck}; this Runtime cannot run "
                                          "another step until they return]")
            self._errors[0].__cause__ = first.__cause__

    def _check_not_stuck(self) -> None:
        stuck = getattr(self, "_stuck", {})
        still = [s for s, w in stuck.items() if not w.finished]
        if still:
            raise ExecError(f"stream(s) {', '.join(still)} of an aborted step are still inside a task body "
                            f"({'; '.join(str(self._status.get(s)) for s in still)}); this Runtime cannot run "
                            "another step (restart the process, or resume from the last checkpoint)")
        self._stuck = {}

    def _doing(self) -> str:
        return "; ".join(f"{s}: {st}" for s, st in self._status.items() if self.program.streams.get(s))

    # ---- one stream ----------------------------------------------------------------------------------------------
    def _walk(self, name: str) -> None:
        be, p = self.backend, self.program
        stream = be.stream(name)
        current = None
        try:
            be.enter_thread()
            with torch.no_grad():  # grad mode is per thread; layer backward enables it locally
                for tid in p.streams[name]:
                    current = p.tasks[tid]
                    if not self._await_inputs(current, stream):
                        return  # aborted by another stream's failure
                    self._status[name] = f"running {tid}"
                    self._running[name] = (tid, time.perf_counter())  # watched by `_check_hung`
                    with be.use(stream):
                        start = be.record(stream)
                        self.work(current)
                        done = be.record(stream)
                    self._running[name] = None
                    self._start[tid], self._done[tid] = start, done
                    self._issued[tid].set()
            self._status[name] = "finished"
        except ExecError as e:
            self._fail(e)
        except Exception as e:  # a task body failed: say which one, keep the cause
            err = ExecError(f"task {current.id if current else '?'} on stream {name} failed: "
                            f"{type(e).__name__}: {e}")
            err.__cause__ = e
            self._fail(err)

    def _fail(self, err: BaseException) -> None:
        self._errors.append(err)
        self._abort.set()

    def _await_inputs(self, task: ProgramTask, stream) -> bool:
        """Wait for every producer of `task`; False when the step is being aborted."""
        be = self.backend
        for w in task.waits:
            self._status[task.stream] = f"waiting for {w} before {task.id}"
            if not self._await_issued(task, w):
                return False
            ev = self._done[w]
            if isinstance(ev, HostEvent) and ev.query():
                continue  # host work is complete once it is issued
            if stream is None:  # a host task needs the device producer finished
                deadline = time.perf_counter() + self.timeout_s
                while not be.host_wait(ev, POLL_S):
                    if self._abort.is_set():
                        return False
                    if time.perf_counter() > deadline:
                        raise ExecError(f"task {task.id} on stream {task.stream} waited {self.timeout_s:.1f} s for "
                                        f"{w} (stream {self.program.tasks[w].stream}) to finish on the device. "
                                        f"Streams: {self._doing()}")
            else:
                be.stream_wait(stream, ev)
        return True

    def _await_issued(self, task: ProgramTask, w: str) -> bool:
        deadline = time.perf_counter() + self.timeout_s
        flag = self._issued[w]
        while not flag.wait(POLL_S):
            if self._abort.is_set():
                return False
            if time.perf_counter() > deadline:
                ws = self.program.tasks[w].stream
                raise ExecError(f"task {task.id} on stream {task.stream} waited {self.timeout_s:.1f} s for {w} "
                                f"(stream {ws}), which was never issued. Streams: {self._doing()}")
        return True


def _stop_workers(workers: dict) -> None:
    for w in workers.values():
        w.stop()
    workers.clear()


class _StreamWorker:
    """A thread that walks one stream's queue once per step, kept across steps."""

    def __init__(self, name: str, walk: weakref.WeakMethod):
        self.name, self._walk = name, walk
        self._go = threading.Event()
        self._finished = threading.Event()
        self._finished.set()  # no step running yet
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"megatrain-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stopping:
                return
            walk = self._walk()
            try:
                if walk is not None:
                    walk(self.name)  # records its own errors in the Runtime
            finally:
                del walk  # no strong reference to the Runtime between steps
                self._finished.set()

    def start_step(self) -> None:
        self._finished.clear()
        self._go.set()

    @property
    def finished(self) -> bool:
        """This step's walk is over (or no step was started)."""
        return self._finished.is_set()

    def wait_finished(self, timeout_s: float) -> bool:
        """Block at most `timeout_s` for this step's walk to end; whether it has."""
        return self._finished.wait(timeout_s)

    def stop(self) -> None:
        self._stopping = True
        self._go.set()
        if self.thread is not threading.current_thread():
            self.thread.join(1.0)
