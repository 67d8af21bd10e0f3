"""Long sequences on the GPU (skipped without one): attention never falls back to SDPA's math kernel (the one that
materializes (T, T) scores), the planner's working set of a layer and of the head is within 5% of the measured
peak, and the compiled layer with MLP tiles agrees with the eager one. Run on the GPU machine with
`python -m pytest -q -s tests/test_longseq_cuda.py`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatrain.exec.layers import layer_functions
from megatrain.model.llama.layer import attention
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.compile.knobs import knobs_for
from megatrain.plan.memory import head_working_set, layer_working_set
from megatrain.compile.resolve import resolve
from megatrain.model.presets import PRESETS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LLAMA8B = PRESETS["llama3-8b"]


def _script():
    path = Path(__file__).parent.parent / "scripts" / "longseq_memory.py"
    spec = importlib.util.spec_from_file_location("longseq_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_runs_without_the_math_kernel_in_bf16():
    """With SDPA's math backend disabled the call as written still runs (flash / memory-efficient / cuDNN), and its
    forward + backward at 16384 tokens stays far below one (T, T) score matrix per head."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec, T = LLAMA8B, 16384
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    layout = unit_layout(spec, 0)
    w = layout.views((torch.randn(layout.numel, device=dev) * 0.02).to(bf16))
    h = torch.randn(1, T, spec.hidden_size, device=dev, dtype=bf16, requires_grad=True)
    cos, sin = rope_cos_sin(spec, T, dev, bf16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        y = attention(w, h, cos, sin, spec)
        y.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    scores = T * T * 2  # one head's bf16 (T, T) scores: 512 MiB; the math kernel would hold num_heads of them
    print(f"\nattention fwd+bwd at {T} tokens: peak {peak / 2**30:.2f} GiB")
    assert peak < 8 * scores  # flash needs a fraction of it; the math kernel num_heads x (32 x) and more


@pytest.mark.parametrize("seq,tile", [(32768, 8192), (65536, None)])
def test_planned_working_sets_are_within_5_percent_of_the_measured_peak(seq, tile):
    m = _script()
    knobs = knobs_for("long-context", weight_wire="fp32", loss_chunk_tokens=8192,
                      **({} if tile is None else dict(mlp_tile_tokens=tile)))
    p = resolve(LLAMA8B, 1, seq, knobs)
    assert p.mlp_tile_tokens == 8192
    dev = torch.device("cuda")
    layer = m.measure_layer(p, dev)
    torch.cuda.empty_cache()
    head = m.measure_head(p, dev)
    planned_layer, planned_head = max(layer_working_set(p).values()), head_working_set(p)
    print(f"\nllama3-8b seq {seq}: layer measured {layer / 2**30:.2f} GiB, planned {planned_layer / 2**30:.2f} "
          f"({planned_layer / layer:.3f}); head measured {head / 2**30:.2f}, planned {planned_head / 2**30:.2f} "
          f"({planned_head / head:.3f})")
    assert 0.95 <= planned_layer / layer <= 1.05
    assert 0.95 <= planned_head / head <= 1.05


def test_compiled_layer_with_mlp_tiles_agrees_with_the_eager_one():
    spec, B, T, tile = PRESETS["bench-3b"], 1, 8192, 2048
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    layout = unit_layout(spec, 0)
    flat = (torch.randn(layout.numel, device=dev) * 0.02).to(bf16)
    x = torch.randn(B, T, spec.hidden_size, device=dev, dtype=bf16)
    gy = torch.randn_like(x) * 1e-2
    cos, sin = rope_cos_sin(spec, T, dev, bf16)
    out = {}
    for compiled in (False, True):
        forward, backward = layer_functions(compiled, tile)
        with torch.no_grad():
            y = forward(layout.views(flat), x, cos, sin, spec)
        grad_area = torch.zeros(layout.numel, device=dev)
        gx = backward(layout.views(flat), x, cos, sin, spec, gy, layout.views(grad_area))
        out[compiled] = (y.float(), gx.float(), grad_area)
    for a, b in zip(out[False], out[True]):
        assert float((a - b).norm() / a.norm()) < 2e-2
