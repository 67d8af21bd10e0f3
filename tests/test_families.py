"""Model families (megatrain/model/registry.py and one folder per family): lookup, the error for an unknown
model_type, HF config round trips (through transformers' own config classes), the numbers of today's presets
(FLOPs, parameters, working sets, signatures: written down before the families moved into folders), and a made-up
family whose last layer is wider than the others: the ring's slots hold the largest layer (not layer 0's size), and
the executor trains it on the CPU backend as transformers does (its LlamaForCausalLM with a wider MLP in that layer)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from megatrain.compile.knobs import knobs_for
from megatrain.compile.resolve import resolve
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.optim import AdamWConfig
from megatrain.io.hf_io import state_dict_from_tiles
from megatrain.ir.placement import BufferKind
from megatrain.model.init import init_tiles
from megatrain.model.llama.shape import LlamaFamily
from megatrain.model.presets import PRESETS
from megatrain.model.registry import family_of, register_family, registered_families
from megatrain.model.spec import EMBED, HEAD, ModelSpec, SpecError, spec_from_hf_config
from megatrain.plan.memory import head_working_set, layer_working_set
from megatrain.sim.profile import model_signature

BUILT_IN = ("llama", "mistral", "qwen2")


class WideLastFamily(LlamaFamily):
    """Test-only: the Llama shape with a last layer whose MLP is twice as wide (its own unit kind, "wide"). The last
    rather than the first, so that sizing anything by layer 0 is caught."""

    name = "test-widelast"

    def ffn_size(self, spec, layer):
        return 2 * spec.intermediate_size if layer == spec.num_layers - 1 else spec.intermediate_size

    def layer_kind(self, spec, layer):
        return "wide" if layer == spec.num_layers - 1 else "layer"


WIDE = register_family(WideLastFamily())
WIDE_SPEC = dataclasses.replace(PRESETS["debug"], name="debug-widelast", model_type=WIDE.name)
LAST = WIDE_SPEC.num_layers - 1


# ---- registry ------------------------------------------------------------------------------------------------------
def test_every_built_in_family_is_registered_under_its_model_type():
    assert set(BUILT_IN) <= set(registered_families())
    for name in BUILT_IN:
        assert family_of(name).name == name
    assert PRESETS["debug"].family is family_of("llama")
    assert PRESETS["qwen2.5-7b"].family is family_of("qwen2")
    with pytest.raises(ValueError, match="already registered"):
        register_family(WideLastFamily())  # another object under a taken name
    with pytest.raises(TypeError, match="lacks"):
        register_family(object())


@pytest.mark.parametrize("make", [
    lambda: family_of("gpt2"),
    lambda: dataclasses.replace(PRESETS["debug"], model_type="gpt2"),
    lambda: spec_from_hf_config({"model_type": "gpt2"}),
    lambda: spec_from_hf_config({"hidden_size": 64}),  # no model_type at all
])
def test_an_unknown_model_type_is_one_clear_error_naming_the_families(make):
    with pytest.raises(SpecError) as e:
        make()
    msg = str(e.value)
    assert "\n" not in msg and "is not supported" in msg
    assert all(name in msg for name in BUILT_IN), msg


# ---- HF config.json in and out -----------------------------------------------------------------------------------
def _spec_of(name: str) -> ModelSpec:
    base = PRESETS["qwen2.5-7b"] if name == "qwen2" else PRESETS["llama3-8b"]
    return dataclasses.replace(base, name=f"t-{name}", model_type=name, qkv_bias=family_of(name).qkv_bias_of({}))


@pytest.mark.parametrize("name", sorted(registered_families()))
def test_every_registered_family_round_trips_its_hf_config(name):
    spec = _spec_of(name)
    back = spec_from_hf_config(spec.to_hf_config(), name=spec.name)
    assert back == spec and back.to_dict() == spec.to_dict()


@pytest.mark.parametrize("name", BUILT_IN)
def test_transformers_reads_what_we_write_and_we_read_what_it_writes(name):
    import transformers  # a test dependency: missing, the suite fails (never skips)
    spec = _spec_of(name)
    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    assert type(cfg).__name__.lower().startswith(name)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (spec.hidden_size,
                                                                             spec.intermediate_size, spec.num_layers)
    assert spec_from_hf_config(cfg.to_dict(), name=spec.name) == spec


# ---- today's numbers (computed before the move into family folders) --------------------------------------------
EXPECTED = {  # name: (num_params, layer_params, FLOPs of F layer / B layer / F head / F embed on 2 x 2048 tokens,
              #        tiled-MLP extra FLOPs of a backward, signature)
    "llama3-8b": (8030261248, 218112000, (1855425871872.0, 5566277615616.0, 12910671691776.0, 0.0), 1443109011456.0,
                  "llama-d4096-f14336-h32x128-kv8-v128256"),
    "bench-3b": (2971315200, 99096576, (863288426496.0, 2589865279488.0, 2415919104000.0, 0.0), 618475290624.0,
                 "llama-d3072-f8192-h24x128-kv6-v32000"),
    "qwen2.5-7b": (7615616512, 233057792, (1969242505216.0, 5907727515648.0, 13393855512576.0, 0.0),
                   1668594794496.0, "qwen2-d3584-f18944-h28x128-kv4-v152064-qkvbias"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_flops_parameters_and_signatures_are_todays(name):
    s = PRESETS[name]
    params, layer, flops, tiled, signature = EXPECTED[name]
    assert (s.num_params, s.layer_params) == (params, layer)
    assert tuple(s.task_flops(k, u, 2, 2048) for k, u in (("F", 0), ("B", 0), ("F", HEAD), ("F", EMBED))) == flops
    assert s.tiled_mlp_flops(5, 2, 2048) == tiled
    assert model_signature(s) == signature
    assert s.kind_params() == {"layer": layer}


WORKING_SETS = {  # (name, knobs): (layer working set by moment, head working set) at 8 x 2048, schedule overlap
    ("llama3-8b", "default"): ({"mlp": 4934615040, "attention": 2587901952}, 2962227200),
    ("llama3-8b", "tiled-fp32-wire"): ({"mlp": 3214983168, "attention": 3024125952}, 4012900352),
    ("bench-3b", "default"): ({"mlp": 3068669952, "attention": 1811951616}, 841482240),
    ("bench-3b", "tiled-fp32-wire"): ({"mlp": 1895337984, "attention": 2010144768}, 1038090240),
}
KNOBS = {"default": {}, "tiled-fp32-wire": {"mlp_tile_tokens": 1024, "weight_wire": "fp32"}}


@pytest.mark.parametrize("name, knobs", sorted(WORKING_SETS))
def test_the_planner_working_sets_are_todays(name, knobs):
    p = resolve(PRESETS[name], 8, 2048, knobs_for("overlap", **KNOBS[knobs]))
    assert (layer_working_set(p), head_working_set(p)) == WORKING_SETS[(name, knobs)]


# ---- units of different sizes ------------------------------------------------------------------------------------
def test_a_family_with_a_wider_last_layer_sizes_ring_slots_for_its_largest_unit():
    s = WIDE_SPEC
    d, f = s.hidden_size, s.intermediate_size
    assert s.unit_params(LAST) - s.unit_params(0) == 3 * d * f  # gate, up and down twice as wide
    assert s.kind_params() == {"layer": s.unit_params(0), "wide": s.unit_params(LAST)}
    assert s.layer_params == s.unit_params(LAST) and s.unit_kind(LAST) == "wide" and s.unit_kind(0) == "layer"
    assert s.num_params == PRESETS["debug"].num_params + 3 * d * f
    assert s.unit_forward_flops(LAST, 1, 8) - s.unit_forward_flops(0, 1, 8) == 2.0 * 8 * 3 * d * f
    assert s.tiled_mlp_flops(LAST, 1, 8) == 2 * s.tiled_mlp_flops(0, 1, 8)
    # kept gradients for two layers, resident layers, state slots: each sized for what it holds
    p = resolve(s, 2, 16, knobs_for("overlap-split", gpu_optimizer_fraction=1.0, retain_grads=2, state_buffers=1,
                                    compute_dtype="fp32", weight_wire="fp32"))
    ring = [b for b in p.buffers if b.kind is BufferKind.WEIGHTS and b.unit is None]
    assert ring and all(b.numel == s.unit_params(LAST) for b in ring)
    assert all(b.numel == s.unit_params(LAST) for b in p.buffers if b.kind is BufferKind.STATE)
    kept = [b for b in p.buffers if b.kind is BufferKind.KEPT_GRADS]
    assert kept and all(b.numel == s.unit_params(b.unit) for b in kept)
    # the planner's working set follows the wider layer
    narrow = resolve(PRESETS["debug"], 2, 16, knobs_for("overlap"))
    assert layer_working_set(resolve(s, 2, 16, knobs_for("overlap")))["mlp"] > layer_working_set(narrow)["mlp"]


def _reference_losses(spec: ModelSpec, tiles, batches, lr: float) -> list[float]:
    """transformers' LlamaForCausalLM with the last layer's MLP twice as wide, plain AdamW (decay 0, no clipping)."""
    import transformers  # a test dependency: missing, the suite fails (never skips)
    from transformers.models.llama.modeling_llama import LlamaMLP

    hf_cfg = {k: v for k, v in spec.to_hf_config().items() if k not in ("model_type", "architectures")}
    cfg = transformers.LlamaConfig(**hf_cfg)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.model.layers[LAST].mlp = LlamaMLP(transformers.LlamaConfig(**{**hf_cfg, "intermediate_size":
                                                                      2 * spec.intermediate_size}))
    model.load_state_dict(state_dict_from_tiles(spec, tiles), strict=True)  # every tensor, of its own shape
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for ids, targets in batches:
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("schedule, extra", [
    ("overlap", {}),
    ("arrival", {"resident_layers": 2}),  # resident buffers hold their own layer's size
    ("overlap-split", {"gpu_optimizer_fraction": 1.0, "retain_grads": 2}),  # kept gradients, GPU state slots
])
def test_the_executor_trains_a_family_with_a_wider_last_layer(schedule, extra):
    spec, lr = WIDE_SPEC, 1e-3
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, spec.vocab_size, (2, 17), generator=g)  # (B, T+1)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    tiles = init_tiles(spec, seed=5, std=0.05)
    knobs = knobs_for(schedule, compute_dtype="fp32", weight_wire="fp32", clip=0.0, compile_layers=False, **extra)
    trainer = StreamedTrainer(spec, knobs, {u: t.clone() for u, t in tiles.items()},
                              optim=AdamWConfig(lr=lr, weight_decay=0.0), backend="cpu", timeout_s=30)
    losses = [trainer.step(ids, targets).loss for ids, targets in batches]
    assert all(torch.isfinite(torch.tensor(losses)))
    ref = _reference_losses(spec, tiles, batches, lr)
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (losses, ref)
