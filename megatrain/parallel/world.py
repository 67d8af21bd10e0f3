"""The ranks of a data-parallel run: process groups from torchrun's environment, per-rank CPU cores, and the
host-side exchanges (Program hash, loss, gathered tiles) that run between steps.

`World.from_env()` reads WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE and, with several nodes (`torchrun
--nnodes N`), GROUP_RANK / GROUP_WORLD_SIZE (torchrun sets them all; `LaunchShape`), and initialises the default
process group: NCCL on CUDA (device collectives, issued only by the runtime's `comm` stream thread), gloo on
the CPU backend. A second gloo group carries host objects, so exchanges of the main thread never share a
communicator with the comm thread.
"""
from __future__ import annotations

import datetime
import gc
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatrain.exec.backend import ExecError
from megatrain.ir.placement import Parallelism
from megatrain.parallel.liveness import Heartbeat, PeerLost


@dataclass
class World:
    """This process's place among the data-parallel ranks."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int | None = None  # ranks per node (torchrun's LOCAL_WORLD_SIZE); None: all `size` on one node
    device_group: object = None  # collectives on device tensors (nccl on CUDA, gloo on the CPU backend)
    host_group: object = None  # gloo: host objects between steps
    cores: tuple[int, ...] = ()  # the CPU cores this rank is bound to (empty: not bound)
    watch: object = None  # the liveness watch of the ranks (Heartbeat), which names a peer that died

    def __post_init__(self) -> None:
        if self.local_size is None:
            self.local_size = self.size

    @property
    def node(self) -> int:
        """This rank's node (torchrun's GROUP_RANK): ranks node*local_size .. +local_size-1 are on it."""
        return self.node_of(self.rank)

    @property
    def nodes(self) -> int:
        """Nodes of the launch (torchrun --nnodes), each with local_size ranks."""
        return self.size // self.local_size

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def parallelism(self) -> Parallelism:
        """The run's shape as the resolver, the planner and the simulator take it: `size` ranks over `nodes` hosts."""
        return Parallelism(self.size, self.nodes)

    def node_of(self, rank: int) -> int:
        """The node of `rank` (torchrun numbers ranks node by node)."""
        return rank // self.local_size

    def describe_ranks(self, ranks) -> str:
        """"rank 3 (node 1)" / "ranks 2,3 (node 1)": ranks named with their nodes, for error lines."""
        ranks = sorted(ranks)
        nodes = sorted({self.node_of(r) for r in ranks})
        where = f" (node{'s' if len(nodes) > 1 else ''} {','.join(map(str, nodes))})" if self.nodes > 1 else ""
        return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}{where}"

    @classmethod
    def from_env(cls, backend: str, timeout_s: float = 300.0) -> World:
        """The world torchrun describes (one rank when WORLD_SIZE is unset or 1); `backend` is "cuda" or "cpu".
        Initialises the process groups with `timeout_s`, so a peer that never arrives fails the run.

        Every way of not joining is a LaunchError with one line saying what to do, raised before anything is
        allocated: torchrun's variables missing or malformed (a stale WORLD_SIZE), more ranks than cores, peers that
        do not arrive within the rendezvous wait (`rendezvous_s`: the lesser of `timeout_s` and RENDEZVOUS_S)."""
        shape = launch_shape()
        if shape is None:
            return cls()
        size, rank, local_rank, local_size = shape[:4]  # its node and nodes follow from these (World.node)
        if hasattr(os, "sched_getaffinity"):  # every rank sees the same cores: all refuse, none waits for the others
            rank_cores(local_rank, local_size, sorted(os.sched_getaffinity(0)))
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            store = rendezvous(rank, size, min(timeout_s, RENDEZVOUS_S))
            if backend == "cuda":
                torch.cuda.set_device(local_rank)
                dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout,
                                        device_id=torch.device("cuda", local_rank))
            else:
                dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
            host = dist.new_group(backend="gloo", timeout=timeout)
            store.set_timeout(timeout)  # from here on the store serves the run's own waits (NCCL's lazy set-up)
        else:
            host = dist.new_group(backend="gloo", timeout=timeout)
            store = None
        cores = tuple(pin_cores(local_rank, local_size)) if bind_cores_enabled() else ()
        world = cls(rank, size, local_rank, local_size, dist.group.WORLD, host, cores)
        world.watch = Heartbeat.start(rank, size) if store is not None else None
        return world

    def close(self) -> None:
        """Leave the world at the end of a run: wait for every rank (within the groups' timeout), then tear the
        process groups down. A process that exits with its groups alive can die in their threads' destructors
        ("terminate called without an active exception") while a peer still talks to it."""
        if not self.distributed or not dist.is_initialized():
            return
        # a peer that died after the last step is named in one line (guard)
        self.guard("leaving the run", dist.barrier, group=self.host_group)
        self.leave()

    def leave(self) -> None:
        """Stop the liveness watch and tear the process groups down, without waiting for the peers: after `close`'s
        barrier, or straight away after a failure."""
        if self.watch is not None:
            self.watch.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        # What the run left in reference cycles (a trainer's runtime, its buffers) is freed now, while torch is
        # whole, not by the interpreter's last collection at exit: freed there, it aborted rank 1 ("terminate called
        # without an active exception", exit -6) in 3 of 80 runs of tests/test_dist_cpu.py's NaN case, and in none
        # of 160 with this collection
        gc.collect()

    def peer_error(self, doing: str, cause: BaseException) -> ExecError:
        """The one-line error of a failed exchange or collective: PeerLost when the liveness watch names the ranks
        (and nodes) that stopped answering (a process or node that died), or cannot be read because the launch's
        store does not answer either (node 0, its host, is gone); else an ExecError with the collective's own first
        line."""
        first = _first_line(cause).split(" This is typically")[0].rstrip(".")  # gloo's advice to read the peer's log
        if self.watch is not None:
            self.watch.stopping()  # alive, stopping on its own: the peers must not name this rank
        gone, note = self.watch.silent_ranks() if self.watch is not None else ([], "")
        here = f" on node {self.node}" if self.nodes > 1 else ""
        resume = "resume from the last checkpoint (run.resume=latest) once every node is up"
        if gone:
            return PeerLost(f"{self.describe_ranks(gone)} of {self.size} stopped answering while rank {self.rank}"
                            f"{here} was {doing} (process or node died: {first}); this rank stops too: {resume}")
        if note:  # no rank can be named, but the run cannot go on without the store's host either
            return PeerLost(f"rank {self.rank}{here} failed while {doing}: {first}{note}; this rank stops too: "
                            f"{resume}")
        return ExecError(f"rank {self.rank} failed while {doing}: {first}")

    # ---- host exchanges (main thread, between steps) --------------------------------------------------------------
    def check_same(self, what: str, text: str) -> None:
        """Refuse to go on unless every rank has the same `text` (a Program's JSON): ranks that lowered different
        Programs would issue different collectives and hang."""
        if not self.distributed:
            return
        digest = hashlib.sha256(text.encode()).hexdigest()
        digests: list[str] = [""] * self.size
        self.guard(f"comparing the {what}", dist.all_gather_object, digests, digest, group=self.host_group)
        if len(set(digests)) > 1:
            groups = {d: [r for r, x in enumerate(digests) if x == d] for d in digests}
            raise ExecError(f"the ranks built different {what}s (ranks by hash: "
                            f"{'; '.join(f'{d[:12]}: {r}' for d, r in groups.items())}); every rank must run the "
                            "same config, model and batch shape")

    def gather(self, value) -> list:
        """Every rank's `value` (any picklable object), in rank order, on every rank (the host group, within its
        timeout)."""
        if not self.distributed:
            return [value]
        out: list = [None] * self.size
        self.guard("exchanging host objects", dist.all_gather_object, out, value, group=self.host_group)
        return out

    def sum(self, value: float) -> float:
        """Sum of a host number over the ranks (the loss of the global batch)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self.guard("summing the loss", dist.all_reduce, t, group=self.host_group)
        return float(t)

    def gather_slices(self, piece: torch.Tensor) -> torch.Tensor:
        """Every rank's equal-length 1-D `piece`, concatenated in rank order (on every rank)."""
        if not self.distributed:
            return piece
        out = [torch.empty_like(piece) for _ in range(self.size)]
        self.guard("gathering slices", dist.all_gather, out, piece.contiguous(), group=self.host_group)
        return torch.cat(out)

    def share(self, value):
        """Rank 0's `value` (any picklable object) on every rank, e.g. the run directory rank 0 chose."""
        if not self.distributed:
            return value
        box = [value]
        self.guard("receiving rank 0's value", dist.broadcast_object_list, box, src=0, group=self.host_group)
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
        self.guard("agreeing on a decision", dist.all_reduce, t, group=self.host_group)
        return tuple(bool(x > 0) for x in t.tolist())

    def guard(self, doing: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`: a collective (a host exchange, or a device collective and its wait); a peer that died
        or timed out is `peer_error`'s one line (`doing`: what this rank was doing), not the backend's."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout (DistError is a RuntimeError)
            raise self.peer_error(doing, e) from None


class LaunchError(ExecError):
    """This process cannot join the ranks torchrun's environment describes: one line saying why and what to do.
    Raised before anything is allocated; `megatrain train` reports it as a configuration mistake."""


RENDEZVOUS_S = 60.0  # the longest wait for the other ranks to arrive: torchrun starts them together
TORCHRUN_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets besides WORLD_SIZE


def launch_env() -> tuple[int, int, int, int] | None:
    """(world size, rank, local rank, local world size) from torchrun's variables; None for one process (WORLD_SIZE
    unset or 1). LaunchError when WORLD_SIZE asks for ranks that the rest of the environment does not describe:
    a WORLD_SIZE left over in a shell, or a launcher other than torchrun."""
    raw = os.environ.get("WORLD_SIZE", "").strip()
    if raw in ("", "1"):
        return None
    fix = ("unset WORLD_SIZE to train in one process, or start every rank with `torchrun --standalone "
           "--nproc_per_node=N -m megatrain ...`")
    if not raw.isdigit() or int(raw) < 1:
        raise LaunchError(f"WORLD_SIZE={raw!r} in the environment is not a number of ranks: {fix}")
    size = int(raw)
    missing = [v for v in TORCHRUN_VARS if not os.environ.get(v, "").strip()]
    if missing:
        raise LaunchError(f"WORLD_SIZE={size} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                          f" not: this process was not started by torchrun (a stale WORLD_SIZE?): {fix}")
    values = {}
    for var, default in (("RANK", None), ("LOCAL_RANK", "RANK"), ("LOCAL_WORLD_SIZE", "WORLD_SIZE"),
                         ("MASTER_PORT", None)):
        text = os.environ.get(var, os.environ.get(default or var, "")).strip()
        if not text.isdigit():
            raise LaunchError(f"{var}={text!r} in the environment is not a non-negative integer: {fix}")
        values[var] = int(text)
    rank, local_rank, local_size = values["RANK"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]
    if local_size < 1:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_size} in the environment is not a number of ranks: {fix}")
    if rank >= size or local_rank >= local_size:
        raise LaunchError(f"RANK={rank} / LOCAL_RANK={local_rank} is not a rank of WORLD_SIZE={size} "
                          f"(LOCAL_WORLD_SIZE={local_size}): {fix}")
    return size, rank, local_rank, local_size


def launch_shape() -> tuple[int, int, int, int, int, int] | None:
    """(world size, rank, local rank, local world size, node, nodes) of a torchrun launch (`launch_env` plus the
    node: GROUP_RANK and GROUP_WORLD_SIZE, which torchrun sets with --nnodes); None for one process. torchrun
    numbers the ranks node by node, so node g holds ranks g*L .. g*L+L-1 for L = LOCAL_WORLD_SIZE. LaunchError when
    the nodes do not all run the same number of ranks (the sharded store and the planner assume it)."""
    env = launch_env()
    if env is None:
        return None
    size, rank, local_rank, local_size = env
    if size % local_size:
        raise LaunchError(f"WORLD_SIZE={size} is not a multiple of LOCAL_WORLD_SIZE={local_size}: every node must "
                          "run the same number of ranks (give every torchrun agent the same --nproc_per_node)")
    nodes = size // local_size
    node = rank // local_size
    for var, expect in (("GROUP_WORLD_SIZE", nodes), ("GROUP_RANK", node)):
        text = os.environ.get(var, "").strip()
        if text and text != str(expect):
            raise LaunchError(f"{var}={text} but WORLD_SIZE={size}, LOCAL_WORLD_SIZE={local_size} and RANK={rank} "
                              f"make it {expect}: every node must run the same number of ranks (give every torchrun "
                              "agent the same --nproc_per_node)")
    return size, rank, local_rank, local_size, node, nodes


BIND_ENV = "MEGATRAIN_BIND_CORES"  # "0" / "off": leave each rank on every core of the node (no binding)


def bind_cores_enabled() -> bool:
    """Whether each rank binds itself to its share of the node's cores (the default, as DeepSpeed's
    --bind_cores_to_rank); MEGATRAIN_BIND_CORES=0 turns it off (e.g. when the launcher already binds, numactl or
    srun --cpu-bind)."""
    return os.environ.get(BIND_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def rendezvous(rank: int, size: int, wait_s: float):
    """The store every rank of the world meets at (torchrun's MASTER_ADDR:MASTER_PORT), waiting at most `wait_s`
    for the others: a rank started alone (a stale WORLD_SIZE with the rest of torchrun's variables) is told so
    instead of waiting the run's whole timeout in silence. Returns the store the process groups are built on."""
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, size, timeout=datetime.timedelta(seconds=wait_s)))
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError / DistNetworkError are RuntimeErrors
        raise LaunchError(f"rank {rank} of WORLD_SIZE={size} waited {wait_s:.0f} s at {where} and the other ranks "
                          f"did not all arrive ({_first_line(e)}): start all {size} with `torchrun --standalone "
                          f"--nproc_per_node={size} ...`, or unset WORLD_SIZE (stale in this shell?) to train in "
                          "one process") from None
    return dist.PrefixStore("default_pg", store)  # as init_process_group keys its own store


def _first_line(e: BaseException) -> str:
    """The first line of `e`'s message, else its type name (an exception raised without a message)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def rank_cores(local_rank: int, local_size: int, cores: list[int]) -> list[int]:
    """This rank's share of `cores`: an even split in order (the first ranks get one more when it is uneven)."""
    if local_size > len(cores):
        raise LaunchError(f"{local_size} ranks on {len(cores)} CPU core(s) this process may use: each rank needs at "
                          f"least one core; start at most {len(cores)} (torchrun --nproc_per_node={len(cores)})")
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
