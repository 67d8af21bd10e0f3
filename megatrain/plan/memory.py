"""Memory planner: host and GPU bytes of a run, whether they fit, and which knob helps when they do not.

It reads a Placement (the one a Program carries), never the knobs: what lives where is the resolver's to say.

Host bytes per parameter (unique parameters; a tied lm_head counts once):

    fp32 master 4 + Adam m 4 + Adam v 4                      = 12  (m and v 2 + 2 with state_dtype="bf16")
    + bf16 streaming copy 2        (weight_wire = "bf16"; with "fp32" the master itself is streamed)
    + gradient landing space 4 | 2 (grad_wire "fp32" | "bf16"); with a gradient ring (grad_ring = K) instead
      K tiles of the largest unit, a bounded amount (arrival timing without clipping)

With the NVMe tier (state_tier) m and v (or master, m and v) are on the drive, and the host keeps a staging area
of two units' state (one being read, one being written back); the NVMe bytes are reported beside the host's.

The streaming copy and the gradient landing space exist for every *streamed* parameter, so a tied model pays
them twice for the shared matrix (the head streams its own copy), and not for layers resident on the GPU (their
master and moments stay on the host, what checkpoints and schedule switches read). Pinned: what DMA touches — the
streaming copy (or the master for fp32 wire), the gradients, the offloaded checkpoints, and the master and moments
of units the GPU updates on streamed state.

GPU bytes: the placement's buffer table (weight ring, embedding and head, state, kept-gradient and resident
buffers), the activation checkpoints, the RoPE tables, and the larger of one layer's working set (its recompute +
backward, what autograd and the kernels hold at the peak) and the fused head + loss.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatrain.model.spec import ModelSpec
from megatrain.ir.dag import ScheduleError
from megatrain.ir.program import GpuMemoryPlan
from megatrain.ir.hostlayout import host_component_names
from megatrain.ir.placement import BufferKind, OfPlacement, Placement
from megatrain.units import GiB


# Components that are the host store itself (the rest of the host plan is outside it).
NOT_STORE = ("offloaded checkpoints", "runtime overhead")


# RSS of the process beyond the store: the torch/CUDA runtime, Python, the libraries. Measured on the GPU machine
# (docs/benchmarks.md): a CUDA process with torch imported and a context created.
RUNTIME_OVERHEAD_BYTES = {"cuda": int(1.5 * GiB), "cpu": int(0.5 * GiB)}


def layer_working_set(p: Placement) -> dict[str, int]:
    """GPU bytes of one layer's BACKWARD task (recompute from its checkpoint + local backward) at each moment that
    can be the peak ("mlp", "attention" for the Llama shapes), beyond the buffers, the checkpoints and the RoPE
    tables: the family's model (`Family.layer_working_set`, e.g. `model/llama/shape.py`), taken for the largest
    layer of each kind, each moment the largest over the kinds."""
    spec, a, n = p.model, p.wire_bytes("compute_dtype"), p.tokens_per_micro
    largest: dict[str, int] = {}  # kind -> its largest layer
    for layer in range(spec.num_layers):
        kind = spec.unit_kind(layer)
        if kind not in largest or spec.unit_params(layer) > spec.unit_params(largest[kind]):
            largest[kind] = layer
    out: dict[str, int] = {}
    for layer in largest.values():
        moments = spec.family.layer_working_set(spec, layer, a, n, p.weight_wire != p.compute_dtype,
                                                p.mlp_tile_tokens, seq=p.seq)
        for moment, nbytes in moments.items():
            out[moment] = max(out.get(moment, 0), nbytes)
    return out


def head_working_set(p: Placement) -> int:
    """GPU bytes of the fused head + loss (`exec.head.head_loss_backward`) beyond the buffers and checkpoints: the
    final hidden states and their gradient (n x d each), lm_head cast to the compute dtype (when the wire differs),
    and per chunk of c tokens what the final norm saves for its backward (as a layer's norm) plus the larger of
    fp32 logits with logsumexp's fp32 temporary (8cV) and, later, the softmax gradient with its compute-dtype copy
    (4cV + a*cV) and the (V, d) lm_head gradient product when it is added into the fp32 area from another dtype."""
    spec, a, n = p.model, p.wire_bytes("compute_dtype"), p.tokens_per_micro
    d, V = spec.hidden_size, spec.vocab_size
    c = min(p.loss_chunk_tokens, n)
    lm_cast = V * d * a if p.weight_wire != p.compute_dtype else 0
    product = V * d * a if a != 4 else 0
    norm = c * ((4 * d if a < 4 else 0) + 2 * a * d)
    chunk = norm + max(8 * c * V, (4 + a) * c * V + product)
    return 2 * n * d * a + lm_cast + chunk


def plan_gpu_memory(p: Placement) -> GpuMemoryPlan:
    """GPU bytes of a step: the buffers, the checkpointed activations, the RoPE tables, and the larger of a layer's
    working set and the head's.

    - checkpoints: the input of every r-th layer for every micro-batch, in the compute dtype; of the offloaded
      ones only two blocks' worth are on the GPU at a time (one coming back, one being consumed);
    - layer working set (`layer_working_set`): the larger of its moments, plus the inner inputs of a recompute
      block rebuilt by RECOMPUTE ((r - 1) per micro-batch) and the activation gradients of the other micro-batches;
    - head (`head_working_set`), plus the other micro-batches' hidden states;
    - the forward graphs of the layers that keep them (`Placement.graph_layers`), every micro-batch's, held from
      the forward to the backward (`Family.layer_graph_bytes`, eager or compiled as `layer_kernel` says).
    Not counted apart: the temporary of speculative clipping's redo on a GPU-updated unit (`exec.optim.adamw_undo`,
    one fp32 chunk of at most 16 Mi elements, 64 MiB; the fused update itself allocates none). The redo runs after
    the backward, in memory the layer working set (larger at any shape that streams) has given back to the caching
    allocator.
    The measured peak is the check (scripts/longseq_memory.py, docs/benchmarks.md).
    """
    spec, act, tokens_mb = p.model, p.wire_bytes("compute_dtype"), p.tokens_per_micro
    d, M = spec.hidden_size, p.micro_batches
    offloaded = len(p.offloaded_checkpoints)
    n_checkpoints = len(p.checkpoint_layers) - offloaded + min(offloaded, 2)
    checkpoint = n_checkpoints * M * tokens_mb * d * act
    activation = tokens_mb * d * act  # one (tokens, d) activation of a micro-batch
    working = max(layer_working_set(p).values()) + ((p.recompute_block - 1) * M + M - 1) * activation
    head = head_working_set(p) + (M - 1) * activation
    rope = 2 * p.seq * spec.head_dim * act
    cast = p.compute_dtype != "fp32"  # a resident layer's weights are its fp32 master, cast for each task
    graphs = M * sum(spec.family.layer_graph_bytes(spec, u, act, tokens_mb, cast, p.compiled_layers)
                     for u in p.graph_layers)  # the compiled graph saves less than eager autograd
    return GpuMemoryPlan({b.name: b.nbytes for b in p.buffers}, checkpoint, working, head, rope, graphs)


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host bytes by component."""

    components: dict[str, int]
    pinned_bytes: int
    num_params: int
    nvme: dict[str, int] = None  # bytes on the NVMe tier by component ({} without it)

    @property
    def store_bytes(self) -> int:
        return sum(v for k, v in self.components.items() if k not in NOT_STORE)

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    @property
    def bytes_per_param(self) -> float:
        return self.store_bytes / self.num_params


@dataclass(frozen=True)
class MemoryPlan(OfPlacement):
    placement: Placement
    host: HostMemoryPlan
    gpu: GpuMemoryPlan
    knobs: object | None = None  # ScheduleKnobs (compile/), the words the placement came from (the fit report varies them)

    @property
    def spec(self) -> ModelSpec:
        return self.placement.model


def plan_host_memory(p: Placement, backend: str = "cuda") -> HostMemoryPlan:
    """Host bytes of the store (what `exec.store.HostStore` allocates), offloaded checkpoints, runtime; and the
    NVMe tier's bytes when the optimizer state is planned there."""
    spec, layout = p.model, p.host_layout
    names = host_component_names(layout)
    n = spec.num_params
    # the head streams its own copy when tied; resident layers are never streamed and land no gradients
    streamed = sum(spec.unit_params(u) for u in layout.host_tiled(spec.units()))
    state = 2 if p.state_dtype == "bf16" else 4
    grads = (layout.grad_ring * layout.ring_tile_elements if layout.grad_ring else streamed)
    components = {
        names["master"]: 4 * n,
        names["m"]: state * n,
        names["v"]: state * n,
        names["stream"]: 2 * streamed if p.weight_wire == "bf16" else 0,
        names["grads"]: p.wire_bytes("grad_wire") * grads,
    }
    if layout.grad_scratch_elements:
        components[names["grad_scratch"]] = 4 * layout.grad_scratch_elements
    if layout.state_scratch_elements:
        components[names["state_scratch"]] = 2 * 4 * layout.state_scratch_elements
    nvme = {}
    if p.state_tier != "host":  # on the drive; the host stages two units' state (one read, one written back)
        on_drive = [names["m"], names["v"]] + ([names["master"]] if p.state_tier == "nvme-all" else [])
        nvme = {k: components.pop(k) for k in on_drive}
        per_param = sum(nvme.values()) / n
        components["NVMe staging (2 units of state)"] = int(2 * per_param * max(spec.unit_params(u)
                                                                                 for u in spec.units()))
    if p.offloaded_checkpoints:
        components["offloaded checkpoints"] = (len(p.offloaded_checkpoints) * p.batch * p.seq * spec.hidden_size
                                               * p.wire_bytes("compute_dtype"))
    components["runtime overhead"] = RUNTIME_OVERHEAD_BYTES[backend]

    pinned = components[names["stream"]] + components[names["grads"]]
    pinned += components.get("offloaded checkpoints", 0)
    if p.weight_wire == "fp32":
        pinned += components[names["master"]]
    gpu_params = sum(spec.unit_params(u) for u in p.gpu_streamed_layers)
    if gpu_params:  # master (already pinned with an fp32 wire) and moments of the GPU-updated layers
        pinned += (0 if p.weight_wire == "fp32" else 4 * gpu_params) + 8 * gpu_params
    if backend == "cpu":
        pinned = 0
    return HostMemoryPlan(components, pinned, n, nvme)


def plan_placement(p: Placement, backend: str = "cuda", knobs=None) -> MemoryPlan:
    """Host and GPU memory of a placement (`program.placement`)."""
    return MemoryPlan(p, plan_host_memory(p, backend), plan_gpu_memory(p), knobs)


def gpu_rows(plan: MemoryPlan) -> list[tuple[str, int]]:
    """(label, bytes) of every GPU component: one row per buffer kind, the checkpoints, and the working set; the
    rows add up to `plan.gpu.peak_bytes`."""
    p, g = plan.placement, plan.gpu
    rows = []
    labels = {BufferKind.WEIGHTS: "weights + grads", BufferKind.STATE: "master+m+v+grad",
              BufferKind.KEPT_GRADS: "fp32 grads", BufferKind.RESIDENT: "master+m+v+grad"}
    ring = [b for b in p.buffers if b.kind is BufferKind.WEIGHTS and b.unit is None]
    if ring:
        rows.append((f"layer ring ({len(ring)} x {labels[BufferKind.WEIGHTS]})", sum(b.nbytes for b in ring)))
    for b in p.buffers:
        if b.kind is BufferKind.WEIGHTS and b.unit is not None:
            rows.append((f"{b.name} buffer ({labels[b.kind]})", b.nbytes))
    for kind, what in ((BufferKind.STATE, "state buffers"), (BufferKind.KEPT_GRADS, "kept-gradient buffers"),
                       (BufferKind.RESIDENT, "resident buffers")):
        group = [b for b in p.buffers if b.kind is kind]
        if group:
            rows.append((f"{what} ({len(group)} x {labels[kind]})", sum(b.nbytes for b in group)))
    rows.append(("activation checkpoints", g.checkpoint_bytes))
    if g.graph_bytes:
        rows.append((f"forward graphs kept (layers {min(p.graph_layers)}-{max(p.graph_layers)})", g.graph_bytes))
    rows.append(("RoPE tables (cos, sin)", g.rope_bytes))
    tiles = f", MLP tiles of {p.mlp_tile_tokens}" if p.mlp_tile_tokens else ""
    which = f"layer{tiles}" if g.working_bytes >= g.logits_bytes else "head + loss chunk"
    rows.append((f"working set (the larger: {which})", max(g.working_bytes, g.logits_bytes)))
    return rows


def format_plan(plan: MemoryPlan) -> str:
    """A readable table of host and GPU memory by component; each table's rows add up to its total."""
    s, h, g = plan.spec, plan.host, plan.gpu
    out = [f"model {s.name}: {s.num_params / 1e9:.3f} B parameters, {s.num_layers} layers; "
           f"batch {plan.batch} x seq {plan.seq}",
           "", f"{'host memory':<56}{'GiB':>10}{'B/param':>10}"]
    for name, b in h.components.items():
        out.append(f"  {name:<54}{b / GiB:>10.2f}{b / h.num_params:>10.2f}")
    out.append(f"  {'total':<54}{h.total_bytes / GiB:>10.2f}{h.total_bytes / h.num_params:>10.2f}")
    out.append(f"  {'of which pinned':<54}{h.pinned_bytes / GiB:>10.2f}{h.pinned_bytes / h.num_params:>10.2f}")
    if h.nvme:
        out += ["", f"{'NVMe tier (state_tier, planned only)':<56}{'GiB':>10}{'B/param':>10}"]
        for name, b in h.nvme.items():
            out.append(f"  {name:<54}{b / GiB:>10.2f}{b / h.num_params:>10.2f}")
    out += ["", f"{'GPU memory':<56}{'GiB':>10}"]
    for label, b in gpu_rows(plan):
        out.append(f"  {label:<54}{b / GiB:>10.2f}")
    out.append(f"  {'peak (the sum of the rows)':<54}{g.peak_bytes / GiB:>10.2f}")
    out.append(f"  {'  (layer working set / head + loss)':<54}{g.working_bytes / GiB:>5.2f} / "
               f"{g.logits_bytes / GiB:.2f}")
    return "\n".join(out)
