"""The ranks of a data-parallel run: process groups from torchrun's environment, per-rank CPU cores, and the
host-side exchanges (Program hash, loss, gathered tiles) that run between steps.

`World.from_env()` reads WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE (torchrun sets them) and initialises the
default process group: NCCL on CUDA (device collectives, issued only by the runtime's `comm` stream thread), gloo on
the CPU backend. A second gloo group carries host objects, so exchanges of the main thread never share a
communicator with the comm thread.
"""
from __future__ import annotations

import datetime
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.exec.backend import ExecError


@dataclass
class World:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    device_group: object = None  # collectives on device tensors (nccl on CUDA, gloo on the CPU backend)
    host_group: object = None  # gloo: host objects between steps

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @classmethod
    def from_env(cls, backend: str, timeout_s: float = 300.0) -> World:
        """The world torchrun describes (one rank when WORLD_SIZE is unset or 1); `backend` is "cuda" or "cpu".
        Initialises the process groups with `timeout_s`, so a peer that never arrives fails the run."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        if local_size != size:
            raise ExecError(f"WORLD_SIZE={size} but LOCAL_WORLD_SIZE={local_size}: data parallel training runs on "
                            "the GPUs of one host (torchrun --standalone --nproc_per_node=N)")
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            if backend == "cuda":
                torch.cuda.set_device(local_rank)
                dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
            else:
                dist.init_process_group("gloo", timeout=timeout)
        host = dist.new_group(backend="gloo", timeout=timeout)
        pin_cores(local_rank, local_size)
        return cls(rank, size, local_rank, local_size, dist.group.WORLD, host)

    def close(self) -> None:
        """Leave the world at the end of a run: wait for every rank (within the groups' timeout), then tear the
        process groups down. A process that exits with its groups alive can die in their threads' destructors
        ("terminate called without an active exception") while a peer still talks to it."""
        if not self.distributed or not dist.is_initialized():
            return
        dist.barrier(group=self.host_group)
        dist.destroy_process_group()

    # ---- host exchanges (main thread, between steps) --------------------------------------------------------------
    def check_same(self, what: str, text: str) -> None:
        """Refuse to go on unless every rank has the same `text` (a Program's JSON): ranks that lowered different
        Programs would issue different collectives and hang."""
        if not self.distributed:
            return
        digest = hashlib.sha256(text.encode()).hexdigest()
        digests: list[str] = [""] * self.size
        dist.all_gather_object(digests, digest, group=self.host_group)
        if len(set(digests)) > 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in digests}
            raise ExecError(f"the ranks built different {what}s (ranks by hash: "
                            f"{'; '.join(f'{d[:12]}: {r}' for d, r in groups.items())}); every rank must run the "
                            "same config, model and batch shape")

    def sum(self, value: float) -> float:
        """Sum of a host number over the ranks (the loss of the global batch)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return float(t)

    def gather_slices(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-length 1-D `piece`, concatenated in rank order (on every rank)."""
        if not self.distributed:
            return piece
        out = [torch.empty_like(piece) for _ in range(self.size)]
        dist.all_gather(out, piece.contiguous(), group=self.host_group)
        return torch.cat(out)

    def share(self, value):
        """Rank 0's `value` (any picklable object) on every rank, e.g. the run directory rank 0 chose."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on some rank."""
        return self.any_each(flag)[0]

    def any_each(self, *flags: bool) -> tuple[bool, ...]:
        """For each flag, whether it is set on some rank: one exchange, so every rank takes the same decisions
        (e.g. stop after this step) even when only one of them saw the reason."""
        if not self.distributed:
            return tuple(bool(f) for f in flags)
        t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64)  # (n_flags,)
        dist.all_reduce(t, group=self.host_group)
        return tuple(bool(x > 0) for x in t.tolist())


def rank_cores(local_rank: int, local_size: int, cores: list[int]) -> list[int]:
    """This rank's share of `cores`: an even split in order (the first ranks get one more when it is uneven)."""
    if local_size > len(cores):
        raise ExecError(f"{local_size} ranks on {len(cores)} cores: each rank needs at least one core")
    per, extra = divmod(len(cores), local_size)
    lo = local_rank * per + min(local_rank, extra)
    return cores[lo:lo + per + (1 if local_rank < extra else 0)]


def pin_cores(local_rank: int, local_size: int) -> list[int]:
    """Pin this process to its share of the cores it may run on, before any thread pool starts; the update
    threads (exec: set_update_threads) then size themselves from the affinity set, per rank."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    mine = rank_cores(local_rank, local_size, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, mine)
    return mine
