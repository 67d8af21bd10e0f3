"""Placement: what the schedule knobs mean, resolved once for a model, a batch and a sequence length.

Knobs are the user's words (megatrain/ir/knobs.py); a `Placement` is what they mean, typed and immutable:

- per unit (embedding `E`, layers, head `H`): where its weights live (streamed through a GPU buffer, or resident on
  the GPU for the run), where its AdamW update runs (host threads, the GPU on streamed state, the GPU on resident
  state) and where its gradients land (the host, a GPU buffer of their own, the resident buffer);
- when every update runs (`Timing`: after the step, overlapped with the next forward, as gradients arrive);
- the activation checkpoints (which layers keep their input, which of those go to the host);
- the GPU buffers, as a typed table (`Buffer`: kind, occupant, elements, bytes);
- wires and compute dtype, the layer kernel (compiled or eager), clipping.

`resolve()` is the only code that reads placement knobs and the only place that checks the rules between them:
every invalid combination is refused there with a message naming the knobs that conflict and what to set instead,
and a knob that would have no effect in a combination is refused rather than ignored (tests/test_placement.py
walks the knob space to prove it). Lowering copies the placement into the Program, and the simulator, the
executor and the memory planner read it from there.

The seven optimizer placements users name are presets of this description: a timing and a rule for choosing the
decoder layers updated on the GPU (`OPTIMIZER_PRESETS`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..spec import DTYPE_BYTES, EMBED, HEAD, ModelSpec
from .dag import ScheduleError
from .knobs import WIRE_DTYPES, ScheduleKnobs


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


def _layer_selectors() -> dict[str, Callable[[int, int], list[int]]]:
    """Rules choosing n of L decoder layers for GPU updates, in forward order."""
    return {
        "none": lambda n, L: [],
        "all": lambda n, L: list(range(L)),
        "first": lambda n, L: list(range(n)),
        # n layers spread evenly over the depth from layer 0: during the next forward the host threads and the GPU
        # each update every few layers and proceed side by side (layer 0 on the GPU: its state copy overlaps the
        # host's update of the embedding, which the forward needs first).
        "spread": lambda n, L: [i * L // n for i in range(n)],
        # The same from the top, where the backward starts: the host threads fall behind the gradients as they
        # land, and each GPU layer lets them catch up before the bottom layers, whose updates end the step.
        "top-spread": lambda n, L: sorted(L - 1 - i * L // n for i in range(n)),
    }


LAYER_SELECTORS = _layer_selectors()

# optimizer placement name -> (timing, rule for the GPU-updated layers, whether gpu_optimizer_fraction sizes it)
OPTIMIZER_PRESETS: dict[str, tuple[Timing, str]] = {
    "after": (Timing.AFTER, "none"),
    "gpu": (Timing.AFTER, "all"),
    "split": (Timing.AFTER, "first"),
    "overlap": (Timing.OVERLAP, "none"),
    "overlap-split": (Timing.OVERLAP, "spread"),
    "arrival": (Timing.ARRIVAL, "none"),
    "arrival-split": (Timing.ARRIVAL, "top-spread"),
}
FRACTION_RULES = ("first", "spread", "top-spread")  # the rules gpu_optimizer_fraction sizes
DEFAULT_GPU_FRACTION = 0.5
DEFAULT_STATE_BUFFERS = 2
DEFAULT_STATE_LOOKAHEAD = 1


@dataclass(frozen=True)
class HostLayout:
    """What the host store holds and pins, the same for every batch shape of a schedule (`exec.store.HostStore`)."""

    weight_wire: str  # "bf16": a bf16 streaming copy is kept; "fp32": the master is streamed
    grad_wire: str  # dtype of the gradient landing tiles
    gpu_streamed_units: tuple[int, ...]  # units whose master and moments are copied to the GPU (pinned)
    grad_scratch_elements: int  # fp32 elements of the bf16 -> fp32 gradient conversion buffer (0: none needed)


# Gradients that land in bf16 are converted to fp32 for the update this many elements at a time, in one reused
# host buffer (a fresh fp32 copy per update page-faulted ~0.9 GB per Llama-3-8B layer and made the update 1.5x
# slower on the H200 host).
GRAD_SCRATCH_ELEMENTS = 1 << 26


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
    notes: tuple[str, ...] = ()  # settings that are legal but clamped here (shown by plan / simulate / train)
    _by_unit: dict = field(default=None, init=False, repr=False, compare=False)

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

    @property
    def exact_clip(self) -> bool:
        return self.clip_max_norm is not None

    @property
    def host_layout(self) -> HostLayout:
        spec = self.model
        scratch = 0
        if self.grad_wire == "bf16":  # the largest unit's own parameters, at most a chunk
            own = [spec.hidden_size if u == HEAD and spec.tie_word_embeddings else spec.unit_params(u)
                   for u in spec.units()]
            scratch = min(max(own), GRAD_SCRATCH_ELEMENTS)
        return HostLayout(self.weight_wire, self.grad_wire, tuple(self.gpu_streamed_layers), scratch)

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

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def describe(self) -> str:
        """A few lines saying what lives where: the placement as `megatrain plan` / `simulate` print it."""
        from ..ir.tasks import unit_text

        def units_of(pred) -> str:
            chosen = [u.unit for u in self.units if pred(u)]
            ends = [unit_text(u) for u in chosen if u < 0]
            return " ".join([*ends[:1], _ranges([u for u in chosen if u >= 0]), *ends[1:]]).strip() or "-"

        clip = f"exact at max norm {self.clip_max_norm:g}" if self.exact_clip else "none (per-unit non-finite skip)"
        lines = [
            f"timing {self.timing.value}; clip {clip}; layer kernel {self.layer_kernel}; wires weight "
            f"{self.weight_wire} / grad {self.grad_wire}; compute {self.compute_dtype}",
            f"updates on the host: {units_of(lambda u: u.update is UpdateSite.HOST)}",
            f"updates on the GPU, streamed state: {units_of(lambda u: u.update is UpdateSite.GPU_STREAMED)}"
            f" (gradients kept on the GPU: {units_of(lambda u: u.grads is GradLanding.GPU_KEPT)})",
            f"resident on the GPU: {units_of(lambda u: u.resident)}",
            f"checkpoints: layers {_ranges(self.checkpoint_layers) or '-'}, offloaded "
            f"{_ranges(self.offloaded_checkpoints) or '-'}; "
            f"{self.micro_batches} micro-batch(es), recompute block {self.recompute_block}",
            "GPU buffers: " + ", ".join(f"{b.name} ({b.kind.value})" for b in self.buffers),
        ]
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
            "loss_chunk_tokens": self.loss_chunk_tokens, "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: dict, model: ModelSpec, batch: int, seq: int) -> Placement:
        d = dict(d)
        units = tuple(UnitPlacement(u["unit"], UpdateSite(u["update"]), GradLanding(u["grads"]), u["state_buffer"])
                      for u in d.pop("units"))
        buffers = tuple(Buffer(b["name"], BufferKind(b["kind"]), b["unit"], b["numel"], b["nbytes"])
                        for b in d.pop("buffers"))
        tuples = ("checkpoint_layers", "offloaded_checkpoints", "state_order", "notes")
        return cls(model=model, batch=batch, seq=seq, timing=Timing(d.pop("timing")), units=units, buffers=buffers,
                   **{k: tuple(v) if k in tuples else v for k, v in d.items()})


# ---- the resolver ------------------------------------------------------------------------------------------------
def resolve(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs) -> Placement:
    """The placement `knobs` mean for `spec` at batch x seq; raises ScheduleError naming the conflicting knobs."""
    k, L = knobs, spec.num_layers
    if batch < 1 or seq < 1:
        raise ScheduleError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    if batch % k.micro_batches:
        raise ScheduleError(f"batch {batch} does not split into micro_batches={k.micro_batches}; choose a "
                            "micro-batch count that divides the batch")
    notes: list[str] = []
    ring_buffers, recompute_block = _ring(k, L, notes)
    timing, rule = OPTIMIZER_PRESETS[k.optimizer]
    gpu_layers = _gpu_layers(k, rule, L)
    _check_state_knobs(k, timing, gpu_layers)
    clip = _resolve_clip(k, timing)
    resident = _resident_units(spec, k, timing, gpu_layers)
    kept = _kept_grad_layers(k, gpu_layers)
    state_order = gpu_layers[::-1] if timing is Timing.ARRIVAL else list(gpu_layers)
    state_buffers = min(k.state_buffers or DEFAULT_STATE_BUFFERS, len(gpu_layers))
    state_of = {u: f"s{i % state_buffers}" for i, u in enumerate(state_order)}
    units = tuple(_unit_placement(u, resident, gpu_layers, kept, state_of) for u in spec.units())
    checkpoint_layers = tuple(range(0, L, recompute_block))
    offloaded = _offloaded_checkpoints(k, checkpoint_layers)
    tokens_mb = batch // k.micro_batches * seq
    if k.loss_chunk_tokens > tokens_mb:
        notes.append(f"loss_chunk_tokens={k.loss_chunk_tokens} is above the {tokens_mb} tokens of a micro-batch: "
                     "the loss runs in one chunk")
    placement = Placement(
        model=spec, batch=batch, seq=seq, timing=timing, units=units, ring_buffers=ring_buffers,
        recompute_block=recompute_block, micro_batches=k.micro_batches, checkpoint_layers=checkpoint_layers,
        offloaded_checkpoints=offloaded, state_order=tuple(state_order), state_buffers=state_buffers,
        state_lookahead=DEFAULT_STATE_LOOKAHEAD if k.state_lookahead is None else k.state_lookahead,
        buffers=(), weight_wire=k.weight_wire, grad_wire=k.grad_wire, compute_dtype=k.compute_dtype,
        layer_kernel="compiled" if k.compile_layers else "eager", clip_max_norm=clip,
        loss_chunk_tokens=k.loss_chunk_tokens, notes=tuple(notes))
    object.__setattr__(placement, "buffers", gpu_buffers(placement))
    return placement


def resolve_host_layout(spec: ModelSpec, knobs: ScheduleKnobs) -> HostLayout:
    """The host store's layout for a schedule, before any batch shape is known (it does not depend on one)."""
    return resolve(spec, knobs.micro_batches, 1, knobs).host_layout


def _ring(k: ScheduleKnobs, L: int, notes: list[str]) -> tuple[int, int]:
    """(weight ring slots, recompute block) in use: a model with fewer layers than either uses fewer (reported
    in the notes: the same schedule runs on a model cut to a few layers, as the profiler's real steps do)."""
    if k.buffers < k.recompute_block:
        r = k.recompute_block
        raise ScheduleError(f"{k.buffers} weight buffer(s) cannot hold the {r} layers that a recompute block keeps "
                            f"resident during its backward; use buffers >= {r} ({r + 1} to overlap the copies), "
                            "or a smaller recompute_block")
    buffers, block = k.buffers, k.recompute_block
    if L and buffers > L:
        notes.append(f"buffers={buffers} but the model has {L} layers: {L} ring slots are used")
        buffers = L
    if L and block > L:
        notes.append(f"recompute_block={block} but the model has {L} layers: one block of {L} spans the model")
        block = L
    return buffers, block


def _gpu_layers(k: ScheduleKnobs, rule: str, L: int) -> list[int]:
    """Decoder layers updated on the GPU with streamed state, in forward order."""
    if rule not in FRACTION_RULES:
        if k.gpu_optimizer_fraction is not None:
            what = "every layer" if rule == "all" else "no layer"
            raise ScheduleError(f"gpu_optimizer_fraction={k.gpu_optimizer_fraction} has no effect with "
                                f"optimizer={k.optimizer!r}, which updates {what} on the GPU; use one of "
                                f"split, overlap-split, arrival-split, or leave gpu_optimizer_fraction unset")
        return LAYER_SELECTORS[rule](L, L)
    fraction = DEFAULT_GPU_FRACTION if k.gpu_optimizer_fraction is None else k.gpu_optimizer_fraction
    return LAYER_SELECTORS[rule](round(fraction * L), L) if round(fraction * L) else []


def _check_state_knobs(k: ScheduleKnobs, timing: Timing, gpu_layers: list[int]) -> None:
    """state_buffers and state_lookahead exist only for GPU updates on streamed state."""
    if k.state_buffers is not None:
        if not gpu_layers:
            raise ScheduleError(f"state_buffers={k.state_buffers} sizes the GPU buffers of streamed GPU updates, "
                                f"but optimizer={k.optimizer!r} (gpu_optimizer_fraction="
                                f"{k.gpu_optimizer_fraction}) updates no layer on the GPU; leave it unset")
        if k.state_buffers > len(gpu_layers):
            raise ScheduleError(f"state_buffers={k.state_buffers} but only {len(gpu_layers)} layer(s) are updated on "
                                f"the GPU: the extra buffers would stay unused; use state_buffers <= "
                                f"{len(gpu_layers)}")
    if k.state_lookahead is not None:
        # Only where a state copy can be queued ahead of weight copies: "overlap" with GPU layers, and "arrival"
        # when the GPU layer's gradients stay on the GPU (otherwise S waits for its own gradients' OFFLOAD anyway).
        useful = gpu_layers and (timing is Timing.OVERLAP or (timing is Timing.ARRIVAL and k.retain_grads))
        if not useful:
            raise ScheduleError(f"state_lookahead={k.state_lookahead} has no effect with optimizer={k.optimizer!r}"
                                f" and retain_grads={k.retain_grads}: it queues state copies ahead of weight copies "
                                "for optimizer='overlap-split', or 'arrival-split' with retain_grads >= 1; leave "
                                "it unset")


def _resolve_clip(k: ScheduleKnobs, timing: Timing) -> float | None:
    if not k.clip:
        return None
    if timing is Timing.ARRIVAL:
        raise ScheduleError(f"clip={k.clip} needs the global gradient norm before any update, but "
                            f"optimizer={k.optimizer!r} updates a unit as soon as its gradients land (the later "
                            "units' gradients do not exist yet); use clip=0 (no clipping), or optimizer='overlap' "
                            "(updates overlap the next forward and stay exact)")
    return float(k.clip)


def _resident_units(spec: ModelSpec, k: ScheduleKnobs, timing: Timing, gpu_layers: list[int]) -> list[int]:
    if not (k.resident_embeddings or k.resident_layers):
        return []
    if timing is not Timing.ARRIVAL:
        raise ScheduleError(f"resident_embeddings / resident_layers update their units on the GPU as the gradients "
                            f"land, which needs an arrival placement; optimizer={k.optimizer!r}: use "
                            "optimizer='arrival' or 'arrival-split' (clip=0), or no resident units")
    if k.resident_layers > spec.num_layers:
        raise ScheduleError(f"resident_layers={k.resident_layers} but the model has {spec.num_layers} layers")
    if k.resident_embeddings and spec.tie_word_embeddings:
        raise ScheduleError("resident_embeddings is not supported with tied embeddings (the head's matrix is the "
                            "embedding's, updated once for both); set resident_embeddings=false")
    clash = set(range(k.resident_layers)) & set(gpu_layers)
    if clash:
        raise ScheduleError(f"layers {sorted(clash)} are both resident (resident_layers={k.resident_layers}) and "
                            f"streamed for a GPU update (gpu_optimizer_fraction={k.gpu_optimizer_fraction}); lower "
                            "one of them")
    return ([EMBED, HEAD] if k.resident_embeddings else []) + list(range(k.resident_layers))


def _kept_grad_layers(k: ScheduleKnobs, gpu_layers: list[int]) -> list[int]:
    """GPU-updated layers whose gradients stay on the GPU: the first `retain_grads` of them, in forward order."""
    if k.retain_grads > len(gpu_layers):
        if not gpu_layers:
            raise ScheduleError(f"retain_grads={k.retain_grads} keeps gradients of GPU-updated layers on the GPU, "
                                f"but optimizer={k.optimizer!r} updates every layer on the host; use one of gpu, "
                                "split, overlap-split, arrival-split, or retain_grads=0")
        raise ScheduleError(f"retain_grads={k.retain_grads} but only {len(gpu_layers)} layer(s) are updated on the "
                            f"GPU (optimizer={k.optimizer!r}, gpu_optimizer_fraction={k.gpu_optimizer_fraction}); "
                            f"use retain_grads <= {len(gpu_layers)} or a larger fraction")
    return gpu_layers[:k.retain_grads]


def _unit_placement(unit: int, resident: list[int], gpu_layers: list[int], kept: list[int],
                    state_of: dict[int, str]) -> UnitPlacement:
    if unit in resident:
        return UnitPlacement(unit, UpdateSite.GPU_RESIDENT, GradLanding.GPU_RESIDENT)
    if unit in gpu_layers:
        grads = GradLanding.GPU_KEPT if unit in kept else GradLanding.HOST
        return UnitPlacement(unit, UpdateSite.GPU_STREAMED, grads, state_of[unit])
    return UnitPlacement(unit, UpdateSite.HOST, GradLanding.HOST)


def _offloaded_checkpoints(k: ScheduleKnobs, checkpoint_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Checkpoints that go to the host, bottom up: all but the top `gpu_checkpoints` blocks'."""
    if not k.offload_checkpoints:
        if k.gpu_checkpoints:
            raise ScheduleError(f"gpu_checkpoints={k.gpu_checkpoints} keeps some offloaded checkpoints on the GPU, "
                                "but offload_checkpoints is false (every checkpoint is on the GPU already); set "
                                "offload_checkpoints=true or gpu_checkpoints=0")
        return ()
    if k.gpu_checkpoints >= len(checkpoint_layers):
        raise ScheduleError(f"gpu_checkpoints={k.gpu_checkpoints} keeps every one of the {len(checkpoint_layers)} "
                            "checkpoints on the GPU, so offload_checkpoints offloads none; use gpu_checkpoints < "
                            f"{len(checkpoint_layers)} or offload_checkpoints=false")
    return checkpoint_layers[:len(checkpoint_layers) - k.gpu_checkpoints]


def gpu_buffers(p: Placement) -> tuple[Buffer, ...]:
    """The GPU buffer table: the weight ring, the embedding's and head's buffers (or their resident buffers),
    state buffers, kept-gradient buffers and resident layers' buffers, with their sizes."""
    spec, w = p.model, p.wire_bytes("weight_wire")
    layer = spec.layer_params if spec.num_layers else 0
    out = [Buffer(f"w{i}", BufferKind.WEIGHTS, None, layer, layer * (w + 4)) for i in range(p.ring_buffers)]
    for unit, name in ((EMBED, "embed"), (HEAD, "head")):
        n = spec.unit_params(unit)
        if p.unit(unit).resident:  # fp32 master, m, v and gradient
            out.append(Buffer(name, BufferKind.RESIDENT, unit, n, 16 * n))
        else:
            out.append(Buffer(name, BufferKind.WEIGHTS, unit, n, n * (w + 4)))
    out += [Buffer(f"s{i}", BufferKind.STATE, None, layer, 16 * layer) for i in range(p.state_buffers)]
    out += [Buffer(f"g{u}", BufferKind.KEPT_GRADS, u, layer, 4 * layer) for u in p.kept_grad_layers]
    out += [Buffer(f"r{u}", BufferKind.RESIDENT, u, layer, 16 * layer) for u in p.resident_units if u >= 0]
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
