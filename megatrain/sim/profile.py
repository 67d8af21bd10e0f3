"""HardwareProfile: what the simulator knows about a machine, as a dataclass that round-trips through JSON.

A profile holds
    h2d, d2h             copy bandwidth of each direction by transfer size, plus a fixed latency per copy
    duplex_Bps           the summed bandwidth cap when both directions move bytes at once
    matmul_flops_per_s   peak matmul rate by compute dtype, and `efficiency` by unit class (layer/embed/head):
                         the analytic fallback for a compute task is flops / (rate x efficiency)
    compute_tables       measured compute times keyed by (model signature, task kind, unit class, seq, dtype,
                         compiled layer or not), as a function of tokens; a table, where one matches, overrides the
                         analytic fallback
    cpu_adam_params_per_s   CPU AdamW rate by thread count (cpu_threads picks the row)
    gpu_adam_params_per_s   GPU AdamW rate (optimizer tasks on the compute stream)
    clip_redo_updates    speculative clipping, a step that clips: a GPU unit's CLIP_REDO (undo + update again) in
                         GPU AdamW updates of the unit (`megatrain profile` measures it on device tiles; default 2
                         for profiles without it; live calibration fits it)
    host_memory_Bps      the host DRAM bandwidth that every host-side flow draws on at once: CPU updates and
                         every host<->GPU copy (sim/hostmem.py shares it max-min fairly); a profile without it
                         derives it from the legacy contention fields below (see `derive_host_memory_Bps`)
    cpu_update_bytes_per_param  host bytes a CPU AdamW update moves per parameter (fused fp32 AdamW: ~28 = read
                         master, grad, m, v, write master, m, v) with no bf16 conversion pass
    cpu_convert_bytes_per_param  host bytes a bf16 <-> fp32 conversion pass adds to a CPU update per parameter
                         (read 4 + write 2 = 6 by count; `megatrain profile` fits it from the runtime's update at
                         both weight wires, since the refresh pass is what copies slow down most)
    copy_host_bytes_per_byte  host bytes drawn per byte copied (1 for DMA; 2 on the CPU backend's memcpy)
    copy_beside_update   a copy's rate while a CPU update runs, as a fraction of its rate alone: "h2d" / "d2h"
                         beside the update, "h2d_both" / "d2h_both" beside it and the other direction
                         (`megatrain profile` measures them at the runtime's operating point; empty: not slowed,
                         as profiles before issue 24 were simulated); sim/hostmem.py applies them
    compute_beside_copy  how many times longer a compute task takes while a copy runs, by kind ("F", "R", "B"): the
                         copies' DMA shares the device memory with the kernels (measured in the steps of 7 recorded
                         shape x machine runs: a layer F 1.05x, B 1.04-1.11x with copies over most of the task;
                         `megatrain profile` measures it; empty: not slowed, as profiles before it were simulated);
                         sim/hostmem.py applies it
    compute_beside_collective  how many times longer a compute task (F, R, B) takes while a collective runs on the
                         comm stream, by the collective ("G", "Z"): NCCL's kernels take SMs and device memory
                         bandwidth from the layer beside them (on two H200s a forward with a collective over part of
                         it took 7.74 ms, one without 7.55; docs/multigpu.md); `megatrain profile` under torchrun
                         measures it (a layer-sized matmul alone and beside each collective); empty: not slowed, as
                         profiles before it were simulated. With a copy in flight too, the two factors multiply
    dma_factor_cpu_optimizer, cpu_optimizer_slowdown  legacy (before host_memory_Bps): copy rates while a CPU
                         update runs, and how many times longer an update takes while 1 / 2 copy directions run;
                         read only to derive host_memory_Bps for profiles that lack it
    cpu_convert_params_per_s  a bf16 <-> fp32 conversion pass over a tile on the host: charged to a CPU update
                         once for the streaming-copy refresh (weight_wire="bf16") and once for the gradients'
                         conversion (grad_wire="bf16")
    task_overhead_s      fixed launch / dispatch cost of every task, by task kind or else by stream
    collectives          data parallel: per collective kind ("G" all-gather, "Z" reduce-scatter, "A" all-reduce) a
                         latency and bus bandwidth by a task's bus bytes (sim/collectives.py; empty: its defaults)
    inter_host_Bps, inter_host_latency_s  several hosts (`simulate --hosts`): the network bandwidth per GPU (one
                         direction, as NCCL achieves it: its NIC, or its share of the host's NICs) and the latency of
                         a collective that crosses hosts. Defaults are ASSUMPTIONS, not measured here: one 400 Gb/s
                         NDR NIC per GPU as in DGX/HGX H100/H200 hosts, 47 GB/s (NCCL's developers expect 46-48 GB/s
                         per NDR NIC, NVIDIA/nccl-tests#290), and 50 us (NCCL ring latency over InfiniBand is tens of
                         us); a profile that keeps the defaults says so in its notes
    nvme_read_Bps, nvme_write_Bps  the NVMe tier of the optimizer state (knob state_tier): sequential read and
                         write bandwidth of the drive(s) a host update reads its state from and writes it back to
                         (defaults: one PCIe 4.0 x4 drive, 6.5 / 5.0 GB/s, an assumption of the shipped profiles)
    machine              the machine `megatrain profile` measured (CPU model, cores, memory, GPU, torch, date;
                         profiling/machine.py): train and simulate say when it is not the one running

Measured profiles (`megatrain profile`) write the same JSON with tables filled in; shipped profiles live in
megatrain/profiles/ and say, field by field under "notes", which numbers are measured and which are assumptions.
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from megatrain.ir.streams import COPY_STREAMS, STREAMS
from megatrain.ir.tasks import COMPUTE_KINDS as IR_COMPUTE_KINDS
from megatrain.ir.tasks import SCHEDULED_COLLECTIVES
from megatrain.ir.tasks import UNIT_CLASSES, TaskKind, unit_class  # noqa: F401  (re-exported)
from megatrain.model.spec import ModelSpec
from megatrain.sim import profile_checks as check
from megatrain.sim.profile_checks import ProfileError  # noqa: F401  (re-exported: the error of this module)

# copy_beside_update's keys, by (copy direction, whether the other direction runs too): a copy beside a CPU update
# ("h2d", "d2h", "h2d_both", "d2h_both")
BESIDE = {(d, both): f"{d}_both" if both else d for both in (False, True) for d in COPY_STREAMS}

FORMAT = "megatrain.profile/1"
# Derived from the vocabularies of ir/ (a profile's task_overhead_s is keyed by stream names and kind letters).
COMPUTE_KINDS = tuple(k.value for k in TaskKind if k in IR_COMPUTE_KINDS)
STREAM_NAMES = STREAMS
TASK_KINDS = tuple(k.value for k in TaskKind)
# Host bytes per parameter of torch's fused CPU AdamW on fp32 tiles: read master, gradient, m, v (16 B) and write
# master, m, v (12 B). Measured ~28 B/param on the H200 hosts (shared/DESIGN.md section 4).
ADAM_BYTES_PER_PARAM = 28.0
# A bf16 <-> fp32 conversion pass: read 4 + write 2 bytes (refresh of the streaming copy) or read 2 + write 4
# (a bf16 gradient into the fp32 scratch).
CONVERT_BYTES_PER_PARAM = 6.0
# Several hosts: ASSUMED network of a DGX/HGX-class host (one 400 Gb/s NDR NIC per GPU, 46-48 GB/s achieved per NIC
# through NCCL according to its developers, NVIDIA/nccl-tests#290) and the latency of a collective over it.
INTER_HOST_BPS = 47e9
INTER_HOST_LATENCY_S = 50e-6
INTER_HOST_NOTE = ("assumption (not measured): one 400 Gb/s NDR NIC per GPU, 47 GB/s each through NCCL "
                   "(NVIDIA/nccl-tests#290: 46-48 GB/s per NIC); a collective across hosts pays 50 us "
                   "(sim/collectives.py)")


def model_signature(spec: ModelSpec) -> str:
    """The shape of a model's units, independent of its name and depth: compute tables are keyed by it.

    Two models that share it have the same per-layer (and embedding / head) compute times.
    """
    return spec.family.signature(spec)


def _interp(xs, ys, x: float) -> float:
    """Piecewise-linear y(x) through sorted points; clamped to the end values outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CopyCurve:
    """One copy direction: a copy of n bytes takes `latency_s + n / rate(n)` when it has the link to itself.

    `rate(n)` interpolates the table linearly in log2(n) and is clamped to its end values. A measured profile
    stores rate = n / (time - latency), so the latency is not counted twice. `inf` bandwidth means free copies.
    """

    sizes_bytes: tuple[int, ...]
    Bps: tuple[float, ...]
    latency_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "sizes_bytes", check.sequence("sizes_bytes", self.sizes_bytes, check.COUNT))
        object.__setattr__(self, "Bps", check.sequence("Bps", self.Bps, check.RATE))
        object.__setattr__(self, "latency_s", check.number("latency_s", self.latency_s, check.TIME))
        if len(self.sizes_bytes) != len(self.Bps):
            raise ProfileError("a copy curve needs as many sizes_bytes as Bps values")
        check.increasing("sizes_bytes", self.sizes_bytes)

    @classmethod
    def constant(cls, Bps: float, latency_s: float = 0.0) -> CopyCurve:
        """The same bandwidth at every size."""
        return cls((1,), (Bps,), latency_s)

    def rate(self, nbytes: int) -> float:
        """Bytes/s of a copy of `nbytes` when it runs alone."""
        if len(self.Bps) == 1 or nbytes <= 0:
            return self.Bps[0]
        return _interp([math.log2(s) for s in self.sizes_bytes], self.Bps, math.log2(nbytes))

    def duration(self, nbytes: int) -> float:
        """Seconds of a copy of `nbytes` alone on the link."""
        return self.latency_s + (nbytes / self.rate(nbytes) if nbytes else 0.0)


@dataclass(frozen=True)
class ComputeTable:
    """Measured seconds of one compute task kind on one unit class, as a function of tokens per task.

    `kind` is the task kind letter: "F" forward (for the head: forward + loss + backward, fused), "R" recompute,
    "B" recompute-once + backward. Between points time is interpolated linearly in tokens; outside them it scales
    in proportion to tokens from the nearest point.
    """

    model: str  # model_signature()
    kind: str
    unit: str  # unit class
    seq: int
    tokens: tuple[int, ...]
    dur_s: tuple[float, ...]
    dtype: str = "bf16"
    compiled: bool = False  # measured with the decoder layer compiled (knob compile_layers)

    def __post_init__(self):
        where = f"compute table ({self.model!r}, {self.kind!r}, {self.unit!r}, seq={self.seq!r})"
        for name in ("model", "kind", "unit", "dtype"):
            check.text(f"{where}: {name}", getattr(self, name))
        object.__setattr__(self, "seq", check.number(f"{where}: seq", self.seq, check.COUNT))
        if not isinstance(self.compiled, bool):
            raise ProfileError(f"{where}: compiled must be true or false, got {self.compiled!r}")
        object.__setattr__(self, "tokens", check.sequence(f"{where}: tokens", self.tokens, check.COUNT))
        object.__setattr__(self, "dur_s", check.sequence(f"{where}: dur_s", self.dur_s, check.TIME))
        if self.kind not in COMPUTE_KINDS:
            raise ProfileError(f"{where}: kind must be one of {COMPUTE_KINDS}")
        if self.unit not in UNIT_CLASSES:
            raise ProfileError(f"{where}: unit must be one of {UNIT_CLASSES}")
        if not self.tokens or len(self.tokens) != len(self.dur_s):
            raise ProfileError(f"{where}: needs as many tokens as dur_s values, at least one")
        check.increasing(f"{where}: tokens", self.tokens)

    @property
    def key(self) -> tuple:
        return (self.model, self.kind, self.unit, self.dtype, self.compiled)

    def at(self, tokens: int) -> float:
        xs, ys = self.tokens, self.dur_s
        if tokens < xs[0]:
            return ys[0] * tokens / xs[0]
        if tokens > xs[-1]:
            return ys[-1] * tokens / xs[-1]
        return _interp(xs, ys, tokens)


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as the simulator sees it (see the module docstring for each field)."""

    name: str
    h2d: CopyCurve
    d2h: CopyCurve
    duplex_Bps: float = math.inf
    matmul_flops_per_s: dict[str, float] = field(default_factory=lambda: {"bf16": 1e12, "fp32": 1e12})
    efficiency: dict[str, float] = field(default_factory=lambda: {"layer": 1.0, "embed": 1.0, "head": 1.0})
    gpu_memory_Bps: float = math.inf
    compute_tables: tuple[ComputeTable, ...] = ()
    cpu_adam_params_per_s: dict[int, float] = field(default_factory=lambda: {1: 1e9})
    cpu_threads: int = 1
    gpu_adam_params_per_s: float = math.inf
    clip_redo_updates: float = 2.0
    clip_norm_params_per_s: float = math.inf
    dma_factor_cpu_optimizer: float = 1.0
    cpu_optimizer_slowdown: dict[int, float] = field(default_factory=dict)
    cpu_convert_params_per_s: float = math.inf
    host_memory_Bps: float | None = None  # None: derived in __post_init__ (derive_host_memory_Bps)
    cpu_update_bytes_per_param: float = ADAM_BYTES_PER_PARAM
    cpu_convert_bytes_per_param: float = CONVERT_BYTES_PER_PARAM
    copy_host_bytes_per_byte: float = 1.0
    copy_beside_update: dict[str, float] = field(default_factory=dict)
    compute_beside_copy: dict[str, float] = field(default_factory=dict)
    compute_beside_collective: dict[str, float] = field(default_factory=dict)
    task_overhead_s: dict[str, float] = field(default_factory=dict)
    nvme_read_Bps: float = 6.5e9  # one PCIe 4.0 x4 NVMe drive, sequential (assumption)
    nvme_write_Bps: float = 5.0e9
    machine: dict = field(default_factory=dict)
    description: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    collectives: dict[str, dict] = field(default_factory=dict)
    inter_host_Bps: float = INTER_HOST_BPS  # per GPU; an assumption (module docstring)
    inter_host_latency_s: float = INTER_HOST_LATENCY_S

    def __post_init__(self):
        self._check_fields()
        if not self.cpu_adam_params_per_s:
            raise ProfileError(f"profile {self.name}: cpu_adam_params_per_s needs positive rates by thread count")
        if (self.inter_host_Bps, self.inter_host_latency_s) == (INTER_HOST_BPS, INTER_HOST_LATENCY_S) \
                and "inter_host_Bps" not in self.notes:  # the defaults are assumptions: say so
            object.__setattr__(self, "notes", {**self.notes, "inter_host_Bps": INTER_HOST_NOTE})
        missing = set(UNIT_CLASSES) - set(self.efficiency)
        if missing:
            raise ProfileError(f"profile {self.name}: efficiency needs a value in (0, 1] for each of {UNIT_CLASSES}")
        if self.host_memory_Bps is None:
            derived, why = derive_host_memory_Bps(self)
            object.__setattr__(self, "host_memory_Bps", derived)
            object.__setattr__(self, "notes", {"host_memory_Bps": why, **self.notes})  # a note given wins
        seen = set()
        for t in self.compute_tables:
            if (t.key, t.seq) in seen:
                raise ProfileError(f"profile {self.name}: two compute tables for {t.key} at seq={t.seq}")
            seen.add((t.key, t.seq))
        index: dict[tuple, list[ComputeTable]] = {}
        for t in self.compute_tables:
            index.setdefault(t.key, []).append(t)
        object.__setattr__(self, "_tables", index)

    # Every numeric field and its bound (sim/profile_checks.py); the mappings and tables are checked in
    # _check_fields. A field missing here would reach the simulator unchecked: test_profile_fields_all_checked.
    _BOUNDS = {
        "duplex_Bps": check.RATE, "gpu_memory_Bps": check.RATE, "gpu_adam_params_per_s": check.RATE,
        "clip_norm_params_per_s": check.RATE, "cpu_convert_params_per_s": check.RATE, "nvme_read_Bps": check.RATE,
        "nvme_write_Bps": check.RATE, "inter_host_Bps": check.RATE, "cpu_update_bytes_per_param": check.SIZE,
        "inter_host_latency_s": check.TIME, "copy_host_bytes_per_byte": check.TIME,
        "cpu_convert_bytes_per_param": check.TIME, "clip_redo_updates": check.SIZE,
        "dma_factor_cpu_optimizer": check.FRACTION, "cpu_threads": check.COUNT,
    }
    # field -> (bound of its values, keys are thread counts, lower limit of its values)
    _MAPPINGS = {
        "matmul_flops_per_s": (check.RATE, False, None), "efficiency": (check.FRACTION, False, None),
        "cpu_adam_params_per_s": (check.RATE, True, None), "cpu_optimizer_slowdown": (check.SIZE, True, 1.0),
        "task_overhead_s": (check.TIME, False, None), "copy_beside_update": (check.FRACTION, False, None),
        "compute_beside_copy": (check.SIZE, False, 1.0), "compute_beside_collective": (check.SIZE, False, 1.0),
    }
    # field -> (the keys it may have, what they are): any other key is refused by name
    _KEYS = {
        "cpu_optimizer_slowdown": ((1, 2), "the number of busy copy directions, to a factor >= 1"),
        "copy_beside_update": (tuple(BESIDE.values()), "fractions of each copy direction's rate alone"),
        # keyed by the compute kinds a copy slows (F, R, B), and by the collective that slows them (G, Z)
        "compute_beside_copy": (COMPUTE_KINDS, "factors >= 1 on a compute task while a copy runs"),
        "compute_beside_collective": (SCHEDULED_COLLECTIVES,
                                      "factors >= 1 on a compute task while that collective runs"),
        "task_overhead_s": (STREAM_NAMES + TASK_KINDS, "stream names or task kinds"),
    }

    def _check_fields(self) -> None:
        """Type and range of every field, each refused by name (ProfileError) before anything reads it."""
        where = f"profile {self.name!r}"
        check.text(f"{where}: name", self.name)
        check.text(f"{where}: description", self.description)
        for name, bound in self._BOUNDS.items():
            object.__setattr__(self, name, check.number(f"{where}: {name}", getattr(self, name), bound))
        if self.host_memory_Bps is not None:
            object.__setattr__(self, "host_memory_Bps",
                               check.number(f"{where}: host_memory_Bps", self.host_memory_Bps, check.RATE))
        for name, (bound, int_keys, at_least) in self._MAPPINGS.items():
            value = check.numbers(f"{where}: {name}", getattr(self, name), bound, int_keys=int_keys, at_least=at_least)
            object.__setattr__(self, name, value)
        for name, (allowed, what) in self._KEYS.items():
            unknown = set(getattr(self, name)) - set(allowed)
            if unknown:
                raise ProfileError(f"{where}: {name} has unknown keys {sorted(unknown, key=str)}; use "
                                   f"{list(allowed)} ({what})")
        for name in ("h2d", "d2h"):
            if not isinstance(getattr(self, name), CopyCurve):
                raise ProfileError(f"{where}: {name} must be a copy curve (sizes_bytes, Bps, latency_s)")
        tables = self.compute_tables
        if isinstance(tables, (str, dict)) or not all(isinstance(t, ComputeTable) for t in tables):
            raise ProfileError(f"{where}: compute_tables must be a list of compute tables")
        object.__setattr__(self, "compute_tables", tuple(tables))
        object.__setattr__(self, "collectives", check.collectives(f"{where}: collectives", self.collectives))
        for name in ("machine", "notes"):
            if not isinstance(getattr(self, name), dict):
                raise ProfileError(f"{where}: {name} must be a JSON object, got {getattr(self, name)!r}")

    # ---- rates -----------------------------------------------------------------------------------------------
    def cpu_adam_rate(self, threads: int | None = None) -> float:
        """CPU AdamW params/s at `threads` (default cpu_threads): linear between measured thread counts,
        proportional to threads below the smallest, flat above the largest (memory-bandwidth bound)."""
        threads = threads or self.cpu_threads
        ts = sorted(self.cpu_adam_params_per_s)
        if threads < ts[0]:
            return self.cpu_adam_params_per_s[ts[0]] * threads / ts[0]
        return _interp(ts, [self.cpu_adam_params_per_s[t] for t in ts], threads)

    def with_cpu_adam_times(self, factor: float) -> HardwareProfile:
        """This profile with its CPU AdamW rate at every thread count times `factor` (a fit, or a slower host)."""
        return replace(self, cpu_adam_params_per_s={t: r * factor for t, r in self.cpu_adam_params_per_s.items()})

    def matmul_rate(self, dtype: str) -> float:
        if dtype not in self.matmul_flops_per_s:
            raise ProfileError(f"profile {self.name} has no matmul rate for compute dtype {dtype!r}; "
                               f"it has {sorted(self.matmul_flops_per_s)}")
        return self.matmul_flops_per_s[dtype]

    def tables_for(self, model: str, kind: str, unit: str, dtype: str, compiled: bool = False) -> list[ComputeTable]:
        """Measured tables that match, any seq."""
        return self._tables.get((model, kind, unit, dtype, compiled), [])

    def cpu_update_bytes(self, params: int, conversion_passes: int = 0) -> float:
        """Host bytes a CPU update of `params` moves: AdamW plus `conversion_passes` bf16 <-> fp32 passes."""
        return params * (self.cpu_update_bytes_per_param + conversion_passes * self.cpu_convert_bytes_per_param)

    def overhead(self, stream: str, kind: str | None = None) -> float:
        """Launch / dispatch seconds of a task: its kind's entry if there is one, else its stream's, else 0."""
        if kind in self.task_overhead_s:
            return self.task_overhead_s[kind]
        return self.task_overhead_s.get(stream, 0.0)

    def with_(self, **changes) -> HardwareProfile:
        """A copy with some fields replaced (`profile.with_(host_memory_Bps=math.inf)`)."""
        return replace(self, **changes)

    # ---- JSON ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"format": FORMAT}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, CopyCurve):
                v = asdict(v)
            elif f.name == "compute_tables":
                v = [asdict(t) for t in v]
            elif f.name in ("cpu_adam_params_per_s", "cpu_optimizer_slowdown"):
                v = {str(k): r for k, r in sorted(v.items())}
            elif f.name in ("collectives", "copy_beside_update", "compute_beside_copy",
                            "compute_beside_collective") and not v:
                continue  # profiles without them keep their JSON (and older readers can load it)
            d[f.name] = v
        return d

    def to_json(self) -> str:
        # inf is written as the JSON extension `Infinity`, which json.loads reads back.
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> HardwareProfile:
        if not isinstance(d, dict):
            raise ProfileError(f"{where} is not a megatrain hardware profile: a JSON {type(d).__name__}, not an "
                               f"object with \"format\": \"{FORMAT}\"")
        d = dict(d)
        if d.pop("format", None) != FORMAT:
            raise ProfileError(f"{where} is not a megatrain hardware profile (expected \"format\": \"{FORMAT}\")")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ProfileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        for required in ("name", "h2d", "d2h"):
            if required not in d:
                raise ProfileError(f"{where}: missing field {required!r}")
        try:
            for direction in ("h2d", "d2h"):
                if not isinstance(d[direction], dict):
                    raise ProfileError(f"{direction} must be an object (sizes_bytes, Bps, latency_s)")
                try:
                    d[direction] = CopyCurve(**d[direction])
                except (TypeError, ProfileError) as e:
                    raise ProfileError(f"{direction}: {e}") from None
            tables = d.get("compute_tables", [])
            if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
                raise ProfileError("compute_tables must be a list of objects")
            d["compute_tables"] = tuple(ComputeTable(**t) for t in tables)
            return cls(**d)
        except TypeError as e:
            raise ProfileError(f"{where}: {e}") from None
        except ProfileError as e:
            raise ProfileError(f"{where}: {e}") from None

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> HardwareProfile:
        try:
            return cls.from_dict(json.loads(text), where)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{where} is not valid JSON: {e}") from None


def derive_host_memory_Bps(p: HardwareProfile) -> tuple[float, str]:
    """The host memory budget of a profile written before `host_memory_Bps` existed, and the note saying how.

    Such a profile may carry the measured slowdown f2 of a CPU update while both copy directions run
    (`cpu_optimizer_slowdown[2]`). Under the max-min fair share (sim/hostmem.py) copies below their fair share
    keep their rate, so the budget is what the update kept plus what the copies moved:
    B = bytes/param x cpu_adam_rate() / f2 + copy_host_bytes_per_byte x min(duplex_Bps, h2d + d2h at their
    largest size). Without f2 nothing says how much the host memory was shared: B = inf (no contention).
    """
    f2 = p.cpu_optimizer_slowdown.get(2)
    if not f2 or f2 <= 1.0:
        return math.inf, ("derived: the profile has no host_memory_Bps and no measured update slowdown under copies "
                          "(cpu_optimizer_slowdown['2']); inf, i.e. CPU updates and copies do not contend")
    update = p.cpu_update_bytes_per_param * p.cpu_adam_rate() / f2
    copies = p.copy_host_bytes_per_byte * min(p.duplex_Bps, p.h2d.Bps[-1] + p.d2h.Bps[-1])
    return update + copies, (f"derived from legacy fields: {p.cpu_update_bytes_per_param:g} B/param x "
                             f"{p.cpu_adam_rate() / 1e9:.2f} Gparam/s / {f2:.3f} (update under both copy "
                             f"directions) + {copies / 1e9:.1f} GB/s of copies = {(update + copies) / 1e9:.1f} GB/s")


def shipped_profiles() -> list[str]:
    """Names of the profiles that ship with megatrain ("h200", "cpu")."""
    root = resources.files("megatrain") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path | HardwareProfile) -> HardwareProfile:
    """A shipped profile by name ("h200", "cpu"), or a profile JSON file."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text = str(name_or_path)
    if text in shipped_profiles():
        res = resources.files("megatrain") / "profiles" / f"{text}.json"
        return HardwareProfile.from_json(res.read_text(), where=f"shipped profile {text}")
    p = Path(text)
    if p.is_file():
        return HardwareProfile.from_json(p.read_text(), where=str(p))
    raise ProfileError(f"no hardware profile {text!r}: give a shipped profile ({', '.join(shipped_profiles())}) "
                       "or the path of a profile JSON (as `megatrain profile` writes)")
