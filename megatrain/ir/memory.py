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
them twice for the shared matrix (the head streams its own copy). Pinned: what DMA touches — the streaming copy
(or the master for fp32 wire), the gradients, the offloaded checkpoints, and the master and moments of units the
GPU updates on streamed state.

GPU bytes: the placement's buffer table (weight ring, embedding and head, state, kept-gradient and resident
buffers), the activation checkpoints, the RoPE tables, and the larger of one layer's working set (its recompute +
backward, what autograd and the kernels hold at the peak) and the fused head + loss.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..spec import ModelSpec
from .dag import ScheduleError
from .knobs import ScheduleKnobs
from .placement import BufferKind, Placement, host_component_names
from .resolve import resolve

GiB = 2**30

# Components that are the host store itself (the rest of the host plan is outside it).
NOT_STORE = ("offloaded checkpoints", "runtime overhead")


# RSS of the process beyond the store: the torch/CUDA runtime, Python, the libraries. Measured on the GPU machine
# (docs/benchmarks.md): a CUDA process with torch imported and a context created.
RUNTIME_OVERHEAD_BYTES = {"cuda": int(1.5 * GiB), "cpu": int(0.5 * GiB)}


@dataclass(frozen=True)
class GpuMemoryPlan:
    """GPU bytes a Program needs: its buffers (by name), checkpoints, the working set of one task, head logits,
    and the RoPE tables of the step."""

    slot_bytes: dict[str, int]
    checkpoint_bytes: int
    working_bytes: int  # the layer phase: the peak of one layer's recompute + backward (`layer_working_set`)
    logits_bytes: int  # the head phase: fused head + loss (`head_working_set`)
    rope_bytes: int = 0  # cos and sin, (seq, head_dim) each in the compute dtype, for the whole step

    @property
    def buffers_bytes(self) -> int:
        return sum(self.slot_bytes.values())

    @property
    def peak_bytes(self) -> int:
        return (self.buffers_bytes + self.checkpoint_bytes + self.rope_bytes
                + max(self.working_bytes, self.logits_bytes))


def layer_working_set(p: Placement) -> dict[str, int]:
    """GPU bytes of one layer's BACKWARD task (recompute from its checkpoint + local backward), at the moments that
    can be the peak, beyond the buffers, the checkpoints and the RoPE tables. Per micro-batch of n tokens, a = bytes
    of the compute dtype, what the recompute saves for the backward (eager layer, `exec.layers`):

    - each RMSNorm: an fp32 copy of its input (4d per token; none in fp32, where the input itself is kept), the
      normalized value and the scaled output (a*d each);
    - SDPA (flash on CUDA): the rotated q and k, v and its output (a*(2q + 2kv)), fp32 logsumexp (4 per head);
      RoPE's products save only the tables, not q and k;
    - the MLP untiled: gate, silu(gate), up and their product (4a*ffn); tiled: only its input h (a*d);
    - around the call: the layer's output (alive until autograd.grad returns) and the incoming gradient (a*d each).

    Moments: "mlp" = the MLP's backward (untiled: at the product's backward, the gradients of the product, silu and
    up exist while the product is released: 6a*ffn; tiled: the full-length gradient of h plus one tile recomputed
    and differentiated); "attention" = the flash backward after the MLP's saved tensors are released: the
    accumulated gradient of h and of the attention output (a*d, a*q), the kernel's fp32 dq accumulator (4q) and
    softmax sums (4 per head), dq, dk, dv, and with grouped KV heads dk and dv expanded to every query head
    (2a*q). Each adds the layer's weights cast to the compute dtype (when the weight wire differs) and the weight
    gradients autograd returns (a per parameter), and the tiled MLP its fp32 weight-gradient sums.
    """
    spec, a, n = p.model, p.wire_bytes("compute_dtype"), p.tokens_per_micro
    d, f, q, kv, nh = spec.hidden_size, spec.intermediate_size, spec.q_dim, spec.kv_dim, spec.num_heads
    upcast = 4 * d if a < 4 else 0
    norm = upcast + 2 * a * d  # per token, saved by one RMSNorm and the projections after it
    attn = a * (2 * q + 2 * kv) + 4 * nh
    around = 2 * a * d  # the layer output and the gradient coming in
    weights = spec.layer_params * (a + (a if p.weight_wire != p.compute_dtype else 0))
    if p.mlp_tile_tokens:
        t = p.mlp_tile_tokens
        tile = t * (norm + 2 * a * d + 6 * a * f)  # the tile's norm, output and gradient, MLP at its product's backward
        mlp = n * (norm + attn + around + 2 * a * d) + tile + 4 * (3 * d * f + d)  # + h, its gradient; fp32 sums
    else:
        mlp = n * (2 * norm + attn + around + 6 * a * f)
    gqa_expand = 2 * a * q if spec.num_kv_heads != spec.num_heads else 0
    flash = 4 * q + 4 * nh + gqa_expand + a * (q + 2 * kv)
    attention = n * (norm + attn + around + a * d + a * q + flash)
    return {"mlp": mlp + weights, "attention": attention + weights}


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
    - head (`head_working_set`), plus the other micro-batches' hidden states.
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
    return GpuMemoryPlan({b.name: b.nbytes for b in p.buffers}, checkpoint, working, head, rope)


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
class MemoryPlan:
    placement: Placement
    host: HostMemoryPlan
    gpu: GpuMemoryPlan
    knobs: ScheduleKnobs | None = None  # the words the placement came from (the fit report varies them)

    @property
    def spec(self) -> ModelSpec:
        return self.placement.model

    @property
    def batch(self) -> int:
        return self.placement.batch

    @property
    def seq(self) -> int:
        return self.placement.seq


def plan_host_memory(p: Placement, backend: str = "cuda") -> HostMemoryPlan:
    """Host bytes of the store (what `exec.store.HostStore` allocates), offloaded checkpoints, runtime; and the
    NVMe tier's bytes when the optimizer state is planned there."""
    spec, layout = p.model, p.host_layout
    names = host_component_names(layout)
    n = spec.num_params
    streamed = sum(spec.unit_params(u) for u in spec.units())  # the head streams its own copy when tied
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


def plan_placement(p: Placement, backend: str = "cuda", knobs: ScheduleKnobs | None = None) -> MemoryPlan:
    """Host and GPU memory of a placement (`program.placement`)."""
    return MemoryPlan(p, plan_host_memory(p, backend), plan_gpu_memory(p), knobs)


def plan_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str = "cuda") -> MemoryPlan:
    """Host and GPU memory of training `spec` at batch x seq with the schedule `knobs`."""
    return plan_placement(resolve(spec, batch, seq, knobs), backend, knobs)


# ---- fitting ----------------------------------------------------------------------------------------------------
def knob_changes(knobs: ScheduleKnobs, alt: ScheduleKnobs) -> str:
    """The `--set` overrides that turn `knobs` into `alt` ("optimizer=arrival clip=0 ...")."""
    a, b = knobs.to_dict(), alt.to_dict()
    return " ".join(f"{k}={str(b[k]).lower() if isinstance(b[k], bool) else b[k]}" for k in b if a[k] != b[k])


def lean_knobs(knobs: ScheduleKnobs) -> ScheduleKnobs:
    """`knobs` changed to the 12 B/param layout: host updates as gradients land (arrival, no clipping), the fp32
    master streamed (no bf16 copy), gradients in a ring of two tiles."""
    return replace(knobs, optimizer="arrival", gpu_optimizer_fraction=None, state_buffers=None, state_lookahead=None,
                   retain_grads=0, clip=0, weight_wire="fp32", grad_ring=max(knobs.grad_ring, 2))


def host_alternatives(knobs: ScheduleKnobs) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the host bytes, least invasive first, each with a label saying what it costs."""
    alts = []
    if knobs is None:
        return alts
    if knobs.grad_wire == "fp32":
        alts.append(("gradients travel and land in bf16", replace(knobs, grad_wire="bf16")))
    if knobs.weight_wire == "bf16":
        alts.append(("no bf16 copy; streams 2x the bytes", replace(knobs, weight_wire="fp32")))
    if knobs.grad_wire == "fp32" and knobs.weight_wire == "bf16":
        alts.append(("both of the above", replace(knobs, grad_wire="bf16", weight_wire="fp32")))
    if knobs.offload_checkpoints:
        alts.append(("checkpoints stay on the GPU", replace(knobs, offload_checkpoints=False)))
    lean = lean_knobs(knobs)
    alts.append(("exact fp32 AdamW at 12 B/param: updates as gradients land into a 2-tile ring, no clipping", lean))
    # bf16 moments and the NVMe tier are for host updates only: no resident units
    host_only = replace(lean, resident_embeddings=False, resident_layers=0)
    alts.append(("8 B/param: adam m/v stored in bf16 (fp32 math; docs/precision.md)",
                 replace(host_only, state_dtype="bf16")))
    alts.append(("4 B/param on the host: adam m/v on the NVMe tier (planned only; `simulate` prices the drive)",
                 replace(host_only, state_tier="nvme-moments")))
    return [(f"{knob_changes(knobs, alt)} ({what})", alt) for what, alt in alts if alt != knobs]


def gpu_alternatives(plan: MemoryPlan) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the GPU peak of `plan`, each with a label saying what it does."""
    k, alts = plan.knobs, []
    if k is None:  # a placement made by hand: no knobs to vary
        return []
    for m in (2, 4, 8, 16):
        if k.micro_batches < m and plan.batch % m == 0:
            alts.append((f"micro_batches={m} (smaller working set per task)", replace(k, micro_batches=m)))
            break
    for r in (2, 4):
        if k.recompute_block < r and k.buffers >= r + 1:
            alts.append((f"recompute_block={r} (1/{r} of the checkpoints)", replace(k, recompute_block=r)))
            break
    if not k.offload_checkpoints:
        alts.append(("offload_checkpoints=true (checkpoints live on the host)", replace(k, offload_checkpoints=True)))
    if k.loss_chunk_tokens > 512:
        alts.append(("loss_chunk_tokens=512 (smaller logits chunk)", replace(k, loss_chunk_tokens=512)))
    if k.buffers > 2:
        alts.append((f"buffers={k.buffers - 1}", replace(k, buffers=k.buffers - 1)))
    if k.retain_grads:
        alts.append(("retain_grads=0 (GPU-updated layers' gradients go through the host)", replace(k, retain_grads=0)))
    if k.resident_layers:
        fewer = k.resident_layers // 2
        alts.append((f"resident_layers={fewer} (16 B/param less per layer streamed instead)",
                     replace(k, resident_layers=fewer)))
    if k.resident_embeddings:
        alts.append(("resident_embeddings=false (embedding and head streamed)", replace(k, resident_embeddings=False)))
    if (k.state_buffers or 0) > 2:
        alts.append(("state_buffers=2", replace(k, state_buffers=2)))
    return alts


def alternative_plans(plan: MemoryPlan, alts: list[tuple[str, ScheduleKnobs]], backend: str = "cuda"):
    """(label, MemoryPlan) of each alternative the resolver accepts (a change may break another knob's rule)."""
    for label, knobs in alts:
        try:
            yield label, plan_memory(plan.spec, plan.batch, plan.seq, knobs, backend)
        except ScheduleError:
            continue


def fit_report(plan: MemoryPlan, host_bytes: int | None, gpu_bytes: int | None) -> tuple[bool, list[str]]:
    """Whether the plan fits the given memory, and lines saying by how much it misses and which knob helps."""
    lines, ok = [], True
    checks = [("host", plan.host.total_bytes, host_bytes), ("GPU", plan.gpu.peak_bytes, gpu_bytes)]
    for what, need, have in checks:
        if have is None:
            lines.append(f"{what}: needs {need / GiB:.1f} GiB (capacity not given, not checked)")
            continue
        if need <= have:
            lines.append(f"{what}: fits: needs {need / GiB:.1f} GiB of {have / GiB:.1f} GiB "
                         f"({100 * need / have:.0f}%)")
            continue
        ok = False
        lines.append(f"{what}: DOES NOT FIT: needs {need / GiB:.1f} GiB, has {have / GiB:.1f} GiB, "
                     f"short by {(need - have) / GiB:.1f} GiB")
        alts = host_alternatives(plan.knobs) if what == "host" else gpu_alternatives(plan)
        fix = None
        for label, alt in alternative_plans(plan, alts):
            alt_need = alt.host.total_bytes if what == "host" else alt.gpu.peak_bytes
            verdict = "fits" if alt_need <= have else "still short"
            per_param = f", {alt.host.bytes_per_param:.2f} B/param in the store" if what == "host" else ""
            lines.append(f"  - {label}: {alt_need / GiB:.1f} GiB ({verdict}){per_param}")
            if fix is None and alt_need <= have:
                fix = (alt, alt_need)
        if what == "host" and fix is not None:
            alt, alt_need = fix
            exact = alt.placement.state_dtype == "fp32" and alt.placement.state_tier == "host"
            lines.append(f"  => fits {'with exact fp32 AdamW ' if exact else ''}with --set "
                         f"{knob_changes(plan.knobs, alt.knobs)}: {alt_need / GiB:.1f} GiB of {have / GiB:.1f} GiB "
                         f"({alt.host.bytes_per_param:.2f} B/param in the store)")
        if what == "GPU" and plan.batch > 1:
            lines.append("  - or a smaller batch / shorter sequence")
    return ok, lines


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
