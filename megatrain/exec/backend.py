"""The stream/event API the runtime drives, and its two implementations.

The runtime walks a Program with one issuing thread per stream. What "enqueue work on a stream", "record an event"
and "make a stream wait for an event" mean is the backend's business:

    CudaBackend  h2d / compute / d2h are `torch.cuda.Stream`s; work is enqueued asynchronously; a done event is a
                 `torch.cuda.Event(enable_timing=True)`; a stream waits for another's event on the GPU
                 (`Stream.wait_event`), the host waits by polling `Event.query()` with a timeout.
    CpuBackend   every stream is the thread that issues it: "enqueue" runs the work synchronously, so a task is done
                 when it is issued, and events are plain host events. Same Program, same runtime code, so CI
                 exercises ordering, slots, waits and numerics without a GPU.

The "cpu" stream (optimizer updates, clip norm) is a host stream on both backends: its tasks run in its issuing
thread (torch's intra-op thread pool parallelizes each update) and are timed with `time.perf_counter`.
"""
from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod

import torch

from megatrain.ir.streams import DEVICE_STREAMS, HOST_STREAMS
from megatrain.units import GiB


class ExecError(RuntimeError):
    """A step could not run as programmed: a wait timed out, a task failed, a slot holds the wrong unit. The
    message names the task, its stream and what it waited for."""


class HostEvent:
    """A point in host time: set when the host work before it finished. Used for host-stream tasks (both
    backends) and for every task on the CPU backend."""

    __slots__ = ("t", "_flag")

    def __init__(self):
        self.t = 0.0
        self._flag = threading.Event()

    def record(self) -> "HostEvent":
        self.t = time.perf_counter()
        self._flag.set()
        return self

    def wait(self, timeout_s: float) -> bool:
        return self._flag.wait(timeout_s)

    def query(self) -> bool:
        return self._flag.is_set()


class Backend(ABC):
    """Streams, events, device memory and host pinning for the runtime."""

    name: str
    device: torch.device

    @abstractmethod
    def stream(self, name: str):
        """The stream handle for a Program stream name ("h2d", "compute", "d2h"); None for host streams."""

    @abstractmethod
    def use(self, stream) -> contextlib.AbstractContextManager:
        """Context in which torch ops are enqueued on `stream` (in the calling thread)."""

    @abstractmethod
    def record(self, stream):
        """Record and return an event after everything enqueued so far on `stream`."""

    @abstractmethod
    def stream_wait(self, stream, event) -> None:
        """Make `stream` wait (on the device) for `event`, recorded on another device stream."""

    @abstractmethod
    def host_wait(self, event, timeout_s: float) -> bool:
        """Block the calling host thread until `event` completed; False on timeout."""

    @abstractmethod
    def elapsed_s(self, start, end) -> float:
        """Seconds from event `start` to event `end` (both device events of this backend)."""

    @abstractmethod
    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait until all work enqueued on every stream is done; ExecError after `timeout_s` (default
        `self.timeout_s`, which the Runtime sets from its wait timeout)."""

    timeout_s: float = 300.0  # the bound of `synchronize()` without an argument

    def enter_thread(self) -> None:
        """Per-thread setup for an issuing thread (current device)."""

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        """Tell the device allocator that `tensor` is used on `stream` too (it was allocated on another)."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """Uninitialized device memory: (nbytes,) uint8, carved into typed views by the caller."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @property
    def pins_host_memory(self) -> bool:
        return False

    def host_region(self, nbytes: int) -> torch.Tensor:
        """A host allocation of `nbytes` (uint8) starting on a page boundary, so sub-ranges can be pinned."""
        base = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        skip = (-base.data_ptr()) % PAGE
        return base[skip:skip + nbytes]


PAGE = 4096


class CpuBackend(Backend):
    """Threads stand in for streams; enqueued work runs synchronously in the issuing thread."""

    name = "cpu"

    def __init__(self):
        self.device = torch.device("cpu")

    def stream(self, name: str):
        return name

    def use(self, stream):
        return contextlib.nullcontext()

    def record(self, stream):
        return HostEvent().record()

    def stream_wait(self, stream, event) -> None:
        # The producer ran synchronously before it was marked issued, so its event is already set.
        if not event.query():
            raise RuntimeError("CpuBackend: a producer event is not set although the task was issued")

    def host_wait(self, event, timeout_s: float) -> bool:
        return event.wait(timeout_s)

    def elapsed_s(self, start, end) -> float:
        return end.t - start.t

    def synchronize(self, timeout_s: float | None = None) -> None:
        pass  # every stream's work ran synchronously in its issuing thread


class CudaBackend(Backend):
    """CUDA streams and events on one device; host memory pinned with cudaHostRegister (no power-of-two
    rounding of torch's caching host allocator)."""

    name = "cuda"

    def __init__(self, device: int | str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaBackend needs a CUDA device; this torch build or machine has none "
                               "(use CpuBackend, or --device cpu)")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            # One stream per Program stream; torch creates them non-blocking w.r.t. the legacy default stream.
            self._streams = {n: torch.cuda.Stream(self.device) for n in DEVICE_STREAMS}
        self._registered: list[int] = []

    def stream(self, name: str):
        return None if name in HOST_STREAMS else self._streams[name]

    def use(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def keep_alive(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)

    def record(self, stream):
        if stream is None:
            return HostEvent().record()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def stream_wait(self, stream, event) -> None:
        stream.wait_event(event)

    def host_wait(self, event, timeout_s: float) -> bool:
        if isinstance(event, HostEvent):
            return event.wait(timeout_s)
        deadline = time.perf_counter() + timeout_s
        pause = 20e-6
        while not event.query():  # a poll loop rather than event.synchronize(), which cannot time out
            if time.perf_counter() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def synchronize(self, timeout_s: float | None = None) -> None:
        # torch.cuda.synchronize cannot time out: record an event on every stream (and the default one) and poll
        # them with a deadline instead, so a hung kernel or copy ends in an error rather than a hang.
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        streams = dict(self._streams, default=torch.cuda.current_stream(self.device))
        deadline = time.perf_counter() + timeout_s
        for name, stream in streams.items():
            ev = torch.cuda.Event()
            ev.record(stream)
            if not self.host_wait(ev, max(0.0, deadline - time.perf_counter())):
                raise ExecError(f"device synchronize: stream {name} did not finish its work within {timeout_s:.1f} s "
                                "(run.wait_timeout_s, --wait-timeout); a kernel or copy on it is hung")

    @property
    def pins_host_memory(self) -> bool:
        return True

    def pin(self, region: torch.Tensor) -> None:
        """Page-lock a host range (from `host_region`) for asynchronous DMA, with cudaHostRegister."""
        if region.numel() == 0:
            return
        ptr, nbytes = region.data_ptr(), region.numel() * region.element_size()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)  # 1: cudaHostRegisterPortable
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / GiB:.2f} GiB failed (cudaError {int(err)}); the "
                               "limit on locked memory (ulimit -l) or host memory may be too small")
        self._registered.append(ptr)

    def unpin(self, region: torch.Tensor) -> None:
        ptr = region.data_ptr()
        if ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered.remove(ptr)


def get_backend(device: str = "auto") -> Backend:
    """"cpu", "cuda", "cuda:1" or "auto" (CUDA when available)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return CpuBackend()
    if device.startswith("cuda"):
        return CudaBackend(device)
    raise ValueError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto")
