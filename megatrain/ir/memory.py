"""Memory planner: host and GPU bytes of a run, whether they fit, and which knob helps when they do not.

Host bytes per parameter (unique parameters; a tied lm_head counts once):

    fp32 master 4 + Adam m 4 + Adam v 4                      = 12
    + bf16 streaming copy 2        (weight_wire = "bf16"; with "fp32" the master itself is streamed)
    + gradient landing space 4 | 2 (grad_wire "fp32" | "bf16")

The streaming copy and the gradient landing space exist for every *streamed* parameter, so a tied model pays
them twice for the shared matrix (the head streams its own copy). Pinned: what DMA touches — the streaming copy
(or the master for fp32 wire), the gradients, the offloaded checkpoints, and the master and moments of units the
GPU optimizer updates.

The GPU figure is `program.plan_gpu_memory` (buffers, checkpoints, working set, logits chunk).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..spec import HEAD, ModelSpec
from .knobs import ScheduleKnobs, gpu_updated_layers, offloaded_checkpoints
from .program import GpuMemoryPlan, plan_gpu_memory

GiB = 2**30

# Gradients that land in bf16 are converted to fp32 for the update this many elements at a time, in one reused
# host buffer (a fresh fp32 copy per update page-faulted ~0.9 GB per Llama-3-8B layer and made the update 1.5x
# slower on the H200 host).
GRAD_SCRATCH_ELEMENTS = 1 << 26

# Components that are the host store itself (the rest of the host plan is outside it).
NOT_STORE = ("offloaded checkpoints", "runtime overhead")


def grad_scratch_elements(spec: ModelSpec) -> int:
    """fp32 elements of the gradient conversion buffer: the largest unit's own parameters, at most a chunk."""
    own = [spec.hidden_size if u == HEAD and spec.tie_word_embeddings else spec.unit_params(u) for u in spec.units()]
    return min(max(own), GRAD_SCRATCH_ELEMENTS)


# RSS of the process beyond the store: the torch/CUDA runtime, Python, the libraries. Measured on the GPU machine
# (docs/memory.md): a CUDA process with torch imported and a context created.
RUNTIME_OVERHEAD_BYTES = {"cuda": int(1.5 * GiB), "cpu": int(0.5 * GiB)}


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host bytes by component."""

    components: dict[str, int]
    pinned_bytes: int
    num_params: int

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
    spec: ModelSpec
    batch: int
    seq: int
    knobs: ScheduleKnobs
    host: HostMemoryPlan
    gpu: GpuMemoryPlan


def plan_host_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str = "cuda") -> HostMemoryPlan:
    n = spec.num_params
    streamed = sum(spec.unit_params(u) for u in spec.units())  # the head streams its own copy when tied
    grad_bytes = knobs.wire_bytes("grad_wire")
    components = {
        "fp32 master": 4 * n,
        "adam m (fp32)": 4 * n,
        "adam v (fp32)": 4 * n,
        "bf16 streaming copy": 2 * streamed if knobs.weight_wire == "bf16" else 0,
        f"gradients ({knobs.grad_wire})": grad_bytes * streamed,
    }
    if knobs.grad_wire == "bf16":
        components["fp32 gradient scratch"] = 4 * grad_scratch_elements(spec)
    act = knobs.wire_bytes("compute_dtype")
    if knobs.offload_checkpoints:
        n_ckpt = len(offloaded_checkpoints(spec, knobs))
        components["offloaded checkpoints"] = n_ckpt * batch * seq * spec.hidden_size * act
    components["runtime overhead"] = RUNTIME_OVERHEAD_BYTES[backend]

    pinned = components["bf16 streaming copy"] + components[f"gradients ({knobs.grad_wire})"]
    pinned += components.get("offloaded checkpoints", 0)
    if knobs.weight_wire == "fp32":
        pinned += components["fp32 master"]
    gpu_params = len(gpu_updated_layers(spec, knobs)) * spec.layer_params
    if gpu_params:  # master (already pinned with an fp32 wire) and moments of the GPU-updated layers
        pinned += (0 if knobs.weight_wire == "fp32" else 4 * gpu_params) + 8 * gpu_params
    if backend == "cpu":
        pinned = 0
    return HostMemoryPlan(components, pinned, n)


def plan_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str = "cuda") -> MemoryPlan:
    """Host and GPU memory of training `spec` at batch x seq with the schedule `knobs`."""
    return MemoryPlan(spec, batch, seq, knobs, plan_host_memory(spec, batch, seq, knobs, backend),
                      plan_gpu_memory(spec, batch, seq, knobs))


# ---- fitting ----------------------------------------------------------------------------------------------------
def host_alternatives(knobs: ScheduleKnobs) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the host bytes, each with a label saying what it costs."""
    alts = []
    if knobs.grad_wire == "fp32":
        alts.append(("grad_wire=bf16 (gradients travel and land in bf16)", replace(knobs, grad_wire="bf16")))
    if knobs.weight_wire == "bf16":
        alts.append(("weight_wire=fp32 (no bf16 copy; streams 2x the bytes)", replace(knobs, weight_wire="fp32")))
    if knobs.grad_wire == "fp32" and knobs.weight_wire == "bf16":
        alts.append(("grad_wire=bf16 and weight_wire=fp32", replace(knobs, grad_wire="bf16", weight_wire="fp32")))
    if knobs.offload_checkpoints:
        alts.append(("offload_checkpoints=false", replace(knobs, offload_checkpoints=False)))
    return alts


def gpu_alternatives(plan: MemoryPlan) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the GPU peak of `plan`, each with a label saying what it does."""
    k, alts = plan.knobs, []
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
    if k.state_buffers > 2 and gpu_updated_layers(plan.spec, k):
        alts.append(("state_buffers=2", replace(k, state_buffers=2)))
    return alts


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
        for label, knobs in alts:
            alt = plan_memory(plan.spec, plan.batch, plan.seq, knobs)
            alt_need = alt.host.total_bytes if what == "host" else alt.gpu.peak_bytes
            verdict = "fits" if alt_need <= have else "still short"
            lines.append(f"  - {label}: {alt_need / GiB:.1f} GiB ({verdict})")
        if what == "GPU" and plan.batch > 1:
            lines.append("  - or a smaller batch / shorter sequence")
    return ok, lines


def format_plan(plan: MemoryPlan) -> str:
    """A readable table of host and GPU memory by component."""
    s, h, g = plan.spec, plan.host, plan.gpu
    out = [f"model {s.name}: {s.num_params / 1e9:.3f} B parameters, {s.num_layers} layers; "
           f"batch {plan.batch} x seq {plan.seq}",
           "", f"{'host memory':<34}{'GiB':>10}{'B/param':>10}"]
    for name, b in h.components.items():
        out.append(f"  {name:<32}{b / GiB:>10.2f}{b / h.num_params:>10.2f}")
    out.append(f"  {'total':<32}{h.total_bytes / GiB:>10.2f}{h.total_bytes / h.num_params:>10.2f}")
    out.append(f"  {'of which pinned':<32}{h.pinned_bytes / GiB:>10.2f}")
    out += ["", f"{'GPU memory':<34}{'GiB':>10}"]
    ring = {k: v for k, v in g.slot_bytes.items() if k.startswith("w")}
    if ring:
        out.append(f"  {f'layer buffers ({len(ring)} x weights+grads)':<32}{sum(ring.values()) / GiB:>10.2f}")
    for k in ("embed", "head", "s0", "s1"):
        if k in g.slot_bytes:
            out.append(f"  {k + ' buffer':<32}{g.slot_bytes[k] / GiB:>10.2f}")
    out.append(f"  {'activation checkpoints':<32}{g.checkpoint_bytes / GiB:>10.2f}")
    out.append(f"  {'layer working set':<32}{g.working_bytes / GiB:>10.2f}")
    out.append(f"  {'head logits chunk':<32}{g.logits_bytes / GiB:>10.2f}")
    out.append(f"  {'peak (buffers+ckpt+max(work,logits))':<32}{g.peak_bytes / GiB:>10.2f}")
    return "\n".join(out)
