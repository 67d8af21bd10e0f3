"""The training loop (megatrain.train.loop) end to end on the CPU backend with the debug model and the bundled corpus:
run directory outputs, learning-rate schedule, per-unit seeded init, gradient accumulation, eval against HF
transformers, bit-exact resume (also after a crash past the last checkpoint), the memory check, and bad input
that must fail with one clear error before anything is lost."""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from megatrain.analysis.timeline import TIMELINE_COLUMNS
from megatrain.model.init import init_into, init_tiles, unit_seed
from megatrain.model.presets import PRESETS
from megatrain.model.spec import EMBED, HEAD, ModelSpec
from megatrain.train import fit
from megatrain.train import loop as training
from megatrain.io import safetensors_io as stio
from megatrain.io.checkpoint import CheckpointManager
from megatrain.io.errors import CheckpointError
from megatrain.train.command import (
    add_train_arguments,
    config_from_args,
    run_from_args,
)
from megatrain.train.config import ConfigError, OptimizerConfig
from megatrain.data.batches import DataError
from megatrain.train.errors import TrainingError
from megatrain.train.loop import (
    MemoryFitError,
    RunSummary,
    check_memory,
    lr_schedule,
    run_training,
)
from megatrain.train.metrics import (
    METRIC_KEYS,
    MetricsLogger,
    format_step_line,
    read_metrics,
)
from runconfigs import small_run

DEBUG = PRESETS["debug"]


def tiny(tmp_path: Path, *extra: str, name: str = "t"):
    """A run of a few small steps (fp32 compute: the CPU has no fast bf16)."""
    return small_run(tmp_path, "run.eval_every=3", "run.eval_batches=1", "run.checkpoint_every=0", "run.log_every=1",
                     "optimizer.lr=3e-3", *extra, name=name)


def train(cfg, **kw) -> tuple[RunSummary, list[str]]:
    lines: list[str] = []
    return run_training(cfg, log=lines.append, **kw), lines


def master_tiles(checkpoint: Path) -> dict:
    return CheckpointManager(checkpoint.parent).load(checkpoint).tensors


# ---- pieces ----------------------------------------------------------------------------------------------------
def test_lr_schedule_warmup_then_decay_to_min_lr():
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, decay="cosine")
    lr = [lr_schedule(opt, 20)(i) for i in range(20)]
    assert lr[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))  # decays monotonically after warmup
    assert lr[19] == pytest.approx(1e-4) and lr[4] == pytest.approx(1e-3)
    mid = 4 + (19 - 4) / 2  # cosine: halfway between peak and floor at half the decay
    assert lr_schedule(opt, 20)(mid) == pytest.approx(0.55e-3)
    lin = OptimizerConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, decay="linear")
    assert [lr_schedule(lin, 11)(i) for i in (0, 5, 10)] == pytest.approx([1e-3, 5e-4, 0.0])
    const = OptimizerConfig(lr=1e-3, warmup_steps=2, decay="constant")
    assert [lr_schedule(const, 10)(i) for i in (0, 1, 5, 9)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])


def test_init_is_per_unit_seeded_and_matches_hf_statistics():
    spec = ModelSpec(**{**DEBUG.to_dict(), "name": "q", "model_type": "qwen2", "qkv_bias": True,
                        "rope_scaling": DEBUG.rope_scaling})
    full = init_tiles(spec, seed=3, std=0.02)
    # Order of units and depth do not matter: reversed order, and a 2-layer cut, give the same units.
    rev = {u: torch.empty_like(t) for u, t in full.items()}
    init_into(spec, rev.__getitem__, seed=3, std=0.02, units=[HEAD, 3, 2, 1, 0, EMBED])
    assert all(torch.equal(rev[u], full[u]) for u in full)
    before = torch.get_num_threads()  # units are drawn in parallel threads, as many as torch's: 1 draws in order
    try:
        drawn = {}
        for threads in (1, 4):
            torch.set_num_threads(threads)
            drawn[threads] = init_tiles(spec, seed=3, std=0.02)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(drawn[1][u], full[u]) and torch.equal(drawn[4][u], full[u]) for u in full)
    cut = init_tiles(spec.with_layers(2), seed=3, std=0.02)
    assert all(torch.equal(cut[u], full[u]) for u in (EMBED, 0, 1, HEAD))
    assert not torch.equal(init_tiles(spec, seed=4)[0], full[0]) and unit_seed(3, 0) != unit_seed(3, 1)
    from megatrain.model.layout import unit_layout

    views = unit_layout(spec, 0).views(full[0])
    assert views["self_attn.q_proj.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert views["mlp.down_proj.weight"].mean().abs().item() < 0.002
    assert torch.equal(views["input_layernorm.weight"], torch.ones(spec.hidden_size))
    assert torch.equal(views["self_attn.q_proj.bias"], torch.zeros_like(views["self_attn.q_proj.bias"]))
    # Tied embeddings: a full head tile holds the embedding; a tail tile (the host store's) agrees on the norm.
    tied = ModelSpec(**{**DEBUG.to_dict(), "name": "tied", "tie_word_embeddings": True,
                        "rope_scaling": DEBUG.rope_scaling})
    t = init_tiles(tied, seed=1)
    n = tied.vocab_size * tied.hidden_size
    assert torch.equal(t[HEAD][:n], t[EMBED])
    tail = torch.empty(t[HEAD].numel() - n)
    init_into(tied, {HEAD: tail}.__getitem__, seed=1, units=[HEAD])
    assert torch.equal(tail, t[HEAD][n:])


def test_metrics_logger_keys_truncation_and_line(tmp_path):
    rec = dict(zip(METRIC_KEYS, (3, 2.5, None, 1e-3, 0.7, False, 0, 64, 0.1, 640.0, 1e-6, 12.5, 0.3, None, 1.0)))
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as m:
        for s in (1, 2, 3):
            m.write({**rec, "step": s, "loss": float("nan") if s == 3 else 2.0})
        with pytest.raises(ValueError, match="missing \\['eval_loss'\\]"):
            m.write({k: v for k, v in rec.items() if k != "eval_loss"})
    with open(path, "a") as f:
        f.write('{"step": 4, "loss"')  # a line torn by a kill
    rows = [json.loads(line) for line in path.read_text().splitlines()[:3]]
    assert [list(r) for r in rows] == [list(METRIC_KEYS)] * 3 and rows[2]["loss"] == "nan"
    MetricsLogger(path, keep_until=2).close()  # resume from step 2: later and torn lines go
    assert list(read_metrics(path)["step"]) == [1, 2]
    line = format_step_line(rec, total_steps=10)
    for part in ("step  3/10", "loss 2.5000", "lr 1.00e-03", "gnorm 0.700", "0.100 s/step", "640 tok/s",
                 "TFLOP/s", "GPU idle 12.5%", "host 0.30 GiB"):
        assert part in line, (part, line)
    assert "GPU 1.50 GiB" in format_step_line({**rec, "gpu_mem_gib": 1.5})
    assert " GPU " not in line.replace("GPU idle", "")  # no GPU memory column on the CPU backend


# ---- the run ---------------------------------------------------------------------------------------------------
def test_default_run_leaves_a_complete_run_directory(tmp_path):
    # The embedded default's path, small: simulation on, checkpoints, eval; loss must go down.
    cfg = tiny(tmp_path, "run.simulate=true", "run.steps=8", "run.checkpoint_every=4", "run.eval_every=4",
               "schedule.compute_dtype=bf16")
    s, lines = train(cfg)
    run = tmp_path / "runs" / "t"
    assert lines[0].startswith("config: model debug") and str(run / "config.toml") in lines[0]
    assert json.loads((run / "config.json").read_text()) == cfg.to_dict()
    assert any(line.startswith("memory: ") and "host: fits" in line for line in lines)
    assert any(line.startswith("predicted (cpu profile)") for line in lines)
    store = next(line for line in lines if line.startswith("host store: "))  # the store is what was planned
    assert store.split()[2] == store.split("(planned ")[1].split()[0], store
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == 8 and all("tok/s" in line and "GPU idle" in line for line in step_lines)
    table = lines[lines.index(next(line for line in lines if "measured (median)" in line)):]
    assert [t.split()[0] for t in table[1:4]] == ["time/step", "tokens/s", "GPU"]

    m = read_metrics(run / "metrics.jsonl")
    assert list(m["step"]) == list(range(1, 9)) and s.losses == list(m["loss"])
    assert m["eval_loss"].notna().tolist() == [False, False, False, True, False, False, False, True]
    assert m["loss"].iloc[-1] < m["loss"].iloc[0] - 0.1
    assert (m["tokens"] == 2 * 32).all() and (m["gpu_idle_pct"].between(0, 100)).all()
    assert m["model_tflops"].iloc[-1] == pytest.approx(DEBUG.model_flops_per_token() * m["tokens_per_s"].iloc[-1]
                                                       / 1e12)
    assert m["lr"].iloc[0] == pytest.approx(1.5e-3)  # warmup: step 1 of 2

    import pandas as pd

    tl = pd.read_csv(run / "timeline_measured.csv")
    assert list(tl.columns) == TIMELINE_COLUMNS and sorted(tl["step"].unique()) == list(range(1, 9))
    assert set(tl["source"]) == {"measured"} and set(pd.read_csv(run / "timeline_sim.csv")["source"]) == {"predicted"}
    trace = json.loads((run / "trace.json").read_text())
    pids = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert pids == {"predicted (cpu)", "measured (step 8)"}
    assert (run / "gantt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_00000004", "step_00000008"]
    assert s.checkpoint == run / "checkpoints" / "step_00000008" and s.steps == 8 and not s.stopped_early
    assert s.predicted is not None and s.measured_step_s > 0

    # A second fresh run with the same name never writes into the first one's directory.
    before = (run / "metrics.jsonl").read_text()
    s2, _ = train(tiny(tmp_path, "run.steps=1", "run.checkpoint_at_end=false"))
    assert s2.run_dir == tmp_path / "runs" / "t-1" and (run / "metrics.jsonl").read_text() == before


def test_resume_is_bit_exact_even_after_a_crash_past_the_last_checkpoint(tmp_path):
    extra = ("run.steps=6", "run.grad_accum=2", "run.eval_every=2", "run.checkpoint_every=2")
    straight, _ = train(tiny(tmp_path, *extra, name="straight"))
    # Session 1 stops after step 5 (checkpoints 2, 4, 5); then step 5's checkpoint is lost, as if the process
    # had been killed after step 5 but before saving it: resume goes back to step 4 and redoes step 5.
    first, _ = train(tiny(tmp_path, *extra, name="split"), stop_at_step=5)
    assert first.stopped_early and first.steps == 5
    run = tmp_path / "runs" / "split"
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_00000005")
    second, lines = train(tiny(tmp_path, *extra, "run.resume=latest", name="split"))
    assert second.start_step == 4 and any("resumed from" in line and "step_00000004" in line for line in lines)
    assert first.losses[:4] + second.losses == straight.losses  # bit-exact: float equality
    assert second.eval_losses == {k: v for k, v in straight.eval_losses.items() if k > 4}
    m = read_metrics(run / "metrics.jsonl")
    assert list(m["step"]) == [1, 2, 3, 4, 5, 6] and list(m["loss"]) == straight.losses
    a, b = master_tiles(straight.checkpoint), master_tiles(second.checkpoint)
    for kind in a:
        for u in a[kind]:
            assert torch.equal(a[kind][u], b[kind][u]), (kind, u)
    state = json.loads((second.checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["state"]["optimizer_steps"]["layers.0"] == 6
    assert state["state"]["data"]["index"] == 12  # 6 steps x 2 accumulated batches


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    # 2 accumulated batches of 2 draw the same windows as one batch of 4 (one shuffled order per epoch).
    acc, _ = train(tiny(tmp_path, "run.steps=3", "run.grad_accum=2", name="acc"))
    big, _ = train(tiny(tmp_path, "run.steps=3", "data.batch_size=4", name="big"))
    assert acc.tokens == big.tokens == 3 * 4 * 32
    assert acc.losses == pytest.approx(big.losses, rel=1e-5)
    assert big.losses[0] != pytest.approx(big.losses[1], rel=1e-3)  # the steps did train
    a, b = master_tiles(acc.checkpoint)["master"], master_tiles(big.checkpoint)["master"]
    assert all(torch.allclose(a[u], b[u], atol=1e-5) for u in a)


def test_eval_loss_matches_transformers_on_the_trained_weights(tmp_path):
    import transformers  # a test dependency: missing, the suite fails (never skips)
    from megatrain.exec.optim import AdamWConfig
    from megatrain.data.batches import open_data
    from megatrain.engine.trainer import StreamedTrainer

    cfg = tiny(tmp_path)
    data = open_data(cfg.data, DEBUG.vocab_size)
    trainer = StreamedTrainer(DEBUG, "overlap", init_tiles(DEBUG), optim=AdamWConfig(lr=1e-2), backend="cpu")
    # Random init (std 0.02): the logits are almost flat, so the loss is about ln(vocab).
    assert abs(training.evaluate(trainer, data, 1, 2) - math.log(256)) < 0.05
    b = data.train.next_batch()
    trainer.step(b.inputs, b.targets)
    loss = training.evaluate(trainer, data, 2, 2)  # must see the update "overlap" still has pending
    hf_cfg = transformers.LlamaConfig(**DEBUG.to_hf_config())
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(trainer.state_dict(), strict=False)
    with torch.no_grad():
        ref = [model(input_ids=e.inputs, labels=None).logits for e in data.eval_batches(2, 2)]
        tgt = [e.targets for e in data.eval_batches(2, 2)]
        want = sum(torch.nn.functional.cross_entropy(lg.flatten(0, 1), t.flatten(), reduction="sum")
                   for lg, t in zip(ref, tgt)) / sum(t.numel() for t in tgt)
    assert loss == pytest.approx(float(want), rel=1e-5)


def test_export_at_end_and_training_from_a_hf_directory(tmp_path):
    import transformers  # a test dependency: missing, the suite fails (never skips)
    export = tmp_path / "hf"
    s, lines = train(tiny(tmp_path, "run.steps=2", f"run.export_hf={export}"))
    assert s.export_dir == export and (export / "config.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
    from megatrain.io.hf_io import forward_logits

    tiles = {u: t for u, t in master_tiles(s.checkpoint)["master"].items()}
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, forward_logits(DEBUG, tiles, ids), atol=2e-2)
    # A run from the exported directory loads its (bf16) weights into the store, layer cut included.
    # The debug model's data is byte-level; a pretrained directory without a tokenizer needs that said explicitly.
    s2, lines2 = train(tiny(tmp_path, "run.steps=1", f"model.name={export}", "model.num_layers=2",
                            "data.tokenizer=bytes", name="ft"))
    assert any(f"weights: loaded from {export}" in line for line in lines2)
    assert s2.losses[0] < math.log(256)  # starts from the trained weights, not from scratch
    ft = master_tiles(s2.checkpoint)["master"]
    assert set(ft) == {EMBED, 0, 1, HEAD}


# ---- memory check ----------------------------------------------------------------------------------------------
def test_run_that_does_not_fit_stops_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(fit, "machine_capacity", lambda backend: (300 * 2**20, None))
    with pytest.raises(MemoryFitError) as e:
        train(tiny(tmp_path))
    msg = str(e.value)
    assert "does not fit this machine" in msg and "host: DOES NOT FIT: needs 0.5 GiB" in msg
    assert "--set schedule.<knob>" in msg and "model.num_layers" in msg
    assert not (tmp_path / "runs").exists()  # nothing created
    # GPU side (planned for the cuda backend, no GPU needed): the knobs that shrink the working set.
    big = PRESETS["llama3-8b"]
    from megatrain.compile.knobs import knobs_for

    with pytest.raises(MemoryFitError, match=r"GPU: DOES NOT FIT.*\n.*micro_batches=2") as e:
        check_memory(big, 8, 4096, knobs_for("overlap"), "cuda", host_bytes=2**40, gpu_bytes=8 * 2**30)
    assert "host: fits" in str(e.value)
    plan, lines = check_memory(big, 1, 512, knobs_for("overlap"), "cuda", host_bytes=2**40, gpu_bytes=80 * 2**30)
    assert plan.host.total_bytes > 16 * big.num_params and any("GPU: fits" in line for line in lines)


# ---- bad input: one clear error, nothing lost ------------------------------------------------------------------
def parse(*argv):
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args(list(argv))


def test_command_line_arguments_map_onto_the_config(tmp_path):
    sched = tmp_path / "mine.toml"
    sched.write_text('[schedule]\nname = "serial"\nbuffers = 2\n')
    cfg = config_from_args(parse("--model", "debug", "--steps", "7", "--batch", "4", "--seq", "16", "--lr", "0.01",
                                 "--schedule", str(sched), "--set", "recompute_block=1", "--set",
                                 "optimizer.min_lr=0.001", "--resume", "--no-progress", "--out-dir",
                                 str(tmp_path), "--name", "x"))
    assert (cfg.run.steps, cfg.data.batch_size, cfg.data.seq_len, cfg.optimizer.lr) == (7, 4, 16, 0.01)
    assert (cfg.schedule.name, cfg.schedule.buffers, cfg.schedule.optimizer) == ("serial", 2, "after")
    assert cfg.schedule.recompute_block == 1
    assert cfg.optimizer.min_lr == 0.001 and cfg.run.resume == "latest" and not cfg.run.progress
    assert config_from_args(parse("--resume", "some/dir")).run.resume == "some/dir"
    # Each mistake is one ConfigError naming the key.
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nsteps = 3\n")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        config_from_args(parse("--config", str(bad)))
    with pytest.raises(ConfigError, match="unknown key run.stepz"):
        config_from_args(parse("--set", "run.stepz=3"))
    with pytest.raises(ConfigError, match="run.steps must be an integer"):
        config_from_args(parse("--set", "run.steps=many"))
    with pytest.raises(ConfigError, match="unknown schedule"):
        config_from_args(parse("--schedule", "nope"))
    # The whole command: exit status 0 and a run directory.
    args = parse("--steps", "2", "--batch", "2", "--seq", "16", "--out-dir", str(tmp_path / "cli"),
                 "--set", "run.simulate=false", "--set", "compute_dtype=fp32", "--no-progress",
                 "--timeline", str(tmp_path / "last.csv"))
    assert run_from_args(args) == 0 and (tmp_path / "cli" / "debug" / "metrics.jsonl").is_file()
    import pandas as pd

    last = pd.read_csv(tmp_path / "last.csv")
    assert list(last.columns) == TIMELINE_COLUMNS and set(last["step"]) == {2} and last["start_s"].min() == 0


def test_bad_data_and_unwritable_directories_fail_before_anything_is_written(tmp_path):
    tokens = np.arange(200, 400, dtype=np.uint16)  # ids >= 256, the debug vocabulary
    (tmp_path / "t.bin").write_bytes(np.tile(tokens, 20).tobytes())
    with pytest.raises(DataError, match=r"token id 256 at .*t\.bin, token 56 is >= the model's vocab_size 256"):
        train(tiny(tmp_path, f"data.path={tmp_path / 't.bin'}"))
    assert not (tmp_path / "runs").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="is not writable"):
        train(tiny(tmp_path, f"run.out_dir={blocker}"))
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="run.export_hf=.*already exists"):
        train(tiny(tmp_path, f"run.export_hf={tmp_path / 'taken'}"))
    # (run.tensorboard needs no package: tests/test_cli_output.py reads its event files.)


def test_disk_full_at_a_checkpoint_keeps_the_previous_one_and_resume_continues(tmp_path, monkeypatch):
    real_write = stio._write
    calls = {"n": 0}

    def full_after_first_checkpoint(f, data):
        if "step_00000004" in getattr(f, "name", ""):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        calls["n"] += 1
        return real_write(f, data)

    monkeypatch.setattr(stio, "_write", full_after_first_checkpoint)
    cfg = tiny(tmp_path, "run.checkpoint_every=2")
    # The run stops there (issue 12: one message, the newest complete checkpoint, how to resume).
    with pytest.raises(TrainingError, match=r"step 4 was not saved: the disk is full.*step_00000002.*--resume"):
        train(cfg)
    run = tmp_path / "runs" / "t"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]
    assert list(read_metrics(run / "metrics.jsonl")["step"]) == [1, 2, 3, 4]
    monkeypatch.setattr(stio, "_write", real_write)
    s, _ = train(tiny(tmp_path, "run.checkpoint_every=2", "run.resume=latest"))
    straight, _ = train(tiny(tmp_path, "run.checkpoint_every=2", name="ref"))
    assert s.start_step == 2 and list(read_metrics(run / "metrics.jsonl")["loss"]) == straight.losses


def test_bad_resume_requests_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        train(tiny(tmp_path, "run.resume=latest"))
    s, _ = train(tiny(tmp_path, "run.steps=2"))
    with pytest.raises(ConfigError, match="is at step 2 and run.steps=2: nothing left"):
        train(tiny(tmp_path, "run.steps=2", "run.resume=latest"))
    with pytest.raises(CheckpointError, match="written for another model.*num_layers"):
        train(tiny(tmp_path, "model.num_layers=2", "run.resume=latest"))
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        train(tiny(tmp_path, f"run.resume={tmp_path}"))
    with pytest.raises(DataError, match="saved data cursor has windows=8682 but this run.s data has 17364"):
        train(tiny(tmp_path, "data.seq_len=16", "run.resume=latest"))
    # A damaged checkpoint (a truncated copy) is refused before anything is allocated or rewritten.
    import shutil

    bad = tmp_path / "copy" / "step_00000002"
    shutil.copytree(s.run_dir / "checkpoints" / "step_00000002", bad)
    with open(bad / "adam_v.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(CheckpointError, match=r"is damaged: .*adam_v.safetensors is truncated"):
        train(tiny(tmp_path, "run.steps=4", f"run.resume={bad}"))
    # None of that touched the run.
    assert [p.name for p in (s.run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    assert list(read_metrics(s.run_dir / "metrics.jsonl")["step"]) == [1, 2]
