"""The loss-curve path of the peers (scripts/peers/peercurve.py, curves.py; docs/peers.md, "ZenFlow's loss curve"):
the all-on-GPU peer run on the CPU (`--device cpu`) and `megatrain train` of the config the peer writes
(`--megatrain-toml`) train the debug model on the bundled corpus on the same batches in the same order (checked
step by step on the input ids each side actually trains on), from the same init (megatrain's, loaded into the HF
model), with the same AdamW and clipping, so their losses agree within bf16 rounding; curves.py tabulates them."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "scripts" / "peers"
# 10 steps (2 warm-up + 8 timed) of the debug model, 4 x 32 tokens a step, a learning rate that moves the loss
SHAPE = ["--model", "debug", "--batch", "4", "--seq", "32", "--warmup", "2", "--steps", "8", "--clip", "1",
         "--lr", "1e-3", "--corpus", "--init", "megatrain"]


def _load(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PEERS_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # run_peer imports its siblings by name; curves' dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tools():
    for name in ("peerconf", "peercurve", "run_peer", "curves"):
        _load(name)
    return sys.modules["run_peer"], sys.modules["curves"], sys.modules["peercurve"]


@pytest.fixture(scope="module")
def both_runs(tools, tmp_path_factory):
    """(peer's losses file, megatrain's run directory, the digests of megatrain's batches as it trained on them)."""
    import megatrain.train.loop as loop
    from megatrain.train.config import load_config

    run_peer, _, peercurve = tools
    tmp = tmp_path_factory.mktemp("curves")
    losses, toml = tmp / "peer.json", tmp / "ref.toml"
    assert run_peer.main(["all-on-gpu", *SHAPE, "--device", "cpu", "--losses", str(losses)]) == 0
    assert run_peer.main(["all-on-gpu", *SHAPE, "--megatrain-toml", str(toml)]) == 0
    cfg = load_config(toml, [f"run.out_dir={tmp / 'runs'}", "run.device=cpu", "run.simulate=false"])
    seen = []
    original = loop._Training._next_batch

    def recording(self):  # what megatrain's loop really trains on, step by step
        ids, targets = original(self)
        seen.append(peercurve.batch_sha1(ids))
        return ids, targets

    loop._Training._next_batch = recording
    try:
        summary = loop.run_training(cfg, log=lambda line: None)
    finally:
        loop._Training._next_batch = original
    return losses, Path(summary.run_dir), seen


def test_the_peer_and_megatrain_train_on_the_same_batches_and_agree(both_runs):
    losses, run_dir, megatrain_digests = both_runs
    peer = json.loads(losses.read_text())
    assert [r["step"] for r in peer] == list(range(1, 11))  # warm-up included, 1-based
    assert [r["warmup"] for r in peer] == [True, True] + [False] * 8
    # the data order: the same input ids at every step, as each side trained on them
    assert [r["batch_sha1"] for r in peer] == megatrain_digests
    ref = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ref] == list(range(1, 11))
    # step 1: the same init and batch, before any update: bf16 rounding apart (HF autocast vs megatrain's kernels)
    assert peer[0]["loss"] == pytest.approx(ref[0]["loss"], abs=2e-3)
    # every step: the same AdamW, weight decay on the matrices, clipping at 1 (measured gap: ~1e-3 at loss ~5)
    for p, r in zip(peer, ref):
        assert p["loss"] == pytest.approx(r["loss"], abs=1e-2), p["step"]
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3  # it learned: the comparison is of a moving curve


def test_curves_tabulates_and_plots_them(tools, both_runs, tmp_path, capsys):
    _, curves, _ = tools
    losses, run_dir, _ = both_runs
    out, png = tmp_path / "curves.md", tmp_path / "curves.png"
    assert curves.main([f"megatrain={run_dir}", f"all-on-gpu={losses}", "--out", str(out), "--png", str(png),
                        "--every", "4", "--tail", "5"]) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 4, 8, 10]  # step 1, every 4th, the last
    assert "Mean loss over steps 6-10 (5 steps" in text and "| megatrain |" in text and "reference |" in text
    gap = next(line for line in text.splitlines() if line.startswith("| all-on-gpu |"))
    assert abs(float(gap.split("|")[3].strip().rstrip(" %"))) < 0.5  # percent
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_curves_refuses_other_data_and_bad_files(tools, both_runs, tmp_path, capsys):
    _, curves, _ = tools
    losses = both_runs[0]
    rows = json.loads(losses.read_text())
    rows[4]["batch_sha1"] = "0" * 40  # step 5 trained on another batch
    other = tmp_path / "other.json"
    other.write_text(json.dumps(rows))
    assert curves.main([str(losses), f"other={other}", "--out", str(tmp_path / "c.md")]) == 1
    assert "**other trained on other batches than peer** at 1 step(s), first step 5" in capsys.readouterr().out
    assert curves.main([str(losses), str(tmp_path / "missing.json"), "--out", str(tmp_path / "c.md")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err
    (tmp_path / "dict.json").write_text("{}")
    assert curves.main([str(losses), str(tmp_path / "dict.json"), "--out", str(tmp_path / "c.md")]) == 2
    assert "not a list of steps" in capsys.readouterr().err


def test_the_curve_options_refuse_what_cannot_be_compared(tools, capsys):
    run_peer = tools[0]
    with pytest.raises(SystemExit):
        run_peer.main(["all-on-gpu", "--data", "x.txt"])
    assert "--data FILE is the text of --corpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_peer.main(["all-on-gpu", "--megatrain-toml", "x.toml"])
    assert "add --corpus" in capsys.readouterr().err
    assert run_peer.main(["zero3-offload", "--corpus", "--init", "megatrain"]) == 2
    assert "ZeRO-3 partitions" in capsys.readouterr().err
    assert run_peer.main(["zenflow", "--device", "cpu", "--steps", "4"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
    assert run_peer.main(["all-on-gpu", *SHAPE, "--device", "cpu", "--data", str(ROOT / "nothing.txt")]) == 2
    assert "nothing.txt' does not exist" in capsys.readouterr().err


def test_the_megatrain_config_of_a_1b_curve_run(tools, tmp_path):
    """The ~1 B model of docs/peers.md: an HF config directory in the repository, trained from random init on bytes
    (its vocabulary covers them), the peer's AdamW, constant lr, clipping 1, no evaluation or checkpoint."""
    from megatrain.exec.optim import AdamWConfig
    from megatrain.train.config import load_config

    run_peer = tools[0]
    model = PEERS_DIR / "models" / "llama-1b"
    toml = tmp_path / "ref.toml"
    assert run_peer.main(["zenflow", "--model", str(model), "--batch", "8", "--seq", "2048", "--warmup", "0",
                          "--steps", "200", "--clip", "1", "--lr", "3e-4", "--corpus", "--init", "megatrain",
                          "--megatrain-toml", str(toml)]) == 0
    cfg = load_config(toml)
    spec = cfg.model.spec()
    assert 0.9e9 < spec.num_params < 1.1e9 and spec.hidden_size == 2048 and spec.num_layers == 16
    assert cfg.model.init == "random" and not cfg.model.pretrained and cfg.data.tokenizer == "bytes"
    o = AdamWConfig(lr=3e-4)
    opt = cfg.optimizer
    assert (opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay) == (3e-4, *o.betas, o.eps, o.weight_decay)
    assert opt.decay == "constant" and opt.warmup_steps == 0 and cfg.schedule.clip == 1.0
    assert cfg.run.steps == 200 and cfg.run.eval_every == 0 and not cfg.run.checkpoint_at_end
    assert (cfg.data.batch_size, cfg.data.seq_len) == (8, 2048)
