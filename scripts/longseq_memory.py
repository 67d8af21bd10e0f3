"""Measured GPU memory of one decoder layer's BACKWARD task and of the fused head + loss at long sequence lengths,
beside the planner's estimate (megatrain/plan/memory.py: `layer_working_set`, `head_working_set`).

For each sequence length the schedule's placement is resolved (MLP tiles, wires, compute dtype, loss chunk as a
training run would have them). The layer is bound to a flat slot in the weight wire dtype the way the executor binds
it; a forward (the F task) runs first, then the measured BACKWARD task: the recompute from the checkpoint and the
local backward, with the incoming gradient allocated inside the measured window (the planner counts it in the
working set; the slot, the checkpoint and the RoPE tables are rows of their own in the plan). The head is measured
the same way with the final hidden states inside the window. On CUDA the measurement is
torch.cuda.max_memory_allocated; on the CPU, where torch keeps no such count, the bytes of the storages that ops
create (live and peak, a TorchDispatchMode), which shows the script works but not what a GPU kernel allocates.

    PYTHONPATH=. python scripts/longseq_memory.py --model llama3-8b --seqs 8192,32768,131072,262144
    PYTHONPATH=. python scripts/longseq_memory.py --model debug --seqs 64,256 --set mlp_tile_tokens=32 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatrain.exec.head import head_loss_backward
from megatrain.exec.layers import layer_functions
from megatrain.model.llama.layer import attention
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.exec.store import TORCH_DTYPES
from megatrain.compile.knobs import resolve_knobs
from megatrain.plan.memory import head_working_set, layer_working_set, plan_placement
from megatrain.compile.resolve import resolve
from megatrain.model.presets import get_model
from megatrain.model.spec import HEAD
from megatrain.units import MiB, GiB



class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while active, live and peak (the CPU stand-in for the CUDA allocator's
    peak): each storage counts from the op that creates it until the last tensor viewing it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [tensors alive, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self._refs:
                    self._refs[key] = [0, t.untyped_storage().nbytes()]
                    self.live += self._refs[key][1]
                    self.peak = max(self.peak, self.live)
                self._refs[key][0] += 1
                weakref.finalize(t, self._release, key)
        return out

    def _release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]


class Meter:
    """Peak bytes allocated inside a `with` block above what was allocated when it began."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self._base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self._mode = LiveBytes().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.bytes = torch.cuda.max_memory_allocated() - self._base
        else:
            self._mode.__exit__(*exc)
            self.bytes = self._mode.peak


def _slot(layout, wire: torch.dtype, device) -> torch.Tensor:
    """A flat weight slot as the executor has it: small random weights, norms at 1."""
    flat = (torch.randn(layout.numel, device=device) * 0.02).to(wire)
    for sl in layout.slices:
        if sl.name.endswith("norm.weight"):
            flat[sl.offset:sl.offset + sl.numel].fill_(1.0)
    return flat


def measure_layer(p, device) -> int:
    """Peak bytes of one BACKWARD task of a layer beyond its slot, checkpoint and RoPE tables."""
    spec, B, T = p.model, p.batch // p.micro_batches, p.seq
    cd, wire = TORCH_DTYPES[p.compute_dtype], TORCH_DTYPES[p.weight_wire]
    layout = unit_layout(spec, 0)
    flat, grad_area = _slot(layout, wire, device), torch.zeros(layout.numel, device=device)
    x = torch.randn(B, T, spec.hidden_size, device=device, dtype=cd)  # the checkpoint (B, T, d)
    cos, sin = rope_cos_sin(spec, T, device, cd)
    forward, backward = layer_functions(p.compiled_layers, p.mlp_tile_tokens)

    def weights():  # what LayerCompute.weights binds: the slot, cast once when the wire differs
        return layout.views(flat if wire == cd else flat.to(cd))

    with torch.no_grad():
        del_y = forward(weights(), x, cos, sin, spec)  # the F task (and the compilation, if any)
    del del_y
    with Meter(device) as m:
        grad_out = torch.randn_like(x)  # (B, T, d), the gradient coming down
        grad_x = backward(weights(), x, cos, sin, spec, grad_out, layout.views(grad_area))
        del grad_out, grad_x
    return m.bytes


def measure_head(p, device) -> int:
    """Peak bytes of the fused head + loss beyond its slot: hidden states, their gradient, the logits chunks."""
    spec, B, T = p.model, p.batch // p.micro_batches, p.seq
    cd, wire = TORCH_DTYPES[p.compute_dtype], TORCH_DTYPES[p.weight_wire]
    layout = unit_layout(spec, HEAD)
    flat, grad_area = _slot(layout, wire, device), torch.zeros(layout.numel, device=device)
    targets = torch.randint(0, spec.vocab_size, (B, T), device=device)
    w = layout.views(flat)
    if wire != cd:  # as LayerCompute.weights: the norm cast, lm_head cast inside head_loss_backward
        w["norm.weight"] = w["norm.weight"].to(cd)
    with Meter(device) as m:
        x = torch.randn(B, T, spec.hidden_size, device=device, dtype=cd)  # the final hidden states
        loss, grad_x, _ = head_loss_backward(w, x, targets, spec, p.loss_chunk_tokens, 1.0 / (B * T),
                                             layout.views(grad_area))
        del x, grad_x, loss
    return m.bytes


def attention_kernels(spec, device) -> list[str]:
    """Names of the CUDA kernels one attention forward + backward of `spec` launches at 4096 tokens (flash, cuDNN,
    memory-efficient or math: which one the planner's flash terms describe)."""
    from torch.profiler import ProfilerActivity, profile

    layout, cd = unit_layout(spec, 0), torch.bfloat16
    w = layout.views(_slot(layout, cd, device))
    h = torch.randn(1, 4096, spec.hidden_size, device=device, dtype=cd, requires_grad=True)
    cos, sin = rope_cos_sin(spec, 4096, device, cd)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attention(w, h, cos, sin, spec).sum().backward()
        torch.cuda.synchronize()
    keys = ("flash", "fmha", "attention", "cudnn", "softmax", "bmm")
    return sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seqs", default="8192,32768,131072,262144", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--schedule", default="long-context", help="named schedule or TOML file")
    ap.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="override a schedule knob")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--no-head", action="store_true", help="measure the layer only")
    a = ap.parse_args()

    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          "cpu" if a.device == "auto" else a.device)
    spec = get_model(a.model)
    name, knobs = resolve_knobs(a.schedule, a.set)
    what = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "CPU: bytes of op-created storages"
    print(f"{spec.name}, batch {a.batch}, schedule {name}, device {device} ({what})")
    if device.type == "cuda":
        try:
            kernels = "; ".join(k[:80] for k in attention_kernels(spec, device))
        except RuntimeError as e:  # a diagnostic only: the profiler may be unavailable
            kernels = f"not listed ({e})"
        print("attention kernels (bf16, 4096 tokens):", kernels)
    head = f"{'seq':>8} {'tile':>6} {'phase':>6} {'measured MiB':>13} {'planned MiB':>12} {'ratio':>7}  "
    print(head + "planned step peak GiB   (layer: planned MLP / attention-backward moments, MiB)")
    rows = []
    for seq in (int(s) for s in a.seqs.split(",")):
        p = resolve(spec, a.batch, seq, knobs)
        step_peak = plan_placement(p).gpu.peak_bytes
        planned_moments = layer_working_set(p)
        moments = f"   ({planned_moments['mlp'] / MiB:.1f} / {planned_moments['attention'] / MiB:.1f})"
        phases = [("layer", measure_layer, max(planned_moments.values()))]
        if not a.no_head:
            phases.append(("head", measure_head, head_working_set(p)))
        for phase, measure, planned in phases:
            measured = measure(p, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            row = dict(seq=seq, mlp_tile_tokens=p.mlp_tile_tokens, phase=phase, measured_bytes=measured,
                       planned_bytes=planned, ratio=planned / measured if measured else float("nan"),
                       planned_step_peak_bytes=step_peak, planned_moments=planned_moments)
            rows.append(row)
            print(f"{seq:>8} {p.mlp_tile_tokens:>6} {phase:>6} {measured / MiB:>13.1f} {planned / MiB:>12.1f} "
                  f"{row['ratio']:>7.3f}  {step_peak / GiB:.2f}{moments if phase == 'layer' else ''}", flush=True)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / f"longseq_memory_{spec.name}.json"
        path.write_text(json.dumps(dict(model=spec.name, schedule=name, device=str(device), rows=rows), indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
