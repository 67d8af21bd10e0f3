"""What the tests that start ranks as subprocesses share: a free port for the rendezvous, and the environment of a
child with no torchrun variables inherited (a test run under torchrun, or a leaked MASTER_PORT, would otherwise
join the child to another world) and the repository on its PYTHONPATH."""
from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Every variable torchrun sets for its workers (torch.distributed.elastic's agent), the rendezvous included.
TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; released before the child binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**set_vars: str) -> dict:
    """os.environ less TORCHRUN_VARS, with the repository first on PYTHONPATH and `set_vars` set."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return dict(env, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **set_vars)
