"""`megatrain export CHECKPOINT OUT`, the export at the end of a resumed run, and the config.json of an export."""
from __future__ import annotations

import json

import pytest
import torch

from megatrain.cli import main
from megatrain.model.presets import PRESETS
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.hf_checkpoint import PROVENANCE_FILE, hf_config_for

DEBUG = PRESETS["debug"]


def toml(tmp_path, **run):
    """A run config file of the debug model, small, with extra [run] keys."""
    keys = {"name": "t", "out_dir": str(tmp_path / "runs"), "steps": 4, "checkpoint_every": 2, "eval_every": 0,
            "simulate": False, "progress": False, **run}
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
    path = tmp_path / "run.toml"
    path.write_text("[data]\nbatch_size = 2\nseq_len = 32\n[schedule]\ncompute_dtype = \"fp32\"\n"
                    f"[optimizer]\nwarmup_steps = 1\n[run]\n{body}\n")
    return path


def test_export_any_checkpoint_loads_in_transformers(tmp_path, capsys):
    import transformers  # a test dependency: missing, the suite fails (never skips)
    from megatrain.io.hf_io import forward_logits

    assert main(["train", "--config", str(toml(tmp_path, keep_last=0))]) == 0
    run = tmp_path / "runs" / "t"
    step2 = run / "checkpoints" / "step_00000002"
    assert main(["export", str(step2), str(tmp_path / "e2"), "--dtype", "fp32"]) == 0
    assert "step 2" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "e2").eval()
    master = CheckpointManager(step2.parent).load(step2).tensors["master"]
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, forward_logits(DEBUG, master, ids), atol=1e-4)
    assert not (tmp_path / "e2" / "tokenizer.json").exists()  # byte-level data: no tokenizer to ship
    # A run directory means its latest checkpoint; an existing OUT is one line, exit status 2.
    assert main(["export", str(run), str(tmp_path / "e4")]) == 0
    capsys.readouterr()
    prov = json.loads((tmp_path / "e4" / PROVENANCE_FILE).read_text())
    assert prov["step"] == 4 and prov["tokenizer"]["kind"] == "bytes"
    assert json.loads((tmp_path / "e4" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main(["export", str(run), str(tmp_path / "e4")]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and err.count("\n") == 1
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "e5")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_resume_with_the_same_toml_replaces_its_export_and_states_the_lr_change(tmp_path, capsys):
    path = toml(tmp_path, steps=2, export_hf=str(tmp_path / "hf"))
    assert main(["train", "--config", str(path)]) == 0
    assert json.loads((tmp_path / "hf" / PROVENANCE_FILE).read_text())["step"] == 2
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--set", "run.steps=4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / PROVENANCE_FILE).read_text())["step"] == 4
    # More steps move the decay: the learning rate of step 3 is not what the first session would have used.
    assert "note: the learning rate of step 3 changes from" in out and "run.steps (2 -> 4" in out
    assert "resumed from" in (tmp_path / "runs" / "t" / "train.log").read_text()  # the log file continues
    # Another run's directory at run.export_hf is still refused before anything runs.
    other = tmp_path / "other"
    other.mkdir()
    assert main(["train", "--config", str(path), "--set", f"run.export_hf={other}", "--set", "run.name=u"]) == 2
    assert "is not an export of this run" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "u").exists()


def test_an_unchanged_resume_states_nothing(tmp_path, capsys):
    path = toml(tmp_path, steps=4)
    assert main(["train", "--config", str(path), "--set", "run.checkpoint_every=2"]) == 0
    # Drop the last checkpoint: resume from step 2 with exactly the first session's config.
    import shutil

    shutil.rmtree(tmp_path / "runs" / "t" / "checkpoints" / "step_00000004")
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "learning rate" not in out


def test_export_config_is_derived_from_the_source_config(tmp_path):
    src = {"model_type": "llama", "bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0,
           "num_hidden_layers": 8, "layer_types": ["full_attention"] * 8, "rope_parameters": {"rope_theta": 1.0},
           "torch_dtype": "float32", "initializer_range": 0.01, "transformers_version": "4.57.0"}
    (tmp_path / "config.json").write_text(json.dumps(src))
    spec = DEBUG.with_layers(2)
    cfg = hf_config_for(spec, torch.bfloat16, tmp_path, defaults={"eos_token_id": 9, "bos_token_id": None})
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, [2, 3], 0)  # kept, not replaced
    assert cfg["num_hidden_layers"] == 2 and "layer_types" not in cfg  # per-layer fields of 8 layers dropped
    assert cfg["rope_theta"] == spec.rope_theta and "rope_parameters" not in cfg
    assert cfg["torch_dtype"] == "bfloat16" and cfg["initializer_range"] == 0.01
    assert "transformers_version" not in cfg
    assert hf_config_for(spec, torch.float32, None, defaults={"eos_token_id": 9})["eos_token_id"] == 9


def test_export_of_a_run_from_a_hf_directory_keeps_its_config_and_tokenizer(tmp_path, monkeypatch, capsys):
    import transformers  # noqa: F401 (a test dependency: missing, the suite fails, never skips)
    from test_examples import REPO, tiny_hf_dir

    model = tiny_hf_dir(tmp_path / "hf-model", REPO / "examples" / "data" / "sample.jsonl")
    monkeypatch.chdir(tmp_path)  # the run's paths are relative, as a user's would be
    path = toml(tmp_path, steps=1)
    assert main(["train", "--config", str(path), "--set", "model.name=hf-model", "--set", "model.num_layers=1",
                 "--set", f"data.path={REPO / 'examples' / 'data' / 'sample.jsonl'}", "--set", "data.seq_len=16"]) == 0
    assert main(["export", "runs/t", "out"]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["num_hidden_layers"]) == (1, 2, 1)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    # From elsewhere the relative model path is gone: an error, not an export without its tokenizer.
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "runs" / "t"), str(tmp_path / "out2")]) == 2
    assert "model directory 'hf-model' is not found" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()
