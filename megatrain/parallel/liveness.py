"""Which ranks are still alive: a heartbeat every rank writes into the launch's store, read when a collective fails.

When a rank's process or node dies, its peers' collectives fail ("Connection closed by peer" from gloo, a timeout
when the node vanished without closing its sockets) with a message that names an address, not a rank. Every rank
therefore runs one daemon thread that bumps a counter under its rank in torchrun's store (MASTER_ADDR:MASTER_PORT,
its own client connection, every BEAT_S); on a failure `silent_ranks` reads the counters twice, a few beats apart,
and the ranks whose counter did not move are the ones that died (a rank that saw the failure itself says it is
stopping first, so its peers do not name it when it exits). A peer that hangs but lives keeps beating and is
not named (the runtime's wait timeout names its task instead).
"""
from __future__ import annotations

import atexit
import datetime
import os
import threading
import time

import torch.distributed as dist

from megatrain.exec.backend import ExecError

BEAT_S = 0.5  # between beats; a rank is silent when its counter did not move over SILENT_BEATS beats
SILENT_BEATS = 4
STORE_WAIT_S = 5.0  # the longest a heartbeat read or write waits for the store
PREFIX = "megatrain/heartbeat/"


class PeerLost(ExecError):
    """A collective failed because one or more ranks stopped answering (their process or node died); the message
    names them and their nodes."""


class Heartbeat:
    """This rank's heartbeat and the view of everyone's (see the module docstring)."""

    def __init__(self, store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size
        self._stop = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._beat, name=f"megatrain-heartbeat-{rank}", daemon=True)

    @classmethod
    def start(cls, rank: int, size: int) -> Heartbeat | None:
        """Start beating into torchrun's store; None when it cannot be reached (the run goes on without names)."""
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=STORE_WAIT_S), wait_for_workers=False)
        except (KeyError, ValueError, RuntimeError):
            return None
        beat = cls(store, rank, size)
        beat._write()
        beat._thread.start()
        atexit.register(beat.stop)  # every way out of the process, an error's included, stops the thread first
        return beat

    def _write(self) -> bool:
        self._count += 1
        try:
            self.store.set(f"{PREFIX}{self.rank}", str(self._count))
            return True
        except RuntimeError:  # the store is gone (its host died): nothing left to tell
            return False

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            if not self._write():
                return

    def stop(self) -> None:
        """Stop beating and wait for the thread to end (at most one store write, STORE_WAIT_S). Joining matters: a
        daemon thread still inside a store call when the interpreter exits aborts the process ("terminate called
        without an active exception", SIGABRT instead of the rank's exit status), since it is unwound at
        finalisation from inside the binding's GIL guard."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STORE_WAIT_S + BEAT_S)
        atexit.unregister(self.stop)

    def stopping(self) -> None:
        """Tell the peers this rank is alive and stopping because a collective failed (it saw a peer die): its
        heartbeat will stop soon, and it must not be named with the dead."""
        try:
            self.store.set(f"{PREFIX}stopping/{self.rank}", "1")
        except RuntimeError:
            pass

    def counts(self) -> dict[int, int | None]:
        """Every rank's last beat count (None: never beat); RuntimeError when the store does not answer."""
        keys = [f"{PREFIX}{r}" for r in range(self.size)]
        out = {}
        for r, key in enumerate(keys):
            out[r] = int(self.store.get(key)) if self.store.check([key]) else None
        return out

    def silent_ranks(self, wait_s: float = SILENT_BEATS * BEAT_S) -> tuple[list[int], str]:
        """(ranks other than this one whose heartbeat stopped, a note): two reads `wait_s` apart. When the store
        itself does not answer, no rank can be named and the note says so (the store's host, node 0's torchrun
        agent or rank 0, is the one gone)."""
        try:
            before = self.counts()
            time.sleep(wait_s)
            after = self.counts()
            stopping = {r for r in range(self.size) if self.store.check([f"{PREFIX}stopping/{r}"])}
        except RuntimeError:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            return [], f" (the launch's store at {where} does not answer either: the node hosting it, node 0, is gone)"
        return [r for r in range(self.size) if r != self.rank and r not in stopping
                and (after[r] is None or after[r] == before[r])], ""
