"""Sliding-window attention on CUDA in bf16 against transformers (GPU only; skipped without CUDA).

A streamed bf16 step of a small Mistral with a window shorter than the sequence (and a Qwen2 whose every layer
slides), eager and compiled, against MistralForCausalLM / Qwen2ForCausalLM: both compared with transformers' fp32
model of the same weights, megatrain's error no larger than 2x transformers' own bf16 error (plus a floor), as
tests/test_gpu_bf16_vs_hf.py does for full attention. The window's positions are checked apart: logits beyond the
window must be as close as those inside it, which full attention would fail by far. Also: the planner's layer working
set (which counts the mask) is not exceeded by the measured peak of one layer's backward.
Run with `python -m pytest -m gpu tests/test_gpu_sliding_window.py -s`.
"""
from __future__ import annotations

import pytest
import torch

from megatrain.compile.knobs import knobs_for
from megatrain.compile.resolve import resolve
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.layers import layer_backward
from megatrain.exec.optim import AdamWConfig
from megatrain.exec.rope import rope_cos_sin
from megatrain.io.hf_io import state_dict_from_tiles
from megatrain.model.init import init_tiles
from megatrain.model.layout import unit_layout
from megatrain.model.spec import spec_from_hf_config
from megatrain.plan.memory import layer_working_set
from test_gpu_bf16_vs_hf import our_logits_bf16  # the executor's bf16 forward, written once for both GPU files

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
import transformers  # noqa: E402 (a missing reference fails the suite, never skips it)

CONFIGS = {
    "mistral": dict(model_type="mistral", vocab_size=4096, hidden_size=512, intermediate_size=1376,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                    sliding_window=64, max_position_embeddings=4096),
    "qwen2": dict(model_type="qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6,
                  use_sliding_window=True, sliding_window=100, max_window_layers=0, max_position_embeddings=4096),
}
B, T = 2, 256
RATIO, FLOOR = 2.0, 2e-3


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def hf_run(cfg: dict, sd: dict, dtype: torch.dtype, ids: torch.Tensor):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation="sdpa")
    model.load_state_dict(sd, strict=True)
    model = model.to(device="cuda", dtype=dtype)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), out.loss.detach().float(), {n: p.grad.float()
                                                                    for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_streamed_bf16_windowed_step_is_as_close_to_fp32_as_hf_bf16(arch, compiled):
    cfg = CONFIGS[arch]
    spec = spec_from_hf_config(cfg)
    W = spec.sliding_window
    assert W is not None and W < T
    tiles = init_tiles(spec, seed=0, std=0.02)
    sd = state_dict_from_tiles(spec, tiles)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]

    ref_logits, ref_loss, ref_grads = hf_run(cfg, sd, torch.float32, ids.cuda())
    hf_logits, hf_loss, hf_grads = hf_run(cfg, sd, torch.bfloat16, ids.cuda())
    knobs = knobs_for("double-buffer", compute_dtype="bf16", weight_wire="bf16", grad_wire="fp32", clip=0,
                      compile_layers=compiled)
    trainer = StreamedTrainer(spec, knobs, tiles, optim=AdamWConfig(lr=0.0, weight_decay=0.0), backend="cuda")
    result = trainer.step(ids, targets)
    ours_grads = state_dict_from_tiles(spec, {u: trainer.store.grad(u).float() for u in spec.units()})
    logits = our_logits_bf16(spec, tiles, ids.cuda())
    ours = {"logits inside": logits[:, :W], "logits beyond": logits[:, W:], "loss": torch.tensor(result.loss),
            **{n: ours_grads[n].cuda() for n in ref_grads}}
    hf = {"logits inside": hf_logits[:, :W], "logits beyond": hf_logits[:, W:], "loss": hf_loss, **hf_grads}
    ref = {"logits inside": ref_logits[:, :W], "logits beyond": ref_logits[:, W:], "loss": ref_loss, **ref_grads}
    rows = [(k, rel_err(ours[k], ref[k]), rel_err(hf[k], ref[k])) for k in ref]
    print(f"\n{arch} window {W} {'compiled' if compiled else 'eager'}: "
          + ", ".join(f"{k} {a:.2e}/{b:.2e}" for k, a, b in rows[:3]))
    bad = [r for r in rows if r[1] > RATIO * max(r[2], FLOOR)]
    assert not bad, bad


def test_the_planned_working_set_covers_a_windowed_layer_backward():
    """One layer's recompute + backward at T=2048 with a 512-token window (the mask is 8 MiB in bf16): the CUDA
    allocator's peak above what was allocated before stays within the planner's working set."""
    spec = spec_from_hf_config({**CONFIGS["mistral"], "sliding_window": 512})
    seq, batch = 2048, 2
    p = resolve(spec, batch, seq, knobs_for("overlap", compute_dtype="bf16", weight_wire="bf16"))
    planned = max(layer_working_set(p).values())
    tile = init_tiles(spec, seed=0, std=0.02)[0].to("cuda", torch.bfloat16)
    w = unit_layout(spec, 0).views(tile)
    grads = {n: torch.zeros(v.shape, device="cuda", dtype=torch.float32) for n, v in w.items()}
    x = torch.randn(batch, seq, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    cos, sin = rope_cos_sin(spec, seq, x.device, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    layer_backward(w, x, cos, sin, spec, grad_out, grads)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    print(f"\nwindowed layer backward: peak {peak / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    assert peak <= planned, (peak, planned)
