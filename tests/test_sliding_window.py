"""Sliding-window attention (Mistral, Qwen2) against transformers, a reference nobody here wrote.

transformers' semantics (masking_utils.sliding_window_overlay + causal_mask_function): query t sees keys k with
t - W < k <= t, W tokens itself included; `sliding_window: null` is full attention; a Mistral config.json without
the key gets a 4096 window; Qwen2 slides only with `use_sliding_window`, in layers i >= max_window_layers.

The stateless layer math composed as the executor runs it (checkpoints without a graph, `layer_backward` from each,
top down), and the streaming executor itself, against MistralForCausalLM / Qwen2ForCausalLM in fp32: logits at
every position (inside the window and beyond it), the loss and every parameter gradient, relative error <= 1e-5.
Before windows were implemented, positions beyond the window differed from transformers (by up to 0.35 in the
issue's case); the first test checks that the window matters at all in these shapes, so equality is not vacuous.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from megatrain.compile.knobs import knobs_for
from megatrain.compile.resolve import resolve
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.optim import AdamWConfig
from megatrain.io.hf_io import forward_logits, state_dict_from_tiles, tiles_from_state_dict
from megatrain.model.init import init_tiles
from megatrain.model.spec import ModelSpec, SpecError, spec_from_hf_config
from megatrain.plan.memory import layer_working_set
from test_layers_vs_hf import composed_step  # the executor's step composed by hand, written once

import transformers  # a missing reference fails the suite, never skips it

TOL = 1e-5
T = 13  # positions 0..12; with W = 4 most of them are beyond the window

MISTRAL_CFG = dict(model_type="mistral", vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, sliding_window=4,
                   max_position_embeddings=64)
QWEN2_CFG = dict(model_type="qwen2", vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=1e6,
                 use_sliding_window=True, sliding_window=5, max_window_layers=0, max_position_embeddings=64)
CASES = {  # name: (config.json, HF attention implementation, mlp tile tokens)
    "mistral-gqa-sdpa": (MISTRAL_CFG, "sdpa", 0),
    "mistral-gqa-eager-tiled": (MISTRAL_CFG, "eager", 4),
    "mistral-mha-window2": ({**MISTRAL_CFG, "num_key_value_heads": 4, "sliding_window": 2}, "sdpa", 0),
    "qwen2-gqa-bias-sdpa": (QWEN2_CFG, "sdpa", 0),
    "qwen2-gqa-bias-eager-tiled": (QWEN2_CFG, "eager", 5),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def hf_model(cfg: dict, attn: str, seed: int = 0):
    """transformers' model of the config.json dict itself (not of our spec), every parameter random."""
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation=attn).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise if name.endswith("bias")
                    else 0.08 * noise)
    return model


def batch(vocab: int, b: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, T), generator=g)  # (B, T)
    targets = torch.full_like(ids, -100)
    targets[:, :-1] = ids[:, 1:]  # ours: next token; HF's labels=ids shift the same way
    return ids, targets


def test_the_window_changes_the_logits_beyond_it_only():
    """The comparison below can fail: full attention agrees with transformers inside the window and not beyond."""
    spec = spec_from_hf_config(MISTRAL_CFG)
    assert spec.sliding_window == 4
    model = hf_model(MISTRAL_CFG, "sdpa")
    ids, _ = batch(spec.vocab_size)
    ref = model(input_ids=ids).logits.detach()
    tiles = tiles_from_state_dict(spec, dict(model.state_dict()))
    full = forward_logits(dataclasses.replace(spec, sliding_window=None), tiles, ids)
    windowed = forward_logits(spec, tiles, ids)
    W = spec.sliding_window
    assert rel_err(full[:, :W], ref[:, :W]) <= TOL  # positions 0..W-1 see their whole context either way
    assert rel_err(full[:, W:], ref[:, W:]) > 1e-2  # beyond it, full attention is another model
    assert rel_err(windowed, ref) <= TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_every_gradient_match_transformers(case):
    cfg, attn, mlp_tile = CASES[case]
    spec = spec_from_hf_config(cfg)
    assert spec.sliding_window == cfg["sliding_window"]
    model = hf_model(cfg, attn)
    ids, targets = batch(spec.vocab_size)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    hf_grads = {n: p.grad for n, p in model.named_parameters()}

    tiles = tiles_from_state_dict(spec, dict(model.state_dict()))
    logits = forward_logits(spec, tiles, ids)
    loss, grad_tiles = composed_step(spec, tiles, ids, targets, chunk=5, micro=1, mlp_tile=mlp_tile)
    ours = state_dict_from_tiles(spec, grad_tiles)
    W = spec.sliding_window
    errs = {"logits inside": rel_err(logits[:, :W], out.logits[:, :W].detach()),
            "logits beyond": rel_err(logits[:, W:], out.logits[:, W:].detach()),
            "loss": rel_err(loss, out.loss.detach())}
    assert set(ours) == set(hf_grads)
    errs.update({n: rel_err(ours[n], hf_grads[n]) for n in hf_grads})
    assert max(errs.values()) <= TOL, {n: e for n, e in errs.items() if e > TOL}
    assert all(hf_grads[n].abs().max() > 0 for n in hf_grads)


@pytest.mark.parametrize("schedule", ["overlap", "long-context"])
def test_the_streaming_executor_trains_with_the_window_as_transformers_does(schedule):
    """Two AdamW steps of the executor (CPU backend) against MistralForCausalLM with torch's AdamW."""
    cfg, lr = MISTRAL_CFG, 1e-3
    spec = spec_from_hf_config(cfg)
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, spec.vocab_size, (2, T + 1), generator=g)  # (B, T+1)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    tiles = init_tiles(spec, seed=5, std=0.05)
    knobs = knobs_for(schedule, compute_dtype="fp32", weight_wire="fp32", clip=0.0, compile_layers=False)
    trainer = StreamedTrainer(spec, knobs, {u: t.clone() for u, t in tiles.items()},
                              optim=AdamWConfig(lr=lr, weight_decay=0.0), backend="cpu", timeout_s=30)
    losses = [trainer.step(ids, targets).loss for ids, targets in batches]

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                          attn_implementation="sdpa").float()
    model.load_state_dict(state_dict_from_tiles(spec, tiles), strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ref = []
    for ids, targets in batches:
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref.append(loss.item())
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (losses, ref)


# ---- transformers' reading of the config fields ---------------------------------------------------------------
@pytest.mark.parametrize("cfg", [
    {**MISTRAL_CFG, "sliding_window": None},  # null: full attention
    {k: v for k, v in MISTRAL_CFG.items() if k != "sliding_window"},  # absent: transformers' default, 4096
    {**MISTRAL_CFG, "sliding_window": 7},
    {**QWEN2_CFG, "use_sliding_window": False},  # the window is read only with use_sliding_window
    {**QWEN2_CFG, "max_window_layers": 2},  # no layer index >= 2: no layer slides
    {**QWEN2_CFG, "sliding_window": None},  # use_sliding_window with no window: every layer full
    {**QWEN2_CFG, "layer_types": ["sliding_attention", "sliding_attention"]},
    {**QWEN2_CFG, "layer_types": ["full_attention", "full_attention"]},
])
def test_the_window_is_read_as_transformers_reads_it(cfg):
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    hf_windows = {hf_cfg.sliding_window if getattr(hf_cfg, "layer_types", None) is None or t == "sliding_attention"
                  else None for t in (getattr(hf_cfg, "layer_types", None) or [None])}
    assert len(hf_windows) == 1
    spec = spec_from_hf_config(cfg)
    assert spec.sliding_window == hf_windows.pop()
    # what we write, transformers reads back as the same window (export writes sliding_window; null included)
    back = transformers.AutoConfig.for_model(**spec.to_hf_config())
    assert spec_from_hf_config(back.to_dict()) == spec
    assert spec_from_hf_config(spec.to_hf_config()) == spec


@pytest.mark.parametrize("cfg, words", [
    ({**QWEN2_CFG, "max_window_layers": 1}, "some layers only"),
    ({**QWEN2_CFG, "layer_types": ["full_attention", "sliding_attention"]}, "some layers only"),
    ({**QWEN2_CFG, "layer_types": ["sliding_attention"]}, "names 1 layers"),
    ({**QWEN2_CFG, "sliding_window": None, "layer_types": ["sliding_attention"] * 2}, "sliding_window is null"),
    ({**MISTRAL_CFG, "sliding_window": 0}, "sliding_window=0"),
    ({**MISTRAL_CFG, "sliding_window": -4}, "sliding_window=-4"),
    ({**MISTRAL_CFG, "sliding_window": "4"}, "sliding_window='4'"),
    ({**MISTRAL_CFG, "model_type": "llama"}, "sliding_window=4"),  # transformers' Llama would ignore it
])
def test_windows_megatrain_cannot_train_are_refused_by_name(cfg, words):
    with pytest.raises(SpecError, match=words) as e:
        spec_from_hf_config(cfg)
    assert "\n" not in str(e.value)


def test_a_spec_json_without_the_field_is_the_old_json_and_loads():
    spec = spec_from_hf_config(MISTRAL_CFG)
    d = spec.to_dict()
    assert d["sliding_window"] == 4 and ModelSpec.from_dict(d) == spec
    none = dataclasses.replace(spec, sliding_window=None)
    assert "sliding_window" not in none.to_dict()  # presets' and old checkpoints' JSON unchanged
    assert ModelSpec.from_dict(none.to_dict()) == none
    assert spec.family.signature(spec) != none.family.signature(none)  # the masked kernel has its own timings


def test_the_planner_counts_the_mask_when_one_is_built():
    """A window shorter than the sequence adds the (T, T) mask (rows padded to 16) and the expanded K/V; a window
    as long as the sequence builds no mask and costs nothing."""
    spec = spec_from_hf_config({**MISTRAL_CFG, "sliding_window": 100})
    knobs = knobs_for("overlap", compute_dtype="bf16")
    full = layer_working_set(resolve(dataclasses.replace(spec, sliding_window=None), 2, 256, knobs))
    assert layer_working_set(resolve(spec, 2, 256, dataclasses.replace(knobs))) != full
    long_window = layer_working_set(resolve(dataclasses.replace(spec, sliding_window=256), 2, 256, knobs))
    assert long_window == full
    windowed = layer_working_set(resolve(spec, 2, 256, knobs))
    n, a = 2 * 256, 2
    extra = 256 * 256 * a + n * 2 * a * (spec.q_dim - spec.kv_dim)
    assert {m: windowed[m] - full[m] for m in full} == {m: extra for m in full}


@pytest.mark.parametrize("source_window, spec_window", [(4, 4), (None, None), ("absent", 4096), ("absent", None)])
def test_export_writes_the_window_back(tmp_path, source_window, spec_window):
    """The export's config.json carries the spec's window, null included (an absent key is 4096 to transformers),
    whatever the source directory's config.json said."""
    from megatrain.io.hf_checkpoint import hf_config_for

    src = {k: v for k, v in MISTRAL_CFG.items() if k != "sliding_window"}
    if source_window != "absent":
        src["sliding_window"] = source_window
    (tmp_path / "config.json").write_text(json.dumps(src))
    spec = dataclasses.replace(spec_from_hf_config(MISTRAL_CFG), sliding_window=spec_window)
    cfg = hf_config_for(spec, torch.bfloat16, source=tmp_path)
    assert "sliding_window" in cfg and cfg["sliding_window"] == spec_window
    assert transformers.AutoConfig.for_model(**cfg).sliding_window == spec_window
    assert spec_from_hf_config(cfg) == dataclasses.replace(spec, dtype="bfloat16")
