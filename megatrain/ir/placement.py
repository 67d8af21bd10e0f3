"""Placement: what the schedule knobs mean, resolved once for a model, a batch and a sequence length.

Knobs are the user's words (megatrain/compile/knobs.py); a `Placement` is what they mean, typed and immutable:

- per unit (embedding `E`, layers, head `H`): where its weights live (streamed through a GPU buffer, or resident on
  the GPU for the run), where its AdamW update runs (host threads, the GPU on streamed state, the GPU on resident
  state) and where its gradients land (the host, a GPU buffer of their own, the resident buffer);
- when every update runs (`Timing`: after the step, overlapped with the next forward, as gradients arrive);
- the activation checkpoints (which layers keep their input, which of those go to the host);
- the GPU buffers, as a typed table (`Buffer`: kind, occupant, elements, bytes);
- wires and compute dtype, the layer kernel (compiled or eager), clipping.

`resolve()` (megatrain/compile/resolve.py) is the only code that makes one from the knobs. Lowering copies the placement
into the Program, and the simulator, the executor and the memory planner read it from there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from megatrain.model.spec import DTYPE_BYTES, EMBED, HEAD, ModelSpec
from megatrain.ir.hostlayout import GRAD_SCRATCH_ELEMENTS, STATE_SCRATCH_ELEMENTS, HostLayout
from megatrain.ir.tasks import S, U
from megatrain.ir.tasks import unit_text

WIRE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # a wire knob's word -> the torch dtype it moves
SHARD_ALIGN = 1024  # elements: one 4 KiB page of fp32; a rank's slice of a unit is whole pages
EXECUTED_STATE_TIERS = ("host",)  # state tiers the executor runs; the others are planned and simulated only


def shard_numel(n: int, world: int) -> int:
    """Elements of each rank's slice of an n-element unit: n / world rounded up to whole pages (world 1: n)."""
    if world <= 1:
        return n
    return -(-n // (world * SHARD_ALIGN)) * SHARD_ALIGN


def padded_numel(n: int, world: int) -> int:
    """Elements of a GPU slot holding all ranks' slices of an n-element unit (world 1: n)."""
    return n if world <= 1 else world * shard_numel(n, world)



DEFAULT_STRATEGY = "sharded"  # the collective strategy of a data-parallel run (megatrain/parallel/sharded.py)


@dataclass(frozen=True)
class Parallelism:
    """The run's shape of parallelism, as the resolver takes it: `world` ranks (one per GPU) spread evenly over
    `hosts` hosts, and the collective strategy that joins them. `resolve()` decides what it supports and the
    Placement carries it (megatrain/compile/resolve.py)."""

    world: int = 1
    hosts: int = 1
    strategy: str = DEFAULT_STRATEGY

    @property
    def per_host(self) -> int:
        """Ranks on each host."""
        return self.world // self.hosts


ONE_GPU = Parallelism()


class Timing(str, Enum):
    """When the updates of a step's gradients run."""

    AFTER = "after"  # after the backward (and the global norm)
    OVERLAP = "overlap"  # in the next step, each before its layer's forward needs the weights
    ARRIVAL = "arrival"  # as soon as the unit's gradients land (no global norm first: no exact clipping)


class UpdateSite(str, Enum):
    """Where a unit's AdamW update runs."""

    HOST = "host"  # host threads, on the host store's tiles
    GPU_STREAMED = "gpu-streamed"  # the GPU, on master + moments streamed into a state buffer and back
    GPU_RESIDENT = "gpu-resident"  # the GPU, on master + moments that live there for the run


class GradLanding(str, Enum):
    """Where a unit's accumulated gradients go after its backward."""

    HOST = "host"  # copied to the host store's landing tile (OFFLOAD)
    GPU_KEPT = "gpu-kept"  # copied on the device into a buffer of their own, read by the GPU update
    GPU_RESIDENT = "gpu-resident"  # stay in the resident buffer


class BufferKind(str, Enum):
    """What a GPU buffer holds (each kind has one layout; the executor allocates by kind)."""

    WEIGHTS = "weights"  # a unit's weights in the wire dtype + an fp32 gradient area (ring slots, embed, head)
    STATE = "state"  # fp32 master, m, v and gradient of one layer, for a streamed GPU update
    KEPT_GRADS = "kept-grads"  # fp32 gradients of one GPU-updated layer, kept until its update
    RESIDENT = "resident"  # fp32 master, m, v and gradient of a unit, for the whole run


@dataclass(frozen=True)
class UnitPlacement:
    """Where one unit's weights, update and gradients are."""

    unit: int
    update: UpdateSite
    grads: GradLanding
    state_buffer: str | None = None  # the STATE buffer of a GPU_STREAMED update

    @property
    def resident(self) -> bool:
        """The unit's weights, state and gradients live on the GPU for the whole run."""
        return self.update is UpdateSite.GPU_RESIDENT


@dataclass(frozen=True)
class Buffer:
    """One GPU buffer: its name (as tasks' `slot` / `fills` refer to it), kind, fixed occupant, size."""

    name: str
    kind: BufferKind
    unit: int | None  # the unit it always holds (None: a ring slot or a state slot, whose occupant changes)
    numel: int  # elements of the largest unit it holds
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """The resolved meaning of a schedule's knobs for (model, batch, seq); see the module docstring."""

    model: ModelSpec
    batch: int
    seq: int
    timing: Timing
    units: tuple[UnitPlacement, ...]  # EMBED, layers 0..L-1, HEAD
    ring_buffers: int  # GPU weight slots in the LRU ring
    recompute_block: int
    micro_batches: int
    checkpoint_layers: tuple[int, ...]  # layers whose input is kept (the first of each recompute block)
    offloaded_checkpoints: tuple[int, ...]  # of those, the ones that go to the host (bottom up)
    state_order: tuple[int, ...]  # GPU_STREAMED layers in the order they take state buffers
    state_buffers: int  # STATE buffers in use (0 without GPU_STREAMED layers)
    state_lookahead: int  # how far ahead of their layer state copies are queued (see builders.order passes)
    buffers: tuple[Buffer, ...]
    weight_wire: str  # "bf16" | "fp32": what PREFETCH streams
    grad_wire: str  # "bf16" | "fp32": what OFFLOAD sends
    compute_dtype: str  # "bf16" | "fp32": the layers' math and the activations
    layer_kernel: str  # "eager" | "compiled" (torch.compile of the decoder layer)
    clip_max_norm: float | None  # exact global-norm clipping at this norm; None: no global norm is taken
    loss_chunk_tokens: int  # tokens per chunk of the fused head + loss
    mlp_tile_tokens: int = 0  # tokens per tile of the layers' norm + MLP half; 0 = untiled
    notes: tuple[str, ...] = ()  # settings that are legal but clamped here (shown by plan / simulate / train)
    world: int = 1  # data-parallel ranks: each owns a slice of every unit (megatrain/parallel/sharded.py)
    grad_ring: int = 0  # gradient ring tiles in use (0: a landing tile per unit)
    # speculative clipping: host units' CLIP_REDO at the start of the next step (knob clip_redo "next-step")
    redo_next_step: bool = False
    ring_tiles: tuple[tuple[int, int], ...] = ()  # (unit, ring tile) in landing order
    state_dtype: str = "fp32"  # Adam m and v on the host
    state_tier: str = "host"  # "host" | "nvme-moments" | "nvme-all" (planned and simulated only)
    hosts: int = 1  # the ranks spread evenly over this many hosts (collectives cross the network when > 1)
    strategy: str = DEFAULT_STRATEGY  # the collective strategy joining the ranks (read only when world > 1)
    # layers whose forward keeps its autograd graph for their backward, which then does not recompute (knob
    # keep_activations; resident layers only)
    graph_layers: tuple[int, ...] = ()
    _by_unit: dict = field(default=None, init=False, repr=False, compare=False)

    @property
    def parallelism(self) -> Parallelism:
        """The ranks, hosts and strategy this placement was resolved for."""
        return Parallelism(self.world, self.hosts, self.strategy)

    # ---- per unit -----------------------------------------------------------------------------------------------
    def unit(self, unit: int) -> UnitPlacement:
        if self._by_unit is None:
            object.__setattr__(self, "_by_unit", {u.unit: u for u in self.units})
        return self._by_unit[unit]

    def units_where(self, site: UpdateSite) -> list[int]:
        """Units whose update runs at `site`, in forward order (EMBED, layers, HEAD)."""
        return [u.unit for u in self.units if u.update is site]

    @property
    def gpu_streamed_layers(self) -> list[int]:
        return self.units_where(UpdateSite.GPU_STREAMED)

    @property
    def resident_units(self) -> list[int]:
        return self.units_where(UpdateSite.GPU_RESIDENT)

    @property
    def kept_grad_layers(self) -> list[int]:
        return [u.unit for u in self.units if u.grads is GradLanding.GPU_KEPT]

    def landing_readers(self, unit: int) -> list:
        """The tasks that read `unit`'s gradients from its host landing tile: its host update, or the state copy S
        of a GPU update; a tied head's tile is read by the embedding's update too (it adds the lm_head gradient)."""

        readers = [S(unit) if self.unit(unit).update is UpdateSite.GPU_STREAMED else U(unit)]
        if unit == HEAD and self.model.tie_word_embeddings:
            readers.append(U(EMBED))
        return readers

    @property
    def compiled_layers(self) -> bool:
        """The decoder layer runs through torch.compile (`layer_kernel` "compiled"): other kernels, other rounding,
        and a graph that saves other tensors for the backward than eager autograd's."""
        return self.layer_kernel == "compiled"

    @property
    def exact_clip(self) -> bool:
        return self.clip_max_norm is not None

    @property
    def speculative_clip(self) -> bool:
        """Exact clipping with updates as gradients land: each update runs unclipped as its gradients arrive, and
        is undone and redone with the clip coefficient (CLIP_REDO) in the steps whose global norm exceeds the max."""
        return self.exact_clip and self.timing is Timing.ARRIVAL

    @property
    def host_layout(self) -> HostLayout:
        spec = self.model
        scratch = 0
        if self.grad_wire == "bf16":  # the largest unit's own parameters, at most a chunk
            own = [spec.hidden_size if u == HEAD and spec.tie_word_embeddings else spec.unit_params(u)
                   for u in spec.units()]
            scratch = min(max(own), GRAD_SCRATCH_ELEMENTS)
        tile = max((spec.unit_params(u) for u, _ in self.ring_tiles), default=0)
        state_scratch = (min(max(spec.unit_params(u) for u in spec.units()), STATE_SCRATCH_ELEMENTS)
                         if self.state_dtype == "bf16" else 0)
        return HostLayout(self.weight_wire, self.grad_wire, tuple(self.gpu_streamed_layers), scratch,
                          self.grad_ring, self.ring_tiles, tile, self.state_dtype, state_scratch, self.state_tier,
                          resident_layers=tuple(u for u in self.resident_units if u >= 0))

    # ---- sizes --------------------------------------------------------------------------------------------------
    @property
    def tokens_per_micro(self) -> int:
        return self.batch // self.micro_batches * self.seq

    def wire_bytes(self, which: str) -> int:
        """Bytes per element of "weight_wire", "grad_wire" or "compute_dtype"."""
        return DTYPE_BYTES[WIRE_DTYPES[getattr(self, which)]]

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(f"no GPU buffer {name!r}; buffers: {', '.join(b.name for b in self.buffers)}")

    def describe(self) -> str:
        """A few lines saying what lives where: the placement as `megatrain plan` / `simulate` print it."""

        def units_of(pred) -> str:
            chosen = [u.unit for u in self.units if pred(u)]
            ends = [unit_text(u) for u in chosen if u < 0]
            return " ".join([*ends[:1], _ranges([u for u in chosen if u >= 0]), *ends[1:]]).strip() or "-"

        clip = f"exact at max norm {self.clip_max_norm:g}" if self.exact_clip else "none (per-unit non-finite skip)"
        if self.speculative_clip:
            clip += " (speculative: updates run as gradients land, redone when the norm exceeds it)"
        lines = [
            f"timing {self.timing.value}; clip {clip}; layer kernel {self.layer_kernel}; wires weight "
            f"{self.weight_wire} / grad {self.grad_wire}; compute {self.compute_dtype}"
            + (f"; MLP in tiles of {self.mlp_tile_tokens} tokens" if self.mlp_tile_tokens else ""),
            f"updates on the host: {units_of(lambda u: u.update is UpdateSite.HOST)}",
            f"updates on the GPU, streamed state: {units_of(lambda u: u.update is UpdateSite.GPU_STREAMED)}"
            f" (gradients kept on the GPU: {units_of(lambda u: u.grads is GradLanding.GPU_KEPT)})",
            f"resident on the GPU: {units_of(lambda u: u.resident)}",
            f"checkpoints: layers {_ranges(self.checkpoint_layers) or '-'}, offloaded "
            f"{_ranges(self.offloaded_checkpoints) or '-'}; "
            f"{self.micro_batches} micro-batch(es), recompute block {self.recompute_block}"
            + (f"; layers {_ranges(self.graph_layers)} keep their forward's graph (no recompute)"
               if self.graph_layers else ""),
            "GPU buffers: " + ", ".join(f"{b.name} ({b.kind.value})" for b in self.buffers),
        ]
        if self.world > 1:
            hosts = f" on {self.hosts} hosts ({self.world // self.hosts} each)" if self.hosts > 1 else ""
            lines.append(f"data parallel over {self.world} ranks{hosts}, strategy {self.strategy}: each owns "
                         f"1/{self.world} of every unit's host state; slots filled by all-gather, gradients "
                         "reduce-scattered")
        if self.grad_ring or self.state_dtype != "fp32" or self.state_tier != "host":
            order = [f"{unit_text(u)}:{t}" for u, t in self.ring_tiles]  # unit:tile in landing order
            shown = " ".join(order[:8]) + (f" ... {order[-1]}" if len(order) > 8 else "")
            ring = f"a ring of {self.grad_ring} tiles ({shown})" if self.grad_ring else "a tile per unit"
            lines.append(f"host store: gradients land in {ring}; adam m/v {self.state_dtype} on the "
                         f"{'host' if self.state_tier == 'host' else 'NVMe tier (' + self.state_tier + ')'}")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    # ---- JSON ---------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "timing": self.timing.value,
            "units": [{"unit": u.unit, "update": u.update.value, "grads": u.grads.value,
                       "state_buffer": u.state_buffer} for u in self.units],
            "ring_buffers": self.ring_buffers, "recompute_block": self.recompute_block,
            "micro_batches": self.micro_batches, "checkpoint_layers": list(self.checkpoint_layers),
            "offloaded_checkpoints": list(self.offloaded_checkpoints), "state_order": list(self.state_order),
            "state_buffers": self.state_buffers, "state_lookahead": self.state_lookahead,
            "buffers": [{"name": b.name, "kind": b.kind.value, "unit": b.unit, "numel": b.numel,
                         "nbytes": b.nbytes} for b in self.buffers],
            "weight_wire": self.weight_wire, "grad_wire": self.grad_wire, "compute_dtype": self.compute_dtype,
            "layer_kernel": self.layer_kernel, "clip_max_norm": self.clip_max_norm,
            "loss_chunk_tokens": self.loss_chunk_tokens, "mlp_tile_tokens": self.mlp_tile_tokens,
            "notes": list(self.notes),
            # one-GPU Programs keep their JSON (and hash); from_dict defaults the three
            **({"world": self.world, "hosts": self.hosts, "strategy": self.strategy} if self.world > 1 else {}),
            "loss_chunk_tokens": self.loss_chunk_tokens, "notes": list(self.notes),
            "grad_ring": self.grad_ring, "ring_tiles": [list(r) for r in self.ring_tiles],
            "state_dtype": self.state_dtype, "state_tier": self.state_tier,
            # Programs without such layers keep their JSON (and hash)
            **({"graph_layers": list(self.graph_layers)} if self.graph_layers else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, model: ModelSpec, batch: int, seq: int) -> Placement:
        d = dict(d)
        units = tuple(UnitPlacement(u["unit"], UpdateSite(u["update"]), GradLanding(u["grads"]), u["state_buffer"])
                      for u in d.pop("units"))
        buffers = tuple(Buffer(b["name"], BufferKind(b["kind"]), b["unit"], b["numel"], b["nbytes"])
                        for b in d.pop("buffers"))
        tuples = ("checkpoint_layers", "offloaded_checkpoints", "state_order", "notes", "graph_layers")
        d["ring_tiles"] = tuple(tuple(r) for r in d.get("ring_tiles", ()))
        return cls(model=model, batch=batch, seq=seq, timing=Timing(d.pop("timing")), units=units, buffers=buffers,
                   **{k: tuple(v) if k in tuples else v for k, v in d.items()})


class OfPlacement:
    """The shape of the step a record's `placement` describes (a Program, a memory plan): model, batch, seq."""

    placement: Placement

    @property
    def model(self) -> ModelSpec:
        return self.placement.model

    @property
    def batch(self) -> int:
        return self.placement.batch

    @property
    def seq(self) -> int:
        return self.placement.seq

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def gpu_buffers(p: Placement) -> tuple[Buffer, ...]:
    """The GPU buffer table: the weight ring, the embedding's and head's buffers (or their resident buffers),
    state buffers, kept-gradient buffers and resident layers' buffers, with their sizes.

    Ring and state slots take any layer, so they hold the largest unit of the layer kinds that stream through them
    (`ModelSpec.kind_params`; one size when every layer is the same); a kept-gradient or resident buffer belongs to
    one layer and has its size."""
    spec, w = p.model, p.wire_bytes("weight_wire")
    layer = padded_numel(max(spec.kind_params().values()), p.world) if spec.num_layers else 0
    out = [Buffer(f"w{i}", BufferKind.WEIGHTS, None, layer, layer * (w + 4)) for i in range(p.ring_buffers)]
    for unit, name in ((EMBED, "embed"), (HEAD, "head")):
        n = padded_numel(spec.unit_params(unit), p.world)
        if p.unit(unit).resident:  # fp32 master, m, v and gradient
            out.append(Buffer(name, BufferKind.RESIDENT, unit, n, 16 * n))
        else:
            out.append(Buffer(name, BufferKind.WEIGHTS, unit, n, n * (w + 4)))
    out += [Buffer(f"s{i}", BufferKind.STATE, None, layer, 16 * layer) for i in range(p.state_buffers)]
    own = {u: padded_numel(spec.unit_params(u), p.world) for u in (*p.kept_grad_layers, *p.resident_units) if u >= 0}
    out += [Buffer(f"g{u}", BufferKind.KEPT_GRADS, u, own[u], 4 * own[u]) for u in p.kept_grad_layers]
    out += [Buffer(f"r{u}", BufferKind.RESIDENT, u, own[u], 16 * own[u]) for u in p.resident_units if u >= 0]
    return tuple(out)


def _ranges(layers) -> str:
    """"0-3 6 8-9" for [0, 1, 2, 3, 6, 8, 9]."""
    out, run = [], []
    for layer in layers:
        if run and layer == run[-1] + 1:
            run.append(layer)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [layer]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return " ".join(out)


def resident_buffer(unit: int) -> str:
    """The GPU buffer of a resident unit: "embed" / "head" (as when streamed), "r<layer>" for a layer."""
    return "embed" if unit == EMBED else "head" if unit == HEAD else f"r{unit}"
