"""bf16 compute on CUDA against Hugging Face transformers (GPU only; skipped without CUDA).

A streamed step of megatrain in bf16 (bf16 weights streamed into the GPU slots, bf16 activations) against
`LlamaForCausalLM` / `Qwen2ForCausalLM` cast to bf16, with the same weights and tokens. Exact equality is not the
bar in bf16: both are compared with the same model in fp32, and megatrain's error must be no larger than 2x
HF's own bf16 error (plus a floor for quantities HF happens to get almost exactly). Run on the GPU machine with
`python -m pytest -m gpu tests/test_gpu_bf16_vs_hf.py -s`; the output is recorded in docs/executor.md.
"""
from __future__ import annotations

import pytest
import torch

from megatrain.exec.head import embed_forward, head_logits
from megatrain.io.hf_io import state_dict_from_tiles
from megatrain.exec.layers import decoder_layer
from megatrain.model.layout import unit_layout
from megatrain.exec.optim import AdamWConfig
from megatrain.exec.rope import rope_cos_sin
from megatrain.model.init import init_tiles
from megatrain.compile.knobs import knobs_for
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.engine.trainer import StreamedTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
import transformers  # a test dependency: missing, the suite fails (never skips)

SPECS = {
    "llama": ModelSpec("gpu-llama", "llama", 4096, 512, 1376, 4, 8, 2, 64, rms_norm_eps=1e-5),
    "qwen2": ModelSpec("gpu-qwen2", "qwen2", 4096, 512, 1376, 4, 8, 2, 64, rms_norm_eps=1e-6, rope_theta=1e6,
                       qkv_bias=True),
}
B, T = 2, 256
RATIO, FLOOR = 2.0, 2e-3


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def hf_model(spec: ModelSpec, sd: dict, dtype: torch.dtype):
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.load_state_dict(sd, strict=True)
    return model.to(device="cuda", dtype=dtype)


def hf_run(model, ids: torch.Tensor):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters()}
    return out.logits.detach().float(), out.loss.detach().float(), grads


def our_logits_bf16(spec: ModelSpec, tiles: dict, ids: torch.Tensor) -> torch.Tensor:
    """The executor's forward math in bf16 on CUDA (weights rounded to bf16 as the bf16 wire streams them)."""
    W = {u: unit_layout(spec, u).views(t.to("cuda", torch.bfloat16)) for u, t in tiles.items()}
    cos, sin = rope_cos_sin(spec, ids.shape[1], ids.device, torch.bfloat16)
    with torch.no_grad():
        x = embed_forward(W[EMBED]["embed_tokens.weight"], ids, torch.bfloat16)
        for layer in range(spec.num_layers):
            x = decoder_layer(W[layer], x, cos, sin, spec)
        return head_logits(W[HEAD], x, spec).float()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", list(SPECS))
def test_streamed_bf16_step_is_as_close_to_fp32_as_hf_bf16(arch, compiled):
    """compiled: the decoder layer through torch.compile (compile_layers=true); its gradients must be as close to
    fp32 HF as HF's own bf16 model is (fusion keeps more in fp32, never less)."""
    spec = SPECS[arch]
    tiles = init_tiles(spec, seed=0, std=0.02)
    g = torch.Generator().manual_seed(0)
    for u in (0, spec.num_layers - 1):  # norms and biases away from their init, so their gradients are tested
        for name, view in unit_layout(spec, u).views(tiles[u]).items():
            if view.dim() == 1:
                view.copy_(torch.randn(view.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    sd = state_dict_from_tiles(spec, tiles)
    ids = torch.randint(0, spec.vocab_size, (B, T), generator=g)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]

    ref_logits, ref_loss, ref_grads = hf_run(hf_model(spec, sd, torch.float32), ids.cuda())
    hf_logits, hf_loss, hf_grads = hf_run(hf_model(spec, sd, torch.bfloat16), ids.cuda())

    # No clipping: the fused update leaves the clip-scaled gradients in the landing space, and these are compared.
    knobs = knobs_for("double-buffer", compute_dtype="bf16", weight_wire="bf16", grad_wire="fp32", clip=0,
                      compile_layers=compiled)
    optim = AdamWConfig(lr=0.0, weight_decay=0.0)
    trainer = StreamedTrainer(spec, knobs, tiles, optim=optim, backend="cuda")
    result = trainer.step(ids, targets)
    ours_grads = state_dict_from_tiles(spec, {u: trainer.store.grad(u).float() for u in spec.units()})
    ours = {"logits": our_logits_bf16(spec, tiles, ids.cuda()), "loss": torch.tensor(result.loss),
            **{n: ours_grads[n].cuda() for n in ref_grads}}
    hf = {"logits": hf_logits, "loss": hf_loss, **hf_grads}
    ref = {"logits": ref_logits, "loss": ref_loss, **ref_grads}

    rows = [(k, rel_err(ours[k], ref[k]), rel_err(hf[k], ref[k])) for k in ref]
    worst = max(rows, key=lambda r: r[1] / max(r[2], FLOOR))
    print(f"\n{arch} {'compiled' if compiled else 'eager'}: {len(rows)} tensors; vs fp32 HF: "
          f"logits ours {rows[0][1]:.2e} / HF bf16 {rows[0][2]:.2e}, "
          f"loss {rows[1][1]:.2e} / {rows[1][2]:.2e}, worst ratio {worst[0]}: {worst[1]:.2e} / {worst[2]:.2e}")
    bad = [r for r in rows if r[1] > RATIO * max(r[2], FLOOR)]
    assert not bad, bad
