"""scripts/bench.py: every config in its own process, interleaved round-robin, medians with min-max, failures
marked without stopping the rest; --dry-run prints the commands."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_script"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_prints_every_command_round_robin(bench, capsys):
    assert bench.main(["--dry-run", "--rounds", "3", "--configs",
                       "resident,zero3,authors,arrival-resident:resident_layers=4;compile_layers=true,auto:clip=0",
                       "--bench-dir", "BENCH", "--gpu-limit-gib", "40", "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bench-3b: 2.971 B params, 28 layers") and "3 rounds of 5 configs" in out[0]
    runs = [line for line in out if line.startswith("round ")]
    assert len(runs) == 15
    rounds = [int(line.split()[1].rstrip(":")) for line in runs]
    assert rounds == [1] * 5 + [2] * 5 + [3] * 5  # every config once per round, rounds in order
    first = runs[:5]
    assert first[0] == ("round 1: py BENCH/baseline_train.py resident --layers 28 --hidden 3072 --ffn 8192 "
                        "--batch 8 --seq 2048 --steps 4")
    assert first[2].startswith("round 1: PYTHONPATH=BENCH/megatrain_repo:$PYTHONPATH py scripts/peers/authors_peer.py "
                               "authors --layers 28") and "--record-head-grad-streams" not in first[2]
    # a megatrain row that sets no clip= clips at the peers' default, so no row is compared unclipped unawares
    assert first[3].endswith("--schedule arrival-resident --device cuda --gpu-limit-gib 40.0 --set resident_layers=4 "
                             "--set compile_layers=true --set clip=1.0")
    assert "--schedule auto" in first[4] and first[4].endswith("--set clip=0")
    assert runs[5:10] == [r.replace("round 1", "round 2") for r in first]


def test_the_authors_trainer_runs_as_shipped_and_with_our_fix(bench, capsys):
    """`authors` runs their trainer as they ship it, `authors-fixed` with the harness's record_stream fix of their
    head gradients' copy; both import their code from the external checkout (`--authors-dir`)."""
    assert bench.main(["--dry-run", "--rounds", "1", "--configs", "authors,authors-fixed", "--authors-dir", "MT",
                       "--python", "py"]) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert runs == ["round 1: PYTHONPATH=MT:$PYTHONPATH py scripts/peers/authors_peer.py authors --layers 28 "
                    "--hidden 3072 --ffn 8192 --batch 8 --seq 2048 --steps 4",
                    "round 1: PYTHONPATH=MT:$PYTHONPATH py scripts/peers/authors_peer.py authors-fixed --layers 28 "
                    "--hidden 3072 --ffn 8192 --batch 8 --seq 2048 --steps 4 --record-head-grad-streams"]


def test_the_authors_harness_hooks_the_head_gradients_and_names_nonfinite_groups():
    """The fix registers a post-accumulate-grad hook on the GPU head, final norm and embedding parameters only (the
    layers' gradients have their record_stream in cpu_master.py already), and only when asked; the warm-up check
    names the host groups whose gradients hold NaN or inf."""
    import types

    import torch

    spec = importlib.util.spec_from_file_location("authors_peer", ROOT / "scripts" / "peers" / "authors_peer.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)

    class Theirs:  # the attributes of CPUMasterModel the harness touches
        def __init__(self, hf_model, config):
            self.use_multiprocessing = False
            self.embedding, self.lm_head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
            self.norm, self.cpu_layers = torch.nn.LayerNorm(4), [torch.nn.Linear(4, 4) for _ in range(2)]
            self.gpu_contexts = [types.SimpleNamespace(lm_head_gpu=torch.nn.Linear(4, 10, bias=False),
                                                       norm_gpu=torch.nn.LayerNorm(4), emb_gpu=None,
                                                       layer_gpu=torch.nn.Linear(4, 4), grad_stream="s")]

    def hooks(module):
        return [len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()]

    fixed, shipped = peer.peer_class(Theirs, True)(None, None), peer.peer_class(Theirs, False)(None, None)
    ctx = fixed.gpu_contexts[0]
    assert hooks(ctx.lm_head_gpu) == [1] and hooks(ctx.norm_gpu) == [1, 1] and hooks(ctx.layer_gpu) == [0, 0]
    assert hooks(shipped.gpu_contexts[0].lm_head_gpu) == [0]
    for module in (fixed.embedding, fixed.lm_head, fixed.cpu_layers[1]):
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    assert peer.nonfinite_grads(fixed) == []
    fixed.cpu_layers[1].weight.grad[0, 0] = float("nan")
    fixed.lm_head.weight.grad[1, 1] = float("inf")
    assert peer.nonfinite_grads(fixed) == ["lm_head", "layer1"]
    assert peer.parse_args(["--record-head-grad-streams"]).record_head_grad_streams
    assert not peer.parse_args([]).record_head_grad_streams


def test_the_clipping_column_reads_each_runs_own_max_norm(bench):
    """The max norm each row ran with, from what its process reported: a peer's clip, the authors' grad_clip,
    megatrain's record knobs with the steps it clipped, the older baseline peers' none."""
    runs = {"superoffload": [{"tokens_per_s": 10.0, "clip": 1.0}],
            "authors": [{"tokens_per_s": 10.0, "grad_clip": None}],
            "resident": [{"tokens_per_s": 10.0, "mode": "resident"}],
            "megatrain a": [{"tokens_per_s": 10.0, "clipped_steps": c, "record": {"knobs": {"clip": 1.0}}}
                            for c in ("4/4", "1/4", "0/4")],
            "megatrain b": [{"tokens_per_s": 10.0, "record": {"knobs": {"clip": 0.0}}}],
            "unknown": [{"tokens_per_s": 10.0}]}
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in
            bench.table(bench.summarize(runs), None).splitlines()[2:]}
    assert rows == {"superoffload": "1", "authors": "none", "resident": "none",
                    "megatrain a": "1 (5/12 steps clipped)", "megatrain b": "none", "unknown": "?"}


def test_a_run_whose_loss_ended_nan_is_marked_as_not_training(bench):
    """The authors' trainer ran 4,365 tokens/s on the H100 table's start with its loss NaN from its second step:
    the row says so, and a run with a finite loss is not marked."""
    runs = {"authors": [{"tokens_per_s": 4365.0, "loss": float("nan"), "grad_clip": 1.0},
                        {"tokens_per_s": 4300.0, "loss": 7.5, "grad_clip": 1.0}],
            "megatrain a": [{"tokens_per_s": 10.0, "loss": 7.4, "record": {"knobs": {"clip": 1.0}}}]}
    text = bench.table(bench.summarize(runs), None)
    row = next(line for line in text.splitlines() if line.startswith("| authors "))
    assert "| 2/2, 1 diverged |" in row
    assert "↳ 1 run(s) ended with the loss NaN or inf" in text and text.count("ended with the loss") == 1
    assert "diverged" not in next(line for line in text.splitlines() if line.startswith("| megatrain a "))


def test_a_malformed_config_is_one_error(bench):
    with pytest.raises(SystemExit, match="not a peer"):
        bench.main(["--dry-run", "--configs", "overlap:buffers"])


def tau_b(xs, ys) -> float:
    """sum sign(dx) sign(dy) / sqrt(sum sign(dx)^2 x sum sign(dy)^2) over pairs: tau-b in matrix form."""
    sx = np.sign(np.subtract.outer(xs, xs))[np.triu_indices(len(xs), 1)]
    sy = np.sign(np.subtract.outer(ys, ys))[np.triu_indices(len(ys), 1)]
    return float((sx * sy).sum() / np.sqrt((sx**2).sum() * (sy**2).sum()))


def test_medians_ratios_and_kendall_tau(bench):
    runs = {"resident": [{"tokens_per_s": t} for t in (100.0, 110.0, 90.0)],
            "megatrain a": [{"tokens_per_s": t, "predicted_tokens_per_s": 150.0, "calibrated_tokens_per_s": 205.0,
                             "schedule": "a"} for t in (200.0, 180.0, 220.0)],
            "megatrain b": [{"tokens_per_s": 50.0, "predicted_tokens_per_s": 40.0, "schedule": "b"},
                            {"error": "exit 1: boom"}],
            "megatrain c": [{"tokens_per_s": 120.0, "predicted_tokens_per_s": 160.0, "schedule": "c",
                             "bound_tokens_per_s": b, "bound_binds": "h2d"} for b in (400.0, 480.0, 500.0)]}
    s = bench.summarize(runs)
    text = bench.table(s, "resident")
    row = next(line for line in text.splitlines() if line.startswith("| megatrain a "))
    assert "| 3/3 | 200 (180-220) | 2.00 |" in row and "150 (-25.0%)" in row and "205 (+2.5%)" in row
    assert "| - | 150 (-25.0%)" in row  # no bound recorded: none shown
    row_c = next(line for line in text.splitlines() if line.startswith("| megatrain c "))
    assert "| 480 (h2d): 25% |" in row_c  # the median bound, what binds, and the measured median's share of it
    assert "| 1/2 | 50 |" in text and "1 failed: exit 1: boom" in text
    # Kendall's tau-b against its matrix form in numpy, ties included
    xs, ys = [150.0, 40.0, 160.0, 40.0], [200.0, 50.0, 120.0, 60.0]
    assert bench.kendall_tau(xs, ys) == pytest.approx(tau_b(xs, ys))
    tau = tau_b([150.0, 40.0, 160.0], [200.0, 50.0, 120.0])
    want = f"Kendall tau, predicted (profile) vs measured medians of 3 megatrain configs: {tau:.2f}"
    assert bench.tau_lines(s)[0] == want


def test_runs_each_config_in_its_own_process_and_keeps_going(bench, tmp_path, capsys, monkeypatch):
    """Real processes on the CPU backend: a good config and one whose knobs are refused (its row is marked)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + ":" + __import__("os").environ.get("PYTHONPATH", ""))
    rc = bench.main(["--model", "debug", "--batch", "2", "--seq", "16", "--steps", "2", "--rounds", "1", "--device",
                     "cpu", "--configs", "serial,serial:buffers=0", "--log-dir", str(tmp_path), "--timeout", "120",
                     "--python", sys.executable])
    out = capsys.readouterr().out
    assert rc == 1  # one config failed
    assert "[1/2] round 1 megatrain serial: " in out and "tok/s" in out.split("[1/2]")[1].splitlines()[0]
    assert "[2/2] round 1 megatrain serial:buffers=0: FAILED (exit 1" in out
    row = next(line for line in out.splitlines() if line.startswith("| megatrain serial |"))
    assert "| 1/1 |" in row and ("(-" in row or "(+" in row)  # measured, and predicted beside it with its error
    assert row.split(" | ")[1].startswith("1 (") and "/2 steps clipped)" in row  # the default max norm, as it ran
    assert "| megatrain serial:buffers=0 | ? | 0/1 |" in out and "1 failed: exit 1" in out
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2
    ok = __import__("json").loads(lines[0])
    # the physical bound of the step that ran (sim/bound.py): no schedule beats it, the simulated one included
    from megatrain.sim.bound import RESOURCES

    assert ok["bound_binds"] in RESOURCES
    assert ok["bound_tokens_per_s"] >= ok["predicted_tokens_per_s"] > 0
    # predicted at the share of its timed steps that clipped (what the run's clipping column counts)
    clipped, steps = map(int, ok["clipped_steps"].split("/"))
    assert ok["predicted_clip_share"] == pytest.approx(clipped / steps) and steps == 2


def test_results_file_continues_an_earlier_call(bench, tmp_path, capsys):
    """Runs already in --results are not run again (here every run is there: nothing starts) and count in the
    table; the (round, config) pairs are what is skipped."""
    path = tmp_path / "r.jsonl"
    rows = [{"round": r, "config": "megatrain overlap", "tokens_per_s": t} for r, t in ((1, 10.0), (2, 30.0))]
    path.write_text("".join(__import__("json").dumps(row) + "\n" for row in rows))
    assert bench.main(["--model", "debug", "--device", "cpu", "--rounds", "2", "--configs", "overlap",
                       "--results", str(path), "--python", "false"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s) already in" in out and "round 1 megatrain overlap" not in out
    assert "| megatrain overlap | ? | 2/2 | 20 (10-30) |" in out


def test_calibration_transfer_predicts_every_config_with_every_run_s_profile(bench, tmp_path, capsys, monkeypatch):
    """Real runs on the CPU backend save their live-calibrated profiles (names without `=`, which the GPU machine's
    tool does not bring back); scripts/calibration_transfer.py rebuilds the Programs that ran (their shipped
    prediction must equal the recorded one) and predicts each config with each profile: in sample, a profile gives
    back the live-calibrated prediction its own run recorded (how close that is to the measurement is live
    calibration's test, tests/test_live_calibration.py)."""
    import json

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + ":" + __import__("os").environ.get("PYTHONPATH", ""))
    results, cal = tmp_path / "r.jsonl", tmp_path / "cal"
    assert bench.main(["--model", "debug", "--batch", "2", "--seq", "16", "--steps", "3", "--rounds", "1", "--device",
                       "cpu", "--configs", "serial,overlap:buffers=3", "--results", str(results), "--log-dir",
                       str(tmp_path), "--save-calibrated-dir", str(cal), "--timeout", "120",
                       "--python", sys.executable]) == 0
    assert sorted(p.name for p in cal.iterdir()) == ["megatrain_overlap_buffers_3.json", "megatrain_serial.json"]
    assert (tmp_path / "r1-megatrain_serial.timeline.csv").is_file()  # each megatrain run's last timed step
    capsys.readouterr()
    spec = importlib.util.spec_from_file_location("calibration_transfer", ROOT / "scripts" / "calibration_transfer.py")
    transfer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(transfer)
    assert transfer.main(["--results", str(results), "--cal-dir", str(cal), "--profile", "cpu"]) == 0
    out = capsys.readouterr().out
    recorded = {json.loads(line)["config"].removeprefix("megatrain "): json.loads(line)["calibrated_tokens_per_s"]
                for line in results.read_text().splitlines()}
    rows = [line for line in out.splitlines() if line.startswith("| calibrated on ")]
    assert len(rows) == 2 and "| cpu (uncalibrated) |" in out
    for row, label in zip(rows, ["serial", "overlap:buffers=3"]):
        cell = next(c for c in row.split("|") if c.strip().endswith("*"))  # the in-sample cell
        predicted = float(cell.split("(")[0].replace(",", ""))
        assert abs(predicted / recorded[label] - 1) < 0.002, (label, predicted, recorded[label])
    assert "largest error on configs it was not fitted to" in out


def test_a_peer_s_config_file_does_not_replace_the_row_s_label(bench, tmp_path, capsys, monkeypatch):
    """A peer's RESULT names its config file `config`; the results file must keep the row's label under that key (it
    is what a later call resumes by), the file under `config_file`. Before, the file's path won and a second call ran
    every peer's rounds again (issue 25's first H200 table)."""
    import json

    calls = []

    def fake_run(cfg, timeout_s, log_path):
        calls.append(cfg.label)
        return {"config": "scripts/peers/configs/all-on-gpu.json", "tokens_per_s": 100.0 + len(calls),
                "settings": "s", "wall_s": 1.0}

    monkeypatch.setattr(bench, "run_once", fake_run)
    path = tmp_path / "r.jsonl"
    args = ["--model", "debug", "--device", "cpu", "--rounds", "2", "--configs", "all-on-gpu", "--results", str(path)]
    assert bench.main(args) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    file = "scripts/peers/configs/all-on-gpu.json"
    assert [(r["round"], r["config"], r["config_file"]) for r in rows] == [(1, "all-on-gpu", file),
                                                                          (2, "all-on-gpu", file)]
    capsys.readouterr()
    assert bench.main(args) == 0 and calls == ["all-on-gpu", "all-on-gpu"]  # the second call runs nothing
    out = capsys.readouterr().out
    assert "2 run(s) already in" in out and "| all-on-gpu | ? | 2/2 | 102 (101-102) |" in out
    assert "- all-on-gpu: s (scripts/peers/configs/all-on-gpu.json)" in out  # the settings line names the file


def test_the_budget_guesses_each_config_s_own_cost_and_keeps_round_order(bench, tmp_path, capsys, monkeypatch):
    """--budget-s: a config whose earlier run took longer than the budget left waits for the next call, a cheaper
    config of the same round still runs, and no run of a later round goes before the one left over."""
    import json

    ran = []

    def fake_run(cfg, timeout_s, log_path):
        ran.append(cfg.label)
        return {"tokens_per_s": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(bench, "run_once", fake_run)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"round": 1, "config": f"megatrain {name}", "tokens_per_s": 1.0,
                                        "wall_s": wall}) + "\n" for name, wall in (("serial", 100.0),
                                                                                   ("overlap", 1.0))))
    args = ["--model", "debug", "--device", "cpu", "--rounds", "3", "--configs", "serial,overlap", "--results",
            str(path), "--budget-s", "50"]
    assert bench.main(args) == 3  # runs left: call again
    assert ran == ["megatrain overlap"]  # round 2's cheap one; round 2's serial (100 s) and round 3 wait
    assert "3 run(s) left for the time budget" in capsys.readouterr().out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["round"], r["config"]) for r in rows][-1] == (2, "megatrain overlap")
