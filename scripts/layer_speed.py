"""Time one decoder layer's forward and local backward, eager against `torch.compile`, on the GPU.

The layer is bound to views of one flat buffer the way the executor binds a weight slot, with fp32 weights cast to
bf16 at use (`weight_wire=fp32`) or bf16 weights (`--wire bf16`). Prints a table of milliseconds per call and the
compile time, and checks that the compiled layer agrees with the eager one.

    PYTHONPATH=. python scripts/layer_speed.py --model bench-3b --batch 8 --seq 2048
"""
from __future__ import annotations

import argparse
import time

import torch

from megatrain.exec.layers import compiled_layer_functions, decoder_layer, layer_backward
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.model.presets import get_model


def _time(fn, reps: int) -> float:
    """Median milliseconds of `reps` calls of fn() (after the caller's warm-up), by CUDA events."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return sorted(out)[len(out) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench-3b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--wire", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()

    spec = get_model(a.model)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    layout = unit_layout(spec, 0)
    wire = torch.float32 if a.wire == "fp32" else bf16
    flat = (torch.randn(layout.numel, device=dev) * 0.02).to(wire)
    for sl in layout.slices:  # norms at 1, as an initialized model has them
        if sl.name.endswith("layernorm.weight"):
            flat[sl.offset:sl.offset + sl.numel].fill_(1.0)
    grad_flat = torch.zeros(layout.numel, device=dev)
    cos, sin = rope_cos_sin(spec, a.seq, dev, bf16)
    x = torch.randn(a.batch, a.seq, spec.hidden_size, device=dev, dtype=bf16)
    gy = torch.randn_like(x) * 1e-3

    def weights():  # what the executor binds: the slot cast to the compute dtype
        return layout.views(flat.to(bf16))

    rows = []
    variants = {"eager": (decoder_layer, layer_backward)}
    variants["compiled"] = compiled_layer_functions()
    results = {}
    for label, (fwd, bwd) in variants.items():
        t0 = time.perf_counter()
        with torch.no_grad():
            y = fwd(weights(), x, cos, sin, spec)
        g = bwd(weights(), x, cos, sin, spec, gy, layout.views(grad_flat))
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        for _ in range(2):  # warm-up
            with torch.no_grad():
                fwd(weights(), x, cos, sin, spec)
            bwd(weights(), x, cos, sin, spec, gy, layout.views(grad_flat))

        def run_fwd():
            with torch.no_grad():
                fwd(weights(), x, cos, sin, spec)

        f_ms = _time(run_fwd, a.reps)
        b_ms = _time(lambda: bwd(weights(), x, cos, sin, spec, gy, layout.views(grad_flat)), a.reps)
        grad_flat.zero_()
        g = bwd(weights(), x, cos, sin, spec, gy, layout.views(grad_flat))
        results[label] = (y.float(), g.float(), grad_flat.clone())
        rows.append((label, f_ms, b_ms, f_ms + b_ms, first_s))
    print(f"{spec.name} layer, batch {a.batch} x seq {a.seq}, weight wire {a.wire}, bf16 compute")
    # B is the executor's backward task: the recompute of the layer from its checkpoint, then the local backward.
    print(f"{'variant':<10} {'F ms':>8} {'B ms':>8} {'F+B ms':>9} {'first call s':>13}")
    for label, f, b, tot, first in rows:
        print(f"{label:<10} {f:8.2f} {b:8.2f} {tot:9.2f} {first:13.1f}")
    (ye, ge, we), (yc, gc, wc) = results["eager"], results["compiled"]

    def rel(a_, b_):
        return float((a_ - b_).norm() / b_.norm())

    print(f"compiled vs eager, relative L2: output {rel(yc, ye):.2e}, grad_x {rel(gc, ge):.2e}, "
          f"weight grads {rel(wc, we):.2e}")
    e, c = rows[0][3], rows[1][3]
    print(f"speed-up of a layer's F+B: {e / c:.3f}x ({e - c:.2f} ms saved per layer and step)")


if __name__ == "__main__":
    main()
