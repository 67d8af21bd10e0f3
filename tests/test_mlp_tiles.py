"""The decoder layer with its norm + MLP half in sequence tiles (`mlp_tile_tokens`, model/llama/layer.TiledNormMLP).

- numerics: tiled == untiled in fp32 (outputs, the input gradient and every weight gradient, to rounding), for
  Llama and Qwen2 shapes, tiles that cross sequence boundaries and a partial last tile; the layer against
  transformers with tiles is in tests/test_layers_vs_hf.py, whole training runs in tests/test_exec_training.py;
- memory: no (tokens, ffn) tensor of more than one tile is ever created, in the forward or the backward, and
  nothing of the graph outlives `layer_backward`;
- the resolver: tiles chosen from the tokens per micro-batch, the knob, its notes and the placement round trip.
"""
from __future__ import annotations

import weakref
from functools import partial

import pytest
import torch
from test_layers_vs_hf import _CreatedShapes, _llama, _qwen2

from megatrain.exec.layers import decoder_layer, layer_backward, layer_functions
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import ScheduleKnobs, knobs_for
from megatrain.ir.placement import Placement
from megatrain.compile.resolve import AUTO_MLP_TILE, AUTO_MLP_TILE_ABOVE, resolve
from megatrain.model.presets import PRESETS


def _layer(spec, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    layout = unit_layout(spec, 0)
    slot = torch.randn(layout.numel, generator=g) * 0.1
    x = torch.randn(batch, seq, spec.hidden_size, generator=g)
    grad_out = torch.randn(batch, seq, spec.hidden_size, generator=g)
    cos, sin = rope_cos_sin(spec, seq, "cpu", torch.float32)
    return layout, slot, x, grad_out, cos, sin


def _forward_backward(spec, layout, slot, x, grad_out, cos, sin, tile: int):
    w = layout.views(slot)
    forward, backward = layer_functions(False, tile)
    with torch.no_grad():
        y = forward(w, x, cos, sin, spec)
    grad_area = torch.zeros(layout.numel)
    grad_x = backward(w, x, cos, sin, spec, grad_out, layout.views(grad_area))
    return y, grad_x, grad_area


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("spec_fn,batch,seq,tile", [(_llama, 2, 13, 4), (_llama, 1, 16, 16 // 2),
                                                    (_qwen2, 3, 7, 5), (_qwen2, 2, 9, 1)])
def test_tiled_layer_equals_the_untiled_layer_in_fp32(spec_fn, batch, seq, tile):
    spec = spec_fn()
    args = _layer(spec, batch, seq)
    y0, gx0, gw0 = _forward_backward(spec, *args, tile=0)
    y1, gx1, gw1 = _forward_backward(spec, *args, tile=tile)
    layout = args[0]
    errs = {"output": _rel(y1, y0), "grad_x": _rel(gx1, gx0)}
    w0, w1 = layout.views(gw0), layout.views(gw1)
    errs.update({n: _rel(w1[n], w0[n]) for n in w0})
    assert all(w0[n].abs().max() > 0 for n in w0)  # every weight gradient is tested
    assert max(errs.values()) <= 1e-5, errs


def _ffn_rows(shapes, d: int, ffn: int) -> list[int]:
    """Tokens of every created tensor whose last dimension is the MLP's width (its intermediates, flattened or
    not), leaving out down_proj's (d, ffn) weight and its gradient."""
    return [s[-2] * (s[0] if len(s) == 3 else 1) for s in shapes if len(s) >= 2 and s[-1] == ffn and s != (d, ffn)]


def test_tiled_layer_never_creates_a_whole_sequence_mlp_intermediate():
    spec = _llama(intermediate_size=72)  # a width no other tensor of the layer has
    batch, seq, tile = 2, 24, 5
    layout, slot, x, grad_out, cos, sin = _layer(spec, batch, seq)
    w, acc = layout.views(slot), layout.views(torch.zeros(layout.numel))
    tiled = partial(decoder_layer, mlp_tile_tokens=tile)
    for fn in (tiled, decoder_layer):
        with _CreatedShapes() as rec:
            layer_backward(w, x, cos, sin, spec, grad_out, acc, layer=fn)
            with torch.no_grad():
                fn(w, x, cos, sin, spec)
        rows = _ffn_rows(rec.shapes, spec.hidden_size, spec.intermediate_size)
        if fn is tiled:
            assert rows and max(rows) <= tile, f"(tokens, ffn) tensors of {max(rows)} rows with tiles of {tile}"
        else:  # the check can fail: untiled, the intermediates span every token of the batch
            assert max(rows) == batch * seq


def test_tiled_layer_backward_leaves_no_graph():
    spec = _qwen2()
    layout, slot, x, grad_out, cos, sin = _layer(spec, 2, 10)
    saved = []

    class Box:
        def __init__(self, t):
            self.t = t

    def pack(t):
        box = Box(t)
        saved.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        grad_x = layer_backward(layout.views(slot), x, cos, sin, spec, grad_out, layout.views(torch.zeros(
            layout.numel)), layer=partial(decoder_layer, mlp_tile_tokens=3))
    assert saved and all(r() is None for r in saved), "tensors saved for backward outlive layer_backward"
    assert grad_x.grad_fn is None and not grad_x.requires_grad


def test_bf16_tiled_layer_stays_as_close_to_fp32_as_the_untiled_one():
    """In bf16 tiles round differently (per-tile weight gradients summed in fp32): no further from the fp32 layer
    than the untiled bf16 layer is, within a factor of 2."""
    spec = _llama()
    layout, slot, x, grad_out, cos, sin = _layer(spec, 2, 32)
    ref = _forward_backward(spec, layout, slot, x, grad_out, cos, sin, tile=0)
    bf = [t.to(torch.bfloat16) for t in (slot, x, grad_out, cos, sin)]
    errs = {}
    for tile in (0, 8):
        y, gx, gw = _forward_backward(spec, layout, bf[0], bf[1], bf[2], bf[3], bf[4], tile=tile)
        errs[tile] = max(_rel(y.float(), ref[0]), _rel(gx.float(), ref[1]), _rel(gw, ref[2]))
    assert errs[8] <= 2 * errs[0] + 1e-3, errs


# ---- the resolver -----------------------------------------------------------------------------------------------
def test_tiles_are_chosen_from_the_tokens_per_micro_batch():
    spec = PRESETS["llama3-8b"]
    assert resolve(spec, 16, 2048, knobs_for("overlap")).mlp_tile_tokens == 0  # today's benchmark shapes: untiled
    assert resolve(spec, 1, AUTO_MLP_TILE_ABOVE, knobs_for("long-context")).mlp_tile_tokens == 0
    p = resolve(spec, 1, 262144, knobs_for("long-context"))
    assert p.mlp_tile_tokens == AUTO_MLP_TILE and "MLP in tiles of 8192 tokens" in p.describe()
    # micro-batches: the tokens of one micro-batch decide
    assert resolve(spec, 4, 16384, knobs_for("overlap")).mlp_tile_tokens == AUTO_MLP_TILE
    assert resolve(spec, 4, 16384, knobs_for("overlap", micro_batches=2)).mlp_tile_tokens == 0
    # the knob: a size, or 0 = off at any length
    assert resolve(spec, 1, 4096, knobs_for("overlap", mlp_tile_tokens=1024)).mlp_tile_tokens == 1024
    assert resolve(spec, 1, 262144, knobs_for("long-context", mlp_tile_tokens=0)).mlp_tile_tokens == 0
    clamped = resolve(spec, 1, 4096, knobs_for("overlap", mlp_tile_tokens=4096))
    assert clamped.mlp_tile_tokens == 0 and any("mlp_tile_tokens=4096" in n for n in clamped.notes)
    with pytest.raises(ScheduleError, match="mlp_tile_tokens=-1 is invalid"):
        ScheduleKnobs(mlp_tile_tokens=-1)


def test_placement_round_trips_the_tile_and_old_programs_read_as_untiled():
    spec = PRESETS["debug"]
    p = resolve(spec, 2, 64, knobs_for("overlap", mlp_tile_tokens=32))
    assert Placement.from_dict(p.to_dict(), spec, 2, 64) == p
    old = p.to_dict()
    old.pop("mlp_tile_tokens")  # a Program written before the knob existed
    assert Placement.from_dict(old, spec, 2, 64).mlp_tile_tokens == 0


# ---- scripts/longseq_memory.py ----------------------------------------------------------------------------------
def test_longseq_memory_script_measures_and_compares_on_the_cpu(tmp_path):
    """The GPU measurement script runs on the CPU at small shapes: one row per length and phase, the planner's
    estimate beside the measured peak (here the bytes of op-created storages), the JSON log under $OUT."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "longseq_memory.py"
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(script.parent.parent)}
    out = subprocess.run([sys.executable, str(script), "--model", "debug", "--seqs", "512,2048", "--device", "cpu",
                          "--set", "mlp_tile_tokens=128"], capture_output=True, text=True, env=env, check=True).stdout
    assert "planned MiB" in out and "ratio" in out
    rows = json.loads((tmp_path / "longseq_memory_debug.json").read_text())["rows"]
    assert [(r["seq"], r["phase"]) for r in rows] == [(512, "layer"), (512, "head"), (2048, "layer"), (2048, "head")]
    assert all(r["mlp_tile_tokens"] == 128 for r in rows)
    # the tracked peak grows with the sequence, and the planner's estimate tracks it (loosely: CPU kernels differ)
    layer = [r for r in rows if r["phase"] == "layer"]
    assert layer[1]["measured_bytes"] > 2 * layer[0]["measured_bytes"]
    assert all(0.7 < r["ratio"] < 1.4 for r in rows), rows
