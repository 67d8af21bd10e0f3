"""Stopping on SIGTERM / SIGINT at the next step boundary.

Schedulers send SIGTERM some time before they kill a job, and Ctrl-C is SIGINT. Inside the training loop both
only set a flag: the step in flight finishes (bounded by run.wait_timeout_s), a checkpoint is written and the run
ends with a message saying how to resume. A second SIGINT while waiting for the boundary interrupts at once
(KeyboardInterrupt), for a user who does not want to wait. Outside the loop (start-up) the default handlers apply,
and `megatrain` turns a KeyboardInterrupt into one line, no traceback.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class StopRequest:
    """Context manager: while active, SIGTERM/SIGINT request a stop instead of killing the process."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.signal_name: str | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, name: str, why: str) -> None:
        """Stop at the next step boundary as if signal `name` (e.g. "SIGPIPE": stdout was closed) had come; `why`
        is logged. The exit status is 128 + that signal's number, as for a real one."""
        if not self.requested:
            self.signal_name = name
            self.log(f"{why}: stopping after the current step with a checkpoint")

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        if self.requested:
            return  # a repeated SIGTERM (a scheduler, or `timeout`, forwarding it): already stopping
        self.signal_name = name
        self.log(f"{name} received: stopping after the current step with a checkpoint (Ctrl-C again to stop at "
                 "once, without one)")

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
