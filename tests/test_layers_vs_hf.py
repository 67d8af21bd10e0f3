"""The stateless layer math (megatrain.exec rope/layers/head/hf_io) against transformers, a reference nobody here
wrote: logits, loss and every parameter gradient of LlamaForCausalLM / Qwen2ForCausalLM with the same random
weights, fp32, relative error <= 1e-5 (max |ours - hf| / max |hf|, per tensor).

Our model is composed the way the streaming executor runs it: embed_forward -> decoder_layer per layer (inputs
kept as checkpoints, no graph) -> head_loss_backward (chunked) -> layer_backward from each checkpoint, top down ->
embed_backward, with every weight a view of a flat per-unit tile and every gradient accumulated into a flat fp32
tile. Run with `-s` to see the measured errors.
"""
from __future__ import annotations

import weakref
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatrain.exec.head import embed_backward, embed_forward, head_loss_backward
from megatrain.io.hf_io import forward_logits, state_dict_from_tiles, tiles_from_state_dict
from megatrain.io.errors import CheckpointError
from megatrain.exec.layers import decoder_layer, layer_backward
from megatrain.model.layout import unit_layout
from megatrain.exec.rope import rope_cos_sin
from megatrain.model.spec import EMBED, HEAD, ModelSpec, RopeScaling

import transformers  # a test dependency: missing, the suite fails (never skips)

TOL = 1e-5

# Small shapes that still exercise what matters: GQA (4 query heads on 2 KV heads), head_dim * heads != hidden,
# vocab not a power of two. llama3 with original_max_position_embeddings=64 puts the 8 frequencies of head_dim 16
# in all three of its bands (kept, blended, divided).
_LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)


def _llama(**kw) -> ModelSpec:
    base = dict(name="t-llama", model_type="llama", vocab_size=97, hidden_size=48, intermediate_size=80,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5)
    return ModelSpec(**{**base, **kw})


def _qwen2(**kw) -> ModelSpec:
    base = dict(name="t-qwen2", model_type="qwen2", vocab_size=89, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                qkv_bias=True)
    return ModelSpec(**{**base, **kw})


# name: (spec, attn_implementation, batch, seq, chunk_tokens, micro-batches)
CASES = {
    "llama-gqa-untied-sdpa": (_llama(), "sdpa", 2, 13, 7, 1),
    "llama-gqa-tied-llama3-eager": (_llama(tie_word_embeddings=True, rope_scaling=_LLAMA3), "eager", 2, 11, 5, 1),
    "llama-mha-linear-chunk>tokens": (_llama(num_kv_heads=4, rope_scaling=RopeScaling("linear", factor=2.0)),
                                      "sdpa", 2, 9, 1000, 1),
    "llama-gqa-untied-2micro": (_llama(num_layers=3), "sdpa", 2, 10, 3, 2),
    "qwen2-gqa-bias-tied-eager": (_qwen2(tie_word_embeddings=True), "eager", 2, 12, 5, 1),
    "qwen2-gqa-bias-untied-sdpa": (_qwen2(num_kv_heads=1), "sdpa", 3, 7, 4, 1),
}


# ---- helpers --------------------------------------------------------------------------------------------------
def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def make_hf_model(spec: ModelSpec, attn: str, seed: int = 0):
    """A random fp32 HF model of `spec`. Every parameter is randomized (norm weights around 1, biases nonzero)
    so that no gradient is trivially matched."""
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)
    return model


def make_batch(spec: ModelSpec, batch: int, seq: int, seed: int = 1):
    """ids (B, T); HF labels (= ids with a few -100); our targets (labels shifted left, last position -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    labels[-1, -2] = -100
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = labels[:, 1:]
    return ids, labels, targets


def composed_step(spec: ModelSpec, tiles: dict[int, torch.Tensor], ids, targets, chunk: int, micro: int,
                  mlp_tile: int = 0):
    """One step the executor's way over `micro` micro-batches (split along the batch); returns (mean loss,
    {unit: flat fp32 gradient tile}) with tied head gradients added into the embedding, as the runtime does.
    mlp_tile > 0: the layers' norm + MLP in tiles of that many tokens."""
    layer = partial(decoder_layer, mlp_tile_tokens=mlp_tile)
    grads = {u: torch.zeros_like(t) for u, t in tiles.items()}
    W = {u: unit_layout(spec, u).views(t) for u, t in tiles.items()}
    G = {u: unit_layout(spec, u).views(t) for u, t in grads.items()}
    total = int((targets != -100).sum())
    cos, sin = rope_cos_sin(spec, ids.shape[1], ids.device, torch.float32)
    loss_sum, counted = torch.zeros(()), 0
    for mb_ids, mb_targets in zip(ids.chunk(micro), targets.chunk(micro)):
        x = embed_forward(W[EMBED]["embed_tokens.weight"], mb_ids, torch.float32)
        checkpoints = []
        with torch.no_grad():
            for i in range(spec.num_layers):
                checkpoints.append(x)
                x = layer(W[i], x, cos, sin, spec)
        ls, g, n = head_loss_backward(W[HEAD], x, mb_targets, spec, chunk, 1.0 / total, G[HEAD])
        loss_sum, counted = loss_sum + ls, counted + n
        for i in reversed(range(spec.num_layers)):
            g = layer_backward(W[i], checkpoints[i], cos, sin, spec, g, G[i], layer=layer)
        embed_backward(g, mb_ids, G[EMBED]["embed_tokens.weight"])
    assert counted == total
    if spec.tie_word_embeddings:
        G[EMBED]["embed_tokens.weight"] += G[HEAD]["lm_head.weight"]
    return loss_sum / total, grads


def checkpoint_of(model, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The model's state dict as HF saves it: no lm_head.weight when the embeddings are tied."""
    sd = dict(model.state_dict())
    if spec.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


# ---- the reference comparison -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mlp_tile", [0, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_every_gradient_match_hf(case, mlp_tile):
    """mlp_tile=4: the same with every layer's norm + MLP in tiles of 4 tokens (tiles cross sequence boundaries,
    the last one partial)."""
    spec, attn, batch, seq, chunk, micro = CASES[case]
    torch.manual_seed(0)
    model = make_hf_model(spec, attn)
    ids, labels, targets = make_batch(spec, batch, seq)

    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}

    tiles = tiles_from_state_dict(spec, checkpoint_of(model, spec))
    logits = forward_logits(spec, tiles, ids)
    loss, grad_tiles = composed_step(spec, tiles, ids, targets, chunk, micro, mlp_tile)
    ours = state_dict_from_tiles(spec, grad_tiles)

    assert set(ours) == set(hf_grads), set(ours) ^ set(hf_grads)
    errs = {"logits": rel_err(logits, out.logits.detach()), "loss": rel_err(loss, out.loss.detach())}
    errs.update({n: rel_err(ours[n], hf_grads[n]) for n in hf_grads})
    worst = max(errs, key=errs.get)
    grad_worst = max((n for n in errs if n not in ("logits", "loss")), key=errs.get)
    print(f"\n{case} (mlp tile {mlp_tile}): logits {errs['logits']:.2e}  loss {errs['loss']:.2e}  "
          f"max grad {errs[grad_worst]:.2e} ({grad_worst})")
    assert errs[worst] <= TOL, {n: e for n, e in errs.items() if e > TOL}
    assert all(hf_grads[n].abs().max() > 0 for n in hf_grads)  # no parameter left untested by a zero gradient


@pytest.mark.parametrize("rope", [RopeScaling(), RopeScaling("linear", factor=4.0), _LLAMA3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_equal_hf_bitwise(rope, dtype):
    spec = _llama(rope_scaling=rope)
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    T = 300  # beyond the llama3 band edges of original_max_position_embeddings=64
    hf_cos, hf_sin = hf_rope(torch.zeros(1, dtype=dtype), torch.arange(T)[None])
    cos, sin = rope_cos_sin(spec, T, "cpu", dtype)
    assert cos.dtype == sin.dtype == dtype and cos.shape == (T, spec.head_dim)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])


# ---- properties of the executor's functions ---------------------------------------------------------------------
class _Saved:
    """A box for one tensor saved for backward, so that its lifetime can be watched with a weakref."""

    def __init__(self, t):
        self.t = t


def test_layer_backward_uses_slot_memory_and_leaves_no_graph(monkeypatch):
    spec = _qwen2()
    layout = unit_layout(spec, 0)
    slot = torch.randn(layout.numel) * 0.1  # a flat "GPU slot"
    grad_area = torch.zeros(layout.numel)
    w, acc = layout.views(slot), layout.views(grad_area)
    x = torch.randn(2, 6, spec.hidden_size)
    cos, sin = rope_cos_sin(spec, 6, "cpu", torch.float32)

    seen = {}
    real_grad = torch.autograd.grad

    def spy_grad(outputs, inputs, grad_outputs=None, **kw):
        seen["out"] = weakref.ref(outputs)
        seen["inputs"] = [weakref.ref(t) for t in inputs]
        seen["ptrs"] = [t.data_ptr() for t in inputs]
        return real_grad(outputs, inputs, grad_outputs, **kw)

    saved = []

    def pack(t):
        box = _Saved(t)
        saved.append(weakref.ref(box))
        return box

    monkeypatch.setattr(torch.autograd, "grad", spy_grad)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
        grad_x = layer_backward(w, x, cos, sin, spec, torch.randn_like(x), acc)

    # The leaves autograd differentiated are the slot's own memory (no copy), in layout order.
    assert seen["ptrs"][1:] == [w[n].data_ptr() for n in w]
    assert all(slot.data_ptr() <= p < slot.data_ptr() + slot.numel() * 4 for p in seen["ptrs"][1:])
    # Nothing of the graph is alive once it returns: output, leaves, and every tensor saved for backward.
    # (No gc.collect(): reference counting alone must free it, as it will on the executor's hot path.)
    assert saved and all(r() is None for r in saved), "tensors saved for backward outlive layer_backward"
    assert seen["out"]() is None and all(r() is None for r in seen["inputs"])
    assert grad_x.grad_fn is None and not grad_x.requires_grad and grad_x.shape == x.shape
    assert all(not v.requires_grad and v.grad is None for v in w.values())
    assert not grad_area.requires_grad and grad_area.abs().sum() > 0

    # Accumulation: a second call adds the same gradient again.
    first = grad_area.clone()
    monkeypatch.setattr(torch.autograd, "grad", real_grad)
    g = torch.randn_like(x, generator=torch.Generator().manual_seed(3))
    grad_area.zero_()
    layer_backward(w, x, cos, sin, spec, g, acc)
    once = grad_area.clone()
    layer_backward(w, x, cos, sin, spec, g, acc)
    assert torch.allclose(grad_area, 2 * once, rtol=1e-6, atol=0) and not torch.equal(once, first)


class _CreatedShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def test_head_never_materializes_all_logits():
    spec = _llama()
    B, T, chunk = 4, 32, 10
    V = spec.vocab_size
    layout = unit_layout(spec, HEAD)
    slot, grad_area = torch.randn(layout.numel) * 0.1, torch.zeros(layout.numel)
    x = torch.randn(B, T, spec.hidden_size)
    targets = torch.randint(0, V, (B, T))
    with _CreatedShapes() as rec:
        head_loss_backward(layout.views(slot), x, targets, spec, chunk, 1.0, layout.views(grad_area))
    weight_shapes = {(V, spec.hidden_size), (spec.hidden_size, V)}  # lm_head and its transpose are not logits
    vocab_rows = [s[0] for s in rec.shapes if len(s) == 2 and s[1] == V and s not in weight_shapes]
    assert vocab_rows and max(vocab_rows) <= chunk, f"(tokens, V) tensors of {max(vocab_rows)} rows were created"
    assert max((s[0] for s in rec.shapes if len(s) == 1), default=0) < B * T * V


def test_mixed_precision_fp32_weights_bf16_activations():
    spec = _qwen2()
    layout = unit_layout(spec, 0)
    slot = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)) * 0.1  # fp32 master, streamed
    w = layout.views(slot)
    x = torch.randn(2, 8, spec.hidden_size)
    cos, sin = rope_cos_sin(spec, 8, "cpu", torch.float32)
    cos16, sin16 = rope_cos_sin(spec, 8, "cpu", torch.bfloat16)
    g = torch.randn_like(x)

    ref = decoder_layer(w, x, cos, sin, spec)
    out = decoder_layer(w, x.bfloat16(), cos16, sin16, spec)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), ref) < 2e-2

    acc32, acc16 = torch.zeros(layout.numel), torch.zeros(layout.numel)
    gx32 = layer_backward(w, x, cos, sin, spec, g, layout.views(acc32))
    gx16 = layer_backward(w, x.bfloat16(), cos16, sin16, spec, g.bfloat16(), layout.views(acc16))
    assert gx16.dtype == torch.bfloat16 and acc16.dtype == torch.float32
    assert (gx16.float() - gx32).norm() / gx32.norm() < 3e-2
    assert (acc16 - acc32).norm() / acc32.norm() < 3e-2


def test_checkpoint_round_trip_and_errors():
    spec = _qwen2(tie_word_embeddings=True)
    model = make_hf_model(spec, "sdpa")
    sd = checkpoint_of(model, spec)
    back = state_dict_from_tiles(spec, tiles_from_state_dict(spec, sd))
    assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    half = state_dict_from_tiles(spec, tiles_from_state_dict(spec, sd), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    # Independent tensors (safetensors refuses shared storage).
    assert len({t.untyped_storage().data_ptr() for t in back.values()}) == len(back)

    missing = dict(sd)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        tiles_from_state_dict(spec, missing)
    wrong = dict(sd)
    wrong["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(3, 3\)"):
        tiles_from_state_dict(spec, wrong)
    untied = _qwen2()
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'"):
        tiles_from_state_dict(untied, sd)  # an untied model needs its own lm_head


def test_out_of_vocabulary_target_is_a_clear_error():
    spec = _llama()
    layout = unit_layout(spec, HEAD)
    slot, grad_area = torch.randn(layout.numel), torch.zeros(layout.numel)
    targets = torch.tensor([[1, 2, spec.vocab_size]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        head_loss_backward(layout.views(slot), torch.randn(1, 3, spec.hidden_size), targets, spec, 2, 1.0,
                           layout.views(grad_area))
