"""Which knob helps: the knob changes that lower a plan's host or GPU bytes, and the fit report `plan`, `train` and
`auto` print. It varies the user's words (knobs) and re-resolves them, so it sits in the compiler, above the planner
(plan/ reads a Placement and never a knob)."""
from __future__ import annotations

from dataclasses import replace

from megatrain.compile.knobs import ScheduleKnobs
from megatrain.compile.resolve import resolve
from megatrain.ir.dag import ScheduleError
from megatrain.ir.placement import EXECUTED_STATE_TIERS
from megatrain.model.spec import ModelSpec
from megatrain.plan.memory import MemoryPlan, plan_placement
from megatrain.units import GiB


def plan_memory(spec: ModelSpec, batch: int, seq: int, knobs: ScheduleKnobs, backend: str = "cuda") -> MemoryPlan:
    """Host and GPU memory of training `spec` at batch x seq with the schedule `knobs`."""
    return plan_placement(resolve(spec, batch, seq, knobs), backend, knobs)


# ---- what `train` runs ----------------------------------------------------------------------------------------
# The executor keeps the optimizer state in host memory (exec/store.py HostStore refuses the NVMe tiers): the other
# state tiers are planned and simulated only. Advice for a command that trains never names them.
PLANNED_ONLY = "planned only: `train` refuses it until the executor has the NVMe tier; `simulate` prices the drive"


def trainable(knobs: ScheduleKnobs) -> bool:
    """Whether `train` runs `knobs` (False for a planned-only layout: the optimizer state on the NVMe tier)."""
    return knobs.state_tier in EXECUTED_STATE_TIERS


def refuse_planned_only(knobs: ScheduleKnobs) -> None:
    """ScheduleError, before anything is allocated, when `knobs` is a layout `train` does not run yet."""
    if not trainable(knobs):
        raise ScheduleError(f"state_tier={knobs.state_tier!r} is {PLANNED_ONLY}; train with state_tier=host "
                            "(`megatrain plan --host-gib N` lists the layouts that fit without it)")


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


def host_alternatives(knobs: ScheduleKnobs, planned: bool = False) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the host bytes, least invasive first, each with a label saying what it costs.
    Only layouts `train` runs, unless `planned` (for `plan`, which shows the planned-only ones labelled so)."""
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
    alts.append((f"4 B/param on the host: adam m/v on the NVMe tier; {PLANNED_ONLY}",
                 replace(host_only, state_tier="nvme-moments")))
    return [(f"{knob_changes(knobs, alt)} ({what})", alt) for what, alt in alts
            if alt != knobs and (planned or trainable(alt))]


def gpu_alternatives(plan: MemoryPlan) -> list[tuple[str, ScheduleKnobs]]:
    """Knob changes that lower the GPU peak of `plan`, each with a label saying what it does (none changes the
    state tier: each is as trainable as `plan`)."""
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


def fit_report(plan: MemoryPlan, host_bytes: int | None, gpu_bytes: int | None,
               planned: bool = False) -> tuple[bool, list[str]]:
    """Whether the plan fits the given memory, and lines saying by how much it misses and which knob helps. Every
    knob suggested is one `train` accepts; with `planned` (for `plan`) the planned-only layouts are listed too,
    labelled so, and never given as the "=> fits with --set" fix."""
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
        alts = host_alternatives(plan.knobs, planned) if what == "host" else gpu_alternatives(plan)
        fix = None
        for label, alt in alternative_plans(plan, alts):
            alt_need = alt.host.total_bytes if what == "host" else alt.gpu.peak_bytes
            verdict = "fits" if alt_need <= have else "still short"
            per_param = f", {alt.host.bytes_per_param:.2f} B/param in the store" if what == "host" else ""
            lines.append(f"  - {label}: {alt_need / GiB:.1f} GiB ({verdict}){per_param}")
            if fix is None and alt_need <= have and trainable(alt.knobs):
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
