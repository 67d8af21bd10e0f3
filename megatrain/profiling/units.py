"""Compute times of one unit (a decoder layer, the embedding, the head) of a model shape, by tokens per task.

The bodies are the executor's task bodies (exec/compute.py `LayerCompute.forward / recompute / backward`) on slot-like
buffers: the unit's weights in the weight-wire dtype as ONE flat device buffer, bound by the executor's own
`exec.compute.bind_weights` (HF-named views, cast once per task when the wire dtype differs from the compute dtype),
an fp32 gradient area that the first micro-batch zeroes, random weights (the family's init rule, std 0.02) and
random activations. The results become the profile's `compute_tables`:

    F  layer forward / embedding gather / FH: head forward + loss + backward, fused and chunked
    R  layer recompute (the forward again, from the checkpoint)
    B  layer recompute-once + local backward / embedding scatter-add
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from megatrain.exec.backend import Backend
from megatrain.exec.compute import bind_weights
from megatrain.exec.head import embed_backward, embed_forward, head_loss_backward
from megatrain.exec.layers import layer_functions
from megatrain.model.init import init_tensor
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.exec.store import TORCH_DTYPES
from megatrain.compile.knobs import ScheduleKnobs
from megatrain.ir.tasks import COMPUTE_KINDS_OF_CLASS
from megatrain.sim.profile import ComputeTable, model_signature
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.profiling.bench import Worker, median

# The compute kinds each unit class runs, by letter (derived from ir/tasks.py).
KINDS_OF_CLASS = {c: tuple(k.value for k in kinds) for c, kinds in COMPUTE_KINDS_OF_CLASS.items()}
UNIT_OF_CLASS = {"layer": 0, "embed": EMBED, "head": HEAD}


class UnitSlot:
    """One unit's weights as a GPU slot holds them (flat, wire dtype) plus its fp32 gradient area."""

    def __init__(self, spec: ModelSpec, unit: int, knobs: ScheduleKnobs, backend: Backend, seed: int = 0):
        self.spec, self.unit, self.backend = spec, unit, backend
        self.layout = unit_layout(spec, unit)
        self.wire = TORCH_DTYPES[knobs.weight_wire]
        self.compute = TORCH_DTYPES[knobs.compute_dtype]
        self.compiled = knobs.compile_layers and unit not in (EMBED, HEAD)  # only the decoder layer is compiled
        n = self.layout.numel
        master = torch.empty(n, dtype=torch.float32, device=backend.device)  # initialized where it lives
        gen = torch.Generator(device=backend.device).manual_seed(seed)
        for name, view in self.layout.views(master).items():
            init_tensor(spec, name, view, gen, 0.02)
        self.w = backend.empty(n * self.wire.itemsize).view(self.wire)  # (numel,) as PREFETCH leaves it
        self.w.copy_(master)
        del master
        self.g = backend.empty(4 * n).view(torch.float32)  # (numel,) fp32 gradient area

    def weights(self) -> dict[str, torch.Tensor]:
        """The slot's weights bound as a task binds them (`exec.compute.bind_weights`)."""
        return bind_weights(self.layout, self.w, self.compute)

    def grads(self) -> dict[str, torch.Tensor]:
        """As `LayerCompute.grads` for micro-batch 0: the gradient area zeroed, then its views."""
        self.g.zero_()
        return self.layout.views(self.g)


def unit_bodies(slot: UnitSlot, batch: int, seq: int, chunk_tokens: int, seed: int = 0) -> dict[str, Callable]:
    """{kind: body()} of one unit's compute tasks on `batch` sequences of `seq` tokens (one micro-batch)."""
    spec, dev, cd = slot.spec, slot.backend.device, slot.compute
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    d = spec.hidden_size
    x = torch.randn(batch, seq, d, device=dev, dtype=torch.float32, generator=gen).to(cd)  # (b, T, d)
    grad_out = (torch.randn(batch, seq, d, device=dev, dtype=torch.float32, generator=gen) * 1e-3).to(cd)
    ids = torch.randint(0, spec.vocab_size, (batch, seq), device=dev, generator=gen)  # (b, T)
    if slot.unit == EMBED:
        return {"F": lambda: embed_forward(slot.weights()["embed_tokens.weight"], ids, cd),
                "B": lambda: embed_backward(grad_out, ids, slot.grads()["embed_tokens.weight"])}
    if slot.unit == HEAD:
        scale = 1.0 / ids.numel()
        return {"F": lambda: head_loss_backward(slot.weights(), x, ids, spec, chunk_tokens, scale, slot.grads())}
    cos, sin = rope_cos_sin(spec, seq, dev, cd)
    layer_forward, layer_backward = layer_functions(slot.compiled)

    def forward():
        return layer_forward(slot.weights(), x, cos, sin, spec)

    def backward():
        return layer_backward(slot.weights(), x, cos, sin, spec, grad_out, slot.grads())

    return {"F": forward, "R": forward, "B": backward}


def token_batches(batch: int, quick: bool) -> list[int]:
    """Sequences per task to measure: 1, 2, 4, ... up to `batch` (and `batch`); with `quick` just 1 and `batch`."""
    if quick:
        return sorted({1, batch})
    out, b = [], 1
    while b < batch:
        out.append(b)
        b *= 2
    return out + [batch]


def run_batches(batches: list[int], knobs: ScheduleKnobs) -> list[int]:
    """`batches` plus the sequences of one micro-batch of the run (the largest batch over `knobs.micro_batches`),
    the tokens per task the run's Program gives its compute tasks: a table measured there needs no interpolation."""
    micro = max(1, max(batches) // knobs.micro_batches)
    return sorted(set(batches) | {micro})


def layer_variants(uclass: str, knobs: ScheduleKnobs) -> list[bool]:
    """Compiled or not, the variants of a unit class to measure: a decoder layer with `compile_layers` both
    (eager too: so a profile prices the choice between them, and the eager fallback is measured, not assumed);
    every other unit eager (only the decoder layer is ever compiled)."""
    return [False, True] if uclass == "layer" and knobs.compile_layers else [False]


def measure_unit(spec: ModelSpec, uclass: str, knobs: ScheduleKnobs, seq: int, batches: list[int],
                 backend: Backend, worker: Worker, budget_s: float,
                 quick: bool = False) -> tuple[list[ComputeTable], list[dict]]:
    """Compute tables of one unit class at one sequence length: median seconds per task for each token count
    (`batches` and the run's micro-batch, `run_batches`), compiled and eager where `layer_variants` says. With
    `quick`, the compiled layer only at the run's micro-batch: torch.compile builds a kernel set per shape (a
    llama3-8b layer's tables took 4.3 s eager only and 18.4 s with the compiled layer at one shape, H200), the run
    uses that one, and the table scales in proportion to tokens from it (ComputeTable.at).

    Returns the tables and the raw rows (every timing) for the measurement record."""
    micro = [max(1, max(batches) // knobs.micro_batches)]
    batches = run_batches(batches, knobs)
    variants = layer_variants(uclass, knobs)
    tables, raw = [], []
    for compiled in variants:
        t, r = _measure_variant(spec, uclass, replace(knobs, compile_layers=compiled), seq,
                                micro if compiled and quick else batches, backend, worker, budget_s / len(variants))
        tables += t
        raw += r
    return tables, raw


def _measure_variant(spec: ModelSpec, uclass: str, knobs: ScheduleKnobs, seq: int, batches: list[int],
                     backend: Backend, worker: Worker, budget_s: float) -> tuple[list[ComputeTable], list[dict]]:
    slot = worker.call(UnitSlot, spec, UNIT_OF_CLASS[uclass], knobs, backend)
    kinds = KINDS_OF_CLASS[uclass]
    dur: dict[str, list[float]] = {k: [] for k in kinds}
    raw = []
    for b in batches:
        bodies = worker.call(unit_bodies, slot, b, seq, knobs.loss_chunk_tokens)
        for k in kinds:
            times = worker.time_for(bodies[k], budget_s / (len(batches) * len(kinds)), warmup=2)
            dur[k].append(median(times))
            raw.append({"unit": uclass, "kind": k, "dtype": knobs.compute_dtype, "compiled": slot.compiled,
                        "seq": seq, "tokens": b * seq,
                        "median_s": median(times), "min_s": min(times), "reps": len(times)})
        del bodies
    del slot
    sig = model_signature(spec)
    compiled = knobs.compile_layers and uclass == "layer"
    tables = [ComputeTable(sig, k, uclass, seq, tuple(b * seq for b in batches), tuple(dur[k]), knobs.compute_dtype,
                           compiled) for k in kinds]
    return tables, raw


def analytic_flops(spec: ModelSpec, uclass: str, kind: str, batch: int, seq: int) -> float:
    """FLOPs the Program gives such a task (`ModelSpec.task_flops`, what the builder uses)."""
    return spec.task_flops(kind, UNIT_OF_CLASS[uclass], batch, seq)
