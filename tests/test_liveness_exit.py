"""A rank's liveness thread (parallel/liveness.py Heartbeat) never outlives its process's exit: a daemon thread still
inside a store write when the interpreter finalises aborts the process ("terminate called without an active
exception", SIGABRT), which turned a rank's clean exit into a failed launch (CI stop 29, `megatrain profile
--collectives-only` under torchrun). `stop()` joins the thread, and an atexit hook stops it on every way out."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import torch.distributed as dist

from megatrain.parallel import liveness
from launchenv import child_env, free_port

RUNS = 6  # without the join, each run aborted about 7 times in 10 on the 2-core machine: 6 clean ones by chance ~1e-3

# beats back to back (BEAT_S 0), so that the exit almost surely falls inside a store write; the script returns
# without stopping the heartbeat, as a rank that fails does
CHILD = textwrap.dedent("""
    import datetime, os, time
    import torch.distributed as dist
    from megatrain.parallel import liveness
    liveness.BEAT_S = 0.0
    server = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    beat = liveness.Heartbeat.start(0, 1)
    assert beat is not None
    deadline = time.monotonic() + 20  # a loaded machine may take a while to run the thread's first writes
    while beat.counts()[0] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    print("beats", beat.counts()[0] >= 3)
""")


def test_a_process_that_exits_while_its_heartbeat_writes_exits_cleanly():
    for _ in range(RUNS):
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60,
                           check=False)
        assert r.returncode == 0 and r.stdout.strip() == "beats True", (r.returncode, r.stdout, r.stderr[-2000:])


def test_stop_returns_once_the_thread_has_ended(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(liveness, "BEAT_S", 0.0)
    beat = liveness.Heartbeat.start(3, 4)
    assert beat is not None and beat._thread.is_alive()
    beat.stop()
    assert not beat._thread.is_alive()
    first = int(server.get(f"{liveness.PREFIX}3"))
    time.sleep(0.2)  # a thread still beating back to back would write hundreds of times in this
    assert int(server.get(f"{liveness.PREFIX}3")) == first  # no beat after stop()
