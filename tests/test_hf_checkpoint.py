"""Hugging Face directories: unit-by-unit load into tiles, export that transformers loads with the same logits."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatrain.io.hf_io import state_dict_from_tiles, tiles_from_state_dict
from megatrain.model.layout import unit_layout
from megatrain.model.presets import PRESETS
from megatrain.model.spec import HEAD, ModelSpec, load_hf_config
from megatrain.io.hf_checkpoint import (
    CheckpointError,
    export_hf,
    load_hf,
    load_hf_into,
    load_hf_tiles,
)

import transformers  # a test dependency: missing, the suite fails (never skips)
REPO = Path(__file__).resolve().parents[1]
DEBUG = PRESETS["debug"]
TIED_QWEN = ModelSpec("tiny-qwen", "qwen2", 256, 64, 128, 2, 4, 2, 16, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      qkv_bias=True, max_position_embeddings=256)


def hf_model(spec: ModelSpec, seed: int = 0):
    """A transformers model of `spec` with random weights (norms and biases randomized too, so a swap shows)."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = hf_model(DEBUG)
    path = tmp_path_factory.mktemp("hf") / "llama-debug"
    model.save_pretrained(path, max_shard_size="100KB")  # many shards + model.safetensors.index.json
    assert (path / "model.safetensors.index.json").is_file()
    return path, model


def test_load_multi_shard_matches_the_state_dict(llama_dir):
    path, model = llama_dir
    spec, tiles = load_hf(path)
    assert spec.num_layers == DEBUG.num_layers and spec.vocab_size == 256
    ref = tiles_from_state_dict(spec, model.state_dict())
    assert all(torch.equal(tiles[u], ref[u]) for u in spec.units())


def test_load_fills_the_given_tiles_in_place(llama_dir):
    path, model = llama_dir
    store = {u: torch.full((unit_layout(DEBUG, u).numel,), float("nan")) for u in DEBUG.units()}
    ptrs = {u: t.data_ptr() for u, t in store.items()}
    order = []
    load_hf_into(path, DEBUG, lambda u: order.append(u) or store[u])
    assert order == DEBUG.units()  # one unit after the other, in forward order
    assert all(store[u].data_ptr() == ptrs[u] for u in store)
    views = unit_layout(DEBUG, 2).views(store[2])
    assert torch.equal(views["mlp.up_proj.weight"], model.model.layers[2].mlp.up_proj.weight)


def test_fp32_export_gives_identical_logits(llama_dir, tmp_path):
    path, model = llama_dir
    spec, tiles = load_hf(path)
    out = export_hf(tmp_path / "export", spec, tiles, dtype=torch.float32, max_shard_bytes=150_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(model.state_dict())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(logits(reloaded, ids), logits(model, ids))


def test_bf16_export_is_sharded_and_matches_within_bf16(llama_dir, tmp_path):
    path, model = llama_dir
    spec, tiles = load_hf(path)
    out = export_hf(tmp_path / "export", spec, tiles, max_shard_bytes=60_000)  # bf16 by default
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_hf_config(out).vocab_size == 256
    from safetensors import safe_open
    shard = sorted(out.glob("model-*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # Exactly the logits of the original model with its weights rounded to bf16 ...
    rounded = hf_model(DEBUG)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits(reloaded, ids), logits(rounded, ids))
    # ... and within bf16 rounding of the fp32 original.
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), atol=0.05, rtol=0.02)
    # Loading the bf16 directory back gives the rounded weights.
    back = load_hf_tiles(out, spec)
    assert torch.equal(back[1], tiles[1].to(torch.bfloat16).float())


def test_tied_qwen2_round_trip_with_a_store_tile_without_lm_head(tmp_path):
    model = hf_model(TIED_QWEN, seed=3)
    src = tmp_path / "qwen"
    model.save_pretrained(src)
    lm_numel = unit_layout(TIED_QWEN, HEAD).slice_of("lm_head.weight").numel
    # Like the host store: the tied head's tile holds only its norm; the matrix lives once, in the embedding.
    store = {u: torch.empty(unit_layout(TIED_QWEN, u).numel - (lm_numel if u == HEAD else 0))
             for u in TIED_QWEN.units()}
    load_hf_into(src, TIED_QWEN, store.__getitem__)
    assert torch.equal(store[HEAD], model.model.norm.weight)
    assert torch.equal(unit_layout(TIED_QWEN, 0).views(store[0])["self_attn.q_proj.bias"],
                       model.model.layers[0].self_attn.q_proj.bias)
    out = export_hf(tmp_path / "export", TIED_QWEN, store, dtype=torch.float32, copy_tokenizer_from=src)
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # export writes no separate lm_head
    assert (out / "generation_config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(logits(reloaded, ids), logits(model, ids))
    # The same export as hf_io's state dict (the other path from tiles to HF names).
    full = load_hf_tiles(src, TIED_QWEN)
    sd = state_dict_from_tiles(TIED_QWEN, full)
    assert set(sd) == set(f for f in reloaded.state_dict() if f != "lm_head.weight")


def test_export_refuses_to_overwrite_unless_asked(llama_dir, tmp_path):
    path, _ = llama_dir
    spec, tiles = load_hf(path)
    (tmp_path / "x").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        export_hf(tmp_path / "x", spec, tiles)
    with pytest.raises(CheckpointError, match="not a megatrain export"):  # --overwrite replaces only an export
        export_hf(tmp_path / "x", spec, tiles, overwrite=True)
    export_hf(tmp_path / "y", spec, tiles)
    export_hf(tmp_path / "y", spec, tiles, overwrite=True)  # an earlier export is replaced
    assert (tmp_path / "y" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x", "y"]  # no temporary directory left behind


# ---- bad checkpoints ------------------------------------------------------------------------------------------
def copy_dir(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_truncated_shard_is_an_error_before_any_copy(llama_dir, tmp_path):
    path = copy_dir(llama_dir[0], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    calls = []
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated: .*tensor '") as e:
        load_hf_into(path, DEBUG, lambda u: calls.append(u))
    assert "copy or download it again" in str(e.value) and calls == []


def test_missing_shard_is_an_error(llama_dir, tmp_path):
    path = copy_dir(llama_dir[0], tmp_path / "m")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"names shard {shard.name}, which is missing"):
        load_hf(path)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path):
    path = copy_dir(llama_dir[0], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' in .* has shape "
                                              r"\(160, 64\), but config\.json implies \(128, 64\)"):
        load_hf(path)


def test_layer_count_mismatch_names_the_tensors(llama_dir, tmp_path):
    path = llama_dir[0]
    with pytest.raises(CheckpointError, match=r"does not have: \['model\.layers\.3\."):
        load_hf_tiles(path, DEBUG.with_layers(3))
    deeper = ModelSpec(**{**DEBUG.to_dict(), "num_layers": 5, "rope_scaling": DEBUG.rope_scaling})
    with pytest.raises(CheckpointError, match=r"has no tensor 'model\.layers\.4\.self_attn\.q_proj\.weight'"):
        load_hf_tiles(path, deeper)


def test_untied_checkpoint_without_lm_head_and_bad_dtypes(tmp_path):
    sd = {k: v.contiguous() for k, v in state_dict_from_tiles(DEBUG, tiles_from_state_dict(
        DEBUG, hf_model(DEBUG).state_dict())).items()}
    (tmp_path / "config.json").write_text(json.dumps(DEBUG.to_hf_config()))
    save_file({k: v for k, v in sd.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"has no tensor 'lm_head\.weight'"):
        load_hf(tmp_path)
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int8)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' in model\.safetensors is torch\.int8"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="only PyTorch pickle weights"):
        load_hf(tmp_path)


# ---- memory ---------------------------------------------------------------------------------------------------
# Peak RSS from the kernel's high-water mark of this process's memory (VmHWM), reset just before the load.
# (ru_maxrss would not do: Linux carries it over from the forking parent across exec.)
RSS_SCRIPT = textwrap.dedent("""
    import json, sys, psutil, torch
    import safetensors, safetensors.torch
    from megatrain.model.layout import unit_layout
    from megatrain.io.hf_checkpoint import load_hf_into
    from megatrain.model.spec import load_hf_config
    def hwm():
        line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    spec = load_hf_config(sys.argv[1])
    tiles = {u: torch.empty(unit_layout(spec, u).numel).fill_(0.0) for u in spec.units()}  # touched: resident
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = psutil.Process().memory_info().rss
    load_hf_into(sys.argv[1], spec, tiles.__getitem__)
    peak = hwm()
    print(json.dumps({"before": before, "peak": peak, "tiles": sum(t.numel() * 4 for t in tiles.values()),
                      "layer": unit_layout(spec, 0).numel * 4}))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_memory_is_about_one_layer_above_the_tiles(tmp_path):
    spec = ModelSpec("rss", "llama", 4096, 512, 1536, 8, 8, 8, 64)
    g = torch.Generator().manual_seed(0)
    weight_map, shard, size, k = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, k
        name = f"model-{k:05d}.safetensors"
        save_file(shard, tmp_path / name, metadata={"format": "pt"})  # the reference writer, bf16 as HF ships
        weight_map.update({n: name for n in shard})
        shard, size, k = {}, 0, k + 1

    for unit in spec.units():
        for local, shape in spec.unit_tensors(unit):
            t = torch.randn(shape, generator=g).to(torch.bfloat16)
            shard[spec.hf_name(unit, local)] = t
            size += t.numel() * 2
            if size > 20 * 2**20:
                flush()
    flush()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    proc = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout)
    extra = m["peak"] - m["before"]
    print(f"tiles {m['tiles'] / 2**20:.1f} MiB, one layer {m['layer'] / 2**20:.1f} MiB, "
          f"peak above tiles {extra / 2**20:.1f} MiB")
    assert m["tiles"] > 100 * 2**20
    assert extra < m["layer"] + 4 * 2**20  # about one layer, far from a second copy (the whole model)
