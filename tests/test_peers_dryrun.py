"""The project's own peer benchmark (scripts/peers, docs/peers.md): every config parses and states the settings
issue 25 asks for; every peer's dry run prints the RESULT line with scripts/bench_megatrain.py's keys (the torch
peers after 2 real steps of the debug model on the CPU, the DeepSpeed peers with their config checked and their
launch command); scripts/bench.py builds the same commands."""
import copy
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "scripts" / "peers"
PEERS = ["all-on-gpu", "fsdp2-cpuoffload", "superoffload", "superoffload-adam50", "superoffload-adam75", "twinflow",
         "twinflow-expandable", "zenflow", "zenflow-sync", "zero2-offload", "zero2-offload-every4", "zero3-offload"]
# scripts/bench_megatrain.py's RESULT keys that every peer's RESULT carries too, plus the peers' own
MEGATRAIN_KEYS = {"mode", "model", "params_B", "batch", "seq", "median_step_s", "tokens_per_s", "model_TFLOPs",
                  "loss_first", "loss_last", "peak_gpu_GiB", "host_rss_GiB"}
PEER_KEYS = {"host_B_per_param", "config", "settings", "clip", "exact_adamw", "command"}


def _load(name: str, path: Path, modules: dict | None = None):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    if modules is not None:  # a module with dataclasses looks itself up there
        modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# the peers that run on DeepSpeed: those whose config holds a DeepSpeed engine (the launcher is checked below)
DEEPSPEED = {p for p in PEERS if "deepspeed" in _load("peerconf", PEERS_DIR / "peerconf.py").load(p)}


@pytest.fixture(scope="module")
def peerconf():
    return _load("peerconf", PEERS_DIR / "peerconf.py")


@pytest.fixture(scope="module")
def run_peer(peerconf):
    # run_peer.py imports its siblings by name, as `python scripts/peers/run_peer.py` finds them
    sys.modules.setdefault("peerconf", peerconf)
    if "peercurve" not in sys.modules:  # also when this file runs alone, before tests/test_peers_curves.py
        _load("peercurve", PEERS_DIR / "peercurve.py", sys.modules)
    return _load("run_peer", PEERS_DIR / "run_peer.py")


def test_every_config_states_the_settings_of_issue_25(peerconf):
    assert peerconf.peer_names() == PEERS
    for peer in PEERS:
        raw = json.loads((PEERS_DIR / "configs" / f"{peer}.json").read_text())
        cfg = peerconf.load(peer)
        assert cfg["peer"] == peer and cfg["why"] and cfg["sources"]
        if peer in DEEPSPEED:
            ds = raw["deepspeed"]
            assert not peerconf.DS_FILLED & ds.keys()  # batch, clipping and AdamW come from megatrain's side
            zero = ds["zero_optimization"]
            assert cfg["launcher"] == {"kind": "deepspeed", "bind_cores_to_rank": True}  # core binding
            assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_optimizer"]["pin_memory"] is True
            if "offload_param" in zero:
                assert zero["offload_param"]["pin_memory"] is True
            assert ds["bf16"] == {"enabled": True}
            if zero["stage"] == 3:
                assert zero["sub_group_size"] > 0  # stated, not left to DeepSpeed's default
            summary = peerconf.settings_summary(cfg, 1.0)
            assert "bind_cores_to_rank" in summary and "pin_memory=True" in summary and "sub_group_size" in summary
        else:
            assert cfg["launcher"] == {"kind": "python", "threads": "affinity"}
            assert raw["torch"]["optimizer"] == {"fused": True}
    so = peerconf.load("superoffload")["deepspeed"]["zero_optimization"]
    assert so["stage"] == 3 and so["offload_optimizer"]["super_offload"] is True
    # SuperOffload's own single-GPU example, as written (DeepSpeedExamples training/DeepSpeed-SuperOffload/
    # finetune_llama-8b_1gpu.sh): the settings its docs recommend, which the peer must run with
    example = {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 4e8, "sub_group_size": 4e8,
               "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.80, "super_offload": True,
                                     "cpuadam_cores_perc": 0.90}}
    assert so == example and "offload_param" not in so
    tf = peerconf.load("twinflow")["deepspeed"]["zero_optimization"]
    assert 0 < tf["offload_optimizer"]["ratio"] < 1 and tf["sub_group_size"] < 1e9  # small groups: ratio acts
    zf = peerconf.load("zenflow")
    # exact AdamW is every peer's but ZenFlow's (and its overlap_step=false control's)
    assert all(peerconf.load(p)["exact_adamw"] is (peerconf.zenflow(peerconf.load(p)) is None) for p in PEERS)
    assert zf["exact_adamw"] is False
    z = zf["deepspeed"]["zero_optimization"]["zenflow"]
    assert z["overlap_step"] is True and 0 < z["topk_ratio"] < 1 and z["update_interval"] >= 1
    fsdp = peerconf.load("fsdp2-cpuoffload")["torch"]
    assert fsdp["offload"] == {"pin_memory": True}


def test_a_config_that_sets_what_megatrain_fixes_is_refused(peerconf, tmp_path):
    cfg = json.loads((PEERS_DIR / "configs" / "superoffload.json").read_text())
    cfg["deepspeed"]["gradient_clipping"] = 1.0
    path = tmp_path / "superoffload.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(peerconf.PeerConfigError, match="gradient_clipping are set from the command line"):
        peerconf.load("superoffload", path)
    del cfg["deepspeed"]["gradient_clipping"]
    del cfg["launcher"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(peerconf.PeerConfigError, match="missing key"):
        peerconf.load("superoffload", path)


def test_the_run_config_carries_megatrains_adamw_batch_and_clip(peerconf):
    from megatrain.exec.optim import AdamWConfig

    ds = peerconf.deepspeed_config(peerconf.load("superoffload"), batch=8, clip=0.0)
    assert ds["train_micro_batch_size_per_gpu"] == 8 and ds["gradient_accumulation_steps"] == 1
    assert ds["gradient_clipping"] == 0.0  # SuperOffload overlaps only without clipping: the run must say which
    o = AdamWConfig(lr=1e-5)
    assert ds["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "betas": list(o.betas), "eps": o.eps,
                                                           "weight_decay": o.weight_decay}}


@pytest.fixture
def one_process_env(monkeypatch):
    """FSDP2's one-process group reads these; set here so that nothing leaks into later tests."""
    with socket.socket() as s:  # a port free now: a fixed one collides with anything else on the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)


def _result(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, text[-2000:]
    return json.loads(lines[0][len("RESULT "):])


def test_dry_run_of_every_peer_prints_the_result_line(run_peer, capsys, one_process_env):
    losses = {}
    for peer in PEERS:
        assert run_peer.main([peer, "--dry-run", "--clip", "0" if peer == "superoffload" else "1"]) == 0
        out = capsys.readouterr().out
        res = _result(out)
        assert MEGATRAIN_KEYS | PEER_KEYS <= res.keys(), peer
        assert res["mode"] == peer and res["model"] == "debug" and res["dry_run"] is True
        assert res["config"] == f"scripts/peers/configs/{peer}.json"
        assert res["host_rss_GiB"] > 0 and res["host_B_per_param"] > 0
        command = next(line for line in out.splitlines() if line.startswith("command: "))
        assert "--model bench-3b --batch 8 --seq 2048" in command  # the full run's command, not the dry run's
        # ZenFlow's first update interval sets up its CPU optimizer (12.7 s of 0.35 s steps on the H200): two
        # whole intervals stay untimed (so for the control updating every 4 steps); every other peer warms up as
        # megatrain's rows do
        assert f"--warmup {8 if peer.startswith('zenflow') or peer.endswith('every4') else 2} " in command, peer
        if peer in DEEPSPEED:
            assert res["steps_run"] == 0 and res["tokens_per_s"] is None
            assert command.startswith("command: python3 -m deepspeed.launcher.runner --num_gpus 1 "
                                      f"--bind_cores_to_rank scripts/peers/run_peer.py {peer} ")
            ds = json.loads(next(line for line in out.splitlines()
                                 if line.startswith("deepspeed config: "))[len("deepspeed config: "):])
            assert ds["gradient_clipping"] == (0.0 if peer == "superoffload" else 1.0)
        else:  # two real steps on the CPU
            assert res["steps_run"] == 2 and res["tokens_per_s"] > 0 and res["model_TFLOPs"] >= 0
            assert "params_note" not in res  # the HF model has exactly the spec's parameters
            losses[peer] = (res["loss_first"], res["loss_last"])
    # same model init, data and AdamW: the first loss (before any update) is the same for both torch peers
    assert losses["all-on-gpu"][0] == pytest.approx(losses["fsdp2-cpuoffload"][0], abs=2e-2)


def test_the_script_runs_as_a_command_and_refuses_bad_input():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, str(PEERS_DIR / "run_peer.py"), "zenflow", "--dry-run", "--python", "py"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = _result(proc.stdout)
    assert res["exact_adamw"] is False and "zenflow topk_ratio=0.05" in res["settings"]
    assert res["command"].startswith("py -m deepspeed.launcher.runner")
    bad = subprocess.run([sys.executable, str(PEERS_DIR / "run_peer.py"), "zenflow", "--steps", "3"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and "--steps must be a multiple of it" in bad.stderr


def test_bench_builds_the_peer_commands(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "bench_script_peers", None)  # restored after the test
    bench = _load("bench_script_peers", ROOT / "scripts" / "bench.py", sys.modules)
    args = ["--dry-run", "--rounds", "1", "--python", "py", "--configs",
            "all-on-gpu,superoffload,superoffload:clip=0,zenflow,arrival"]
    assert bench.main([*args, "--ds-bind", "yes"]) == 0
    out = capsys.readouterr().out
    assert "4 timed steps after 2 warm-up (zenflow 8);" in out  # ZenFlow's set-up interval stays untimed
    runs = [line for line in out.splitlines() if line.startswith("round ")]
    assert runs[0] == ("round 1: py scripts/peers/run_peer.py all-on-gpu --model bench-3b --batch 8 --seq 2048 "
                       "--steps 4 --clip 1.0")
    assert runs[1] == ("round 1: py -m deepspeed.launcher.runner --num_gpus 1 --bind_cores_to_rank "
                       "scripts/peers/run_peer.py superoffload --model bench-3b --batch 8 --seq 2048 --steps 4 "
                       "--clip 1.0")
    assert runs[2].endswith("superoffload --model bench-3b --batch 8 --seq 2048 --steps 4 --clip 0")
    assert "scripts/bench_megatrain.py" in runs[4]
    assert bench.main([*args, "--ds-bind", "no"]) == 0
    out = capsys.readouterr().out
    assert not any("--bind_cores_to_rank" in line for line in out.splitlines() if line.startswith("round "))
    assert "DeepSpeed peers run without --bind_cores_to_rank" in out
    with pytest.raises(SystemExit, match="a peer takes only clip"):
        bench.main(["--dry-run", "--configs", "superoffload:ratio=0.5"])
    # ZenFlow's layout repair from a table: run_peer's flag, for the ZenFlow peers only
    assert bench.main(["--dry-run", "--rounds", "1", "--python", "py", "--configs",
                       "zenflow-sync:layout_fix=1;clip=0,zenflow"]) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert runs[0].endswith("zenflow-sync --model bench-3b --batch 8 --seq 2048 --steps 4 --clip 0 "
                            "--zenflow-layout-fix")
    assert runs[1].endswith("--clip 1.0")
    with pytest.raises(SystemExit, match="twinflow has no zenflow section"):
        bench.main(["--dry-run", "--configs", "twinflow:layout_fix=1"])
    with pytest.raises(SystemExit, match="layout_fix=1; got 'layout_fix=yes'"):
        bench.main(["--dry-run", "--configs", "zenflow:layout_fix=yes"])
    # the table shows bytes per parameter and each peer's settings under it
    s = bench.summarize({"superoffload": [{"tokens_per_s": 10.0, "host_rss_GiB": 40.0, "host_B_per_param": 14.5,
                                           "params_B": 3.0, "settings": "ZeRO-3; clip 1", "config": "c.json"}]})
    assert "| 14.5 |" in bench.table(s, "superoffload")
    assert bench.settings_lines(s) == ["- superoffload: ZeRO-3; clip 1 (c.json)"]


def test_the_peers_train_on_the_benchmark_s_data_and_learning_rate(peerconf, run_peer):
    """run_peer and peerconf restate scripts/bench_megatrain.py's data and AdamW learning rate (the DeepSpeed
    launcher runs run_peer alone, without megatrain's scripts on its path): the same batches, the same lr."""
    import torch

    bench = _load("bench_megatrain", ROOT / "scripts" / "bench_megatrain.py")
    assert peerconf.DEFAULT_LR == bench.BENCH_LR and peerconf.DEFAULT_WARMUP == bench.BENCH_WARMUP
    ours, theirs = bench.bench_batches(256, 2, 16), run_peer.batches(256, 2, 16)
    assert len(ours) == len(theirs) == 4 and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_zero2_offload_is_zenflow_without_its_approximate_update(peerconf):
    """The exact ZeRO-2 reference of ZenFlow's loss curve differs from zenflow.json in the zenflow section only."""
    zen, zero2 = peerconf.load("zenflow"), peerconf.load("zero2-offload")
    assert zero2["exact_adamw"] and not zen["exact_adamw"] and peerconf.zenflow(zero2) is None
    zen_ds = copy.deepcopy(zen["deepspeed"])
    del zen_ds["zero_optimization"]["zenflow"]
    assert zero2["deepspeed"] == zen_ds and zero2["launcher"] == zen["launcher"]
    assert peerconf.warmup_steps(zero2) == 2 and peerconf.warmup_steps(zen) == 8


def test_the_zenflow_curve_controls_change_one_thing_each(peerconf):
    """The two controls that separate ZenFlow's late update and its fewer full updates (docs/peers.md, "The eleventh
    start"): zenflow-sync is zenflow.json with overlap_step false; zero2-offload-every4 is zero2-offload.json with one
    optimizer step per 4 micro-batches, which DeepSpeed gets as gradient_accumulation_steps."""
    zen, sync = peerconf.load("zenflow"), peerconf.load("zenflow-sync")
    zen_ds = copy.deepcopy(zen["deepspeed"])
    zen_ds["zero_optimization"]["zenflow"]["overlap_step"] = False
    assert sync["deepspeed"] == zen_ds and sync["launcher"] == zen["launcher"] and not sync["exact_adamw"]
    zero2, every4 = peerconf.load("zero2-offload"), peerconf.load("zero2-offload-every4")
    assert every4["deepspeed"] == zero2["deepspeed"] and every4["exact_adamw"]
    assert every4["micro_steps_per_update"] == peerconf.zenflow(zen)["update_interval"] == 4
    assert peerconf.deepspeed_config(every4, 8, 1.0)["gradient_accumulation_steps"] == 4
    assert peerconf.deepspeed_config(zero2, 8, 1.0)["gradient_accumulation_steps"] == 1
    assert "one optimizer step per 4 micro-batches" in peerconf.settings_summary(every4, 1.0)
    # refused where it would mean nothing or something else: ZenFlow sets its own, torch peers have no such knob
    for bad in ({**zen, "micro_steps_per_update": 4}, {**peerconf.load("all-on-gpu"), "micro_steps_per_update": 2},
                {**zero2, "micro_steps_per_update": 0}, {**zero2, "micro_steps_per_update": True}):
        bad = {k: v for k, v in bad.items() if k != "_file"}
        with pytest.raises(peerconf.PeerConfigError, match="micro_steps_per_update must be an integer >= 1"):
            peerconf.check(bad)


def test_the_superoffload_variants_change_only_the_core_split_and_sub_groups(peerconf):
    """superoffload.json is the example as written (for a 72-core Grace socket); the variants for a host of few
    cores differ from it in cpuadam_cores_perc (and adam75 in sub_group_size) only."""
    base = peerconf.load("superoffload")["deepspeed"]
    for name, changed in (("superoffload-adam50", {"cpuadam_cores_perc": 0.5}),
                          ("superoffload-adam75", {"cpuadam_cores_perc": 0.75, "sub_group_size": 100000000})):
        ds = peerconf.load(name)["deepspeed"]
        zero, zero0 = ds["zero_optimization"], base["zero_optimization"]
        off, off0 = zero.pop("offload_optimizer"), dict(zero0["offload_optimizer"])
        assert off == {**off0, "cpuadam_cores_perc": changed["cpuadam_cores_perc"]}
        assert zero == {**{k: v for k, v in zero0.items() if k != "offload_optimizer"},
                        **({"sub_group_size": changed["sub_group_size"]} if "sub_group_size" in changed else {})}
        assert {k: v for k, v in ds.items() if k != "zero_optimization"} == {
            k: v for k, v in base.items() if k != "zero_optimization"}


def test_a_peer_that_cannot_hold_the_model_says_so_before_it_allocates(peerconf, run_peer, monkeypatch, capsys):
    """llama3-8b (8.03 B parameters) on the H200 machine's 125 GiB host: ZeRO-3 offload keeps 25.65 B a parameter
    there (measured at bench-3b), about 192 GiB, so it is refused with one line and exit 3 before any model is
    built. PyTorch all on the GPU needs 16 B a parameter of the GPU (about 120 GiB) before activations: refused on
    an 80 GB H100 by the parameters alone; with no shape given they fit the H200 (its logits do not: the next test)."""
    gib = 1024 ** 3
    n = 8_030_261_248  # llama3-8b
    zero3, gpu_peer, fsdp = (peerconf.load(p) for p in ("zero3-offload", "all-on-gpu", "fsdp2-cpuoffload"))
    line = peerconf.memory_refusal(zero3, "llama3-8b", n, 120 * gib, 139 * gib)
    assert line.startswith("zero3-offload cannot hold llama3-8b (8.03 B parameters)") and "191.8 GiB of host" in line
    assert "25.65 B a parameter, measured at bench-3b" in line and "120.0 GiB are available" in line
    assert peerconf.memory_refusal(zero3, "bench-3b", 2_971_000_000, 120 * gib, 139 * gib) is None  # it ran there
    assert "GPU memory before activations" in peerconf.memory_refusal(gpu_peer, "llama3-8b", n, 120 * gib, 79 * gib)
    assert peerconf.memory_refusal(gpu_peer, "llama3-8b", n, 120 * gib, 139 * gib) is None  # tokens=0: no logits
    # FSDP2's floor, 16 B a parameter of fp32 weights, gradients and moments on the host, would let llama3-8b try
    # a 125.9 GiB host; its measured 19.97 B (bench-3b, H200) refuses it, as a peer without a measurement is held
    # to its floor
    assert peerconf.memory_floor(fsdp)[0] == 16.0 and 16.0 * n < 125.9 * gib
    assert "149.4 GiB of host memory (19.97 B a parameter, measured" in peerconf.memory_refusal(
        fsdp, "llama3-8b", n, 125.9 * gib, None)
    unmeasured = {**fsdp, "peer": "fsdp2-unmeasured"}
    assert "at least: fp32 weights" in peerconf.memory_refusal(unmeasured, "llama3-8b", n, 100 * gib, None)
    # ZenFlow: 48.6 B a parameter measured at llama-1b (PSS with its optimizer process); the H200 host (125.9 GiB)
    # ran out of memory at bench-3b (dmesg of start 7), which is now refused before anything is built
    zen = peerconf.load("zenflow")
    assert "134.5 GiB of host memory (48.6 B a parameter" in peerconf.memory_refusal(
        zen, "bench-3b", 2_971_000_000, 125.9 * gib, 139 * gib)
    assert peerconf.memory_refusal(zen, "llama-1b", 953_000_000, 125.9 * gib, 139 * gib) is None  # it ran there
    # without overlap_step there is no optimizer process: 24.2 B a parameter (start 12), so bench-3b may run
    assert peerconf.memory_refusal(peerconf.load("zenflow-sync"), "bench-3b", 2_971_000_000, 125.9 * gib,
                                   139 * gib) is None
    # Twin-Flow keeps 30% of the optimizer on the host, the rest and the bf16 parameters on the GPU
    assert peerconf.memory_floor(peerconf.load("twinflow"))[:2] == pytest.approx((4.8, 13.2))

    # through the runner, on a machine with CUDA (faked: nothing reaches the device before the refusal)
    built = _fake_cuda_machine(run_peer, monkeypatch, host_available_gib=20, gpu_free_gib=139)
    assert run_peer.main(["fsdp2-cpuoffload", "--model", "bench-3b"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("run_peer: fsdp2-cpuoffload cannot hold bench-3b") and not built


def _fake_cuda_machine(run_peer, monkeypatch, host_available_gib: float, gpu_free_gib: float) -> list:
    """run_peer on a machine with CUDA (faked: nothing reaches a device before a refusal) of this much available
    host memory and free GPU memory (of 141 GiB). Returns the list each `build_model` call appends to."""
    import torch

    gib = 1024 ** 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (gpu_free_gib * gib, 141 * gib))
    monkeypatch.setattr(run_peer.psutil, "virtual_memory",
                        lambda: type("VM", (), {"available": host_available_gib * gib})())
    built = []
    monkeypatch.setattr(run_peer, "build_model", lambda *a, **k: built.append(a))
    return built


def test_the_gpu_check_counts_the_logits_that_every_peer_holds(peerconf, run_peer, monkeypatch, capsys):
    """all-on-gpu with llama3-8b at 16 x 2048 passed the parameters' floor on the H200 (16 B a parameter, 119.7 GiB
    of 139 free) and ran out of memory at the head 25 s later: its logits, 16 x 2048 x 128256 elements held in bf16
    in transformers' fp32 upcast and in its loss's fp32 log-softmax at once (10 B each), are 39.1 GiB more. Refused
    now, in one line that names them, and through the runner, which passes batch x seq and the vocabulary, before
    anything is built."""
    gib = 1024 ** 3
    gpu_peer = peerconf.load("all-on-gpu")
    line = peerconf.memory_refusal(gpu_peer, "llama3-8b", 8.03e9, 1000 * gib, 139 * gib, tokens=16 * 2048,
                                   vocab=128256)
    assert line is not None and line.startswith("all-on-gpu cannot hold llama3-8b (8.03 B parameters)")
    assert "158.8 GiB of GPU memory before activations other than the logits" in line
    assert "119.7 GiB at 16 B a parameter" in line and "39.1 GiB of logits, 32768 tokens x 128256 vocabulary" in line
    assert "139.0 GiB free" in line and "\n" not in line

    built = _fake_cuda_machine(run_peer, monkeypatch, host_available_gib=1000, gpu_free_gib=139)
    assert run_peer.main(["all-on-gpu", "--model", "llama3-8b", "--batch", "16", "--seq", "2048"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GiB of logits, 32768 tokens x 128256 vocabulary" in err[0] and not built


def test_the_logits_floor_lets_through_what_fits(peerconf):
    """bench-3b-sized: 44.7 GiB of weights, gradients and moments and 4.9 GiB of logits (8 x 2048 x 32000) fit the
    H200's 139 GiB; the logits count for every peer, also one that keeps nothing else on the GPU. Twin-Flow at
    llama3-8b 16 x 2048 passes the floor on the H200 (98.7 + 39.1 GiB against 139.3 free) and ran out of memory
    there (start 12-13, 8 of 8 runs, 129.27 GiB allocated when the log-softmax asked for 15.66): a floor lets a peer
    try what it may hold."""
    gib = 1024 ** 3
    shape = dict(tokens=8 * 2048, vocab=32000)
    assert peerconf.memory_refusal(peerconf.load("all-on-gpu"), "bench-3b", 3.0e9, 1000 * gib, 139 * gib,
                                   **shape) is None
    # FSDP2's GPU floor is 0 B a parameter: a GPU too small for the logits alone is still refused
    fsdp = peerconf.load("fsdp2-cpuoffload")
    assert peerconf.memory_refusal(fsdp, "bench-3b", 3.0e9, 1000 * gib, 139 * gib, **shape) is None
    assert "4.9 GiB of logits" in peerconf.memory_refusal(fsdp, "bench-3b", 3.0e9, 1000 * gib, 4 * gib, **shape)
    assert peerconf.memory_refusal(peerconf.load("twinflow"), "llama3-8b", 8_030_261_248, 125.9 * gib, 139.3 * gib,
                                   tokens=16 * 2048, vocab=128256) is None


def test_run_peers_help_names_every_peer(peerconf):
    """run_peer.py's docstring (its --help) lists the peers by hand: every config file must be named there."""
    doc = (PEERS_DIR / "run_peer.py").read_text().split('"""')[1]
    assert [p for p in peerconf.peer_names() if p not in doc] == []


def test_a_peer_that_updates_every_few_steps_is_timed_over_whole_intervals(peerconf, run_peer):
    """zero2-offload-every4 applies its optimizer step on every 4th micro-step, as ZenFlow lands its full update: the
    median step would leave the update out (start 12 printed 42,275 tokens/s, the median of 200 steps of which 50
    took 0.9-1.0 s and 150 0.35-0.39 s). Its step time is the mean over whole intervals, it warms up two of them and
    a timed run that cuts an interval is refused."""
    every4, zero2, zen = (peerconf.load(p) for p in ("zero2-offload-every4", "zero2-offload", "zenflow"))
    assert [peerconf.steps_per_update(c) for c in (every4, zero2, zen)] == [4, 1, 4]
    assert [peerconf.warmup_steps(c) for c in (every4, zero2, zen)] == [8, 2, 8]
    raw = json.loads(next(line[len("RESULT "):] for line in (ROOT / "docs/runs/25-zenflow-curve/"
                                                               "zero2-offload-every4.result").read_text().splitlines()
                          if line.startswith("RESULT ")))
    times = raw["step_times_s"][8:]  # the steps after two whole intervals, as a timed run would take them
    a = run_peer.parse_args(["zero2-offload-every4", "--model", "debug", "--batch", "8", "--seq", "2048"])
    from megatrain.model.presets import get_model

    spec = get_model("debug")
    out = run_peer.result(a, every4, spec, spec.num_params, times, [1.0], "cpu")
    mean = sum(times) / len(times)
    assert out["step_s_used"] == "mean over whole update intervals"
    assert out["tokens_per_s"] == pytest.approx(8 * 2048 / mean, rel=1e-3)
    assert out["tokens_per_s"] < 0.8 * 8 * 2048 / out["median_step_s"]  # the median leaves out the update
    plain = run_peer.result(a, zero2, spec, spec.num_params, times, [1.0], "cpu")
    assert plain["step_s_used"] == "median"
    assert plain["tokens_per_s"] == pytest.approx(8 * 2048 / plain["median_step_s"], rel=1e-3)
    assert run_peer.main(["zero2-offload-every4", "--model", "debug", "--steps", "6"]) == 2


def test_twinflow_expandable_changes_only_the_allocator_and_the_training_process_gets_it(peerconf, run_peer,
                                                                                        monkeypatch, capsys):
    """twinflow-expandable is twinflow.json plus cuda_alloc_conf (start 12: twinflow out of GPU memory at llama3-8b
    with 12.78 GiB reserved but unallocated); run_peer sets PYTORCH_CUDA_ALLOC_CONF before its first allocation and
    the RESULT's settings say so; a malformed value is refused in one line."""
    tf, tfx = peerconf.load("twinflow"), peerconf.load("twinflow-expandable")
    assert {k: v for k, v in tfx.items() if k not in ("peer", "system", "why", "cuda_alloc_conf", "_file")} == \
        {k: v for k, v in tf.items() if k not in ("peer", "system", "why", "_file")}
    assert peerconf.cuda_alloc_conf(tfx) == "expandable_segments:True" and peerconf.cuda_alloc_conf(tf) is None
    # setenv first so that monkeypatch restores the variable's state from before the test, whatever run_peer sets
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert run_peer.main(["twinflow-expandable", "--dry-run"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in _result(capsys.readouterr().out)["settings"]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert run_peer.main(["twinflow", "--dry-run"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    for bad in ("expandable_segments", "", "a:b,c", 1):
        raw = {k: v for k, v in tfx.items() if k != "_file"}
        with pytest.raises(peerconf.PeerConfigError, match="cuda_alloc_conf must be PYTORCH_CUDA_ALLOC_CONF's"):
            peerconf.check({**raw, "cuda_alloc_conf": bad})
