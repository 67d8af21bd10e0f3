"""Host layouts (issue 14): the gradient ring (12 B/param with exact fp32 AdamW), bf16 optimizer state, the NVMe
tier (planned and simulated only), and the planner's capacity report.

Numerics are checked against references nobody here wrote: the plain HF + torch.optim.AdamW loop of
test_exec_training (same tolerances), and torch.optim.AdamW with its moments rounded to bf16 after every step.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from test_exec_training import FP32, SPECS, assert_same_training, batches, initial_tiles, reference, train

from megatrain.cli import main
from megatrain.exec.optim import AdamWConfig, adamw_update_bf16_state
from megatrain.exec.store import HostStore
from megatrain.compile.builders import build_schedule
from megatrain.ir.dag import ScheduleError
from megatrain.compile.knobs import knobs_for, resolve_knobs
from megatrain.plan.memory import NOT_STORE, format_plan
from megatrain.units import GiB
from megatrain.compile.advice import fit_report, plan_memory
from megatrain.compile.lower import lower
from megatrain.compile.resolve import resolve_host_layout
from megatrain.model.presets import PRESETS
from megatrain.sim import load_profile, simulate
from megatrain.model.spec import EMBED, HEAD
from megatrain.engine.trainer import StreamedTrainer

LEAN = dict(compute_dtype="fp32")  # "lean" streams the fp32 master already


# ---- 1. the gradient ring: 12 B/param, the same training as a plain loop -----------------------------------------
@pytest.mark.parametrize("spec_key,knobs", [
    ("llama", knobs_for("lean", **LEAN)),
    ("llama", knobs_for("lean", grad_ring=1, micro_batches=2, **LEAN)),
    ("llama-tied", knobs_for("lean", micro_batches=2, **LEAN)),  # the head's tile is held until U(E)
    # S reads a GPU-updated layer's gradients from the ring; a layer that keeps its gradients on the GPU has no tile
    ("llama", knobs_for("arrival-split", grad_ring=2, gpu_optimizer_fraction=0.5, retain_grads=1, **FP32)),
], ids=["lean", "ring1-mb2", "tied-mb2", "arrival-split-kept"])
def test_gradient_ring_trains_like_a_plain_adamw_loop(spec_key, knobs):
    results, state = train(spec_key, knobs)
    assert_same_training(results, state, reference(spec_key, clip=False), spec_key, f"ring{knobs.grad_ring}")


def test_lean_store_holds_master_and_moments_only():
    """fp32 wire + ring: no bf16 copy, no per-unit gradient tile; 12 B/param plus K tiles of the largest unit."""
    spec = PRESETS["debug"]
    layout = resolve_host_layout(spec, knobs_for("lean"))
    store = HostStore(spec, layout)
    parts = store.bytes_by_component()
    assert parts["bf16 streaming copy"] == 0 and store.stream_tile(0) is None
    largest = max(spec.unit_params(u) for u in spec.units())
    assert parts["gradient ring (2 tiles, fp32)"] == 2 * largest * 4
    assert parts["fp32 master"] + parts["adam m (fp32)"] + parts["adam v (fp32)"] == 12 * spec.num_params
    plan = plan_memory(spec, 4, 16, knobs_for("lean"), backend="cpu")
    assert parts == {k: v for k, v in plan.host.components.items() if k not in NOT_STORE}


def test_ring_reuse_is_an_edge_the_validator_checks():
    sched = build_schedule(SPECS["llama"], 4, 16, "lean")
    ring = [(a, b) for a, b, why in sched.graph.edges(data="why") if why == "ring"]
    assert [(a.id, b.id) for a, b in ring] == [("UH", "O2"), ("U3", "O1"), ("U2", "O0"), ("U1", "OE")]
    program = lower(sched)
    assert "U3" in program.tasks["O1"].waits  # the interpreters wait for it
    sched.graph.remove_edge(*ring[1])
    with pytest.raises(ScheduleError, match="ring tile 1 while U3 may still read"):
        sched.validate()


def test_ring_refusals_name_the_reason():
    spec = SPECS["llama"]
    with pytest.raises(ScheduleError, match="optimizer='overlap'.*optimizer='arrival'"):
        build_schedule(spec, 4, 16, knobs_for("overlap", grad_ring=2))
    with pytest.raises(ScheduleError, match="4 B/param"):
        build_schedule(spec, 4, 16, knobs_for("lean", clip=1.0))
    with pytest.raises(ScheduleError, match="tied embeddings.*grad_ring >= 2"):
        build_schedule(SPECS["llama-tied"], 4, 16, knobs_for("lean", grad_ring=1))
    p = build_schedule(spec, 4, 16, knobs_for("lean", grad_ring=9)).placement
    assert p.grad_ring == 6 and any("ring tiles are used" in n for n in p.notes)


# ---- 2. bf16 optimizer state ---------------------------------------------------------------------------------------
def test_bf16_state_update_equals_torch_adamw_with_moments_rounded_to_bf16():
    """Reference: torch.optim.AdamW (for-loop implementation), its exp_avg / exp_avg_sq rounded to bf16 after
    every step, which is what storing them in bf16 means."""
    g = torch.Generator().manual_seed(0)
    n, decay, cfg = 5000, 3000, AdamWConfig(lr=1e-2, weight_decay=0.1)
    p0 = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(6)]
    ref = [p0[:decay].clone().requires_grad_(), p0[decay:].clone().requires_grad_()]
    opt = torch.optim.AdamW([{"params": ref[:1], "weight_decay": 0.1}, {"params": ref[1:], "weight_decay": 0.0}],
                            lr=1e-2, foreach=False)
    mine, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    scratch = (torch.empty(1024), torch.empty(1024))  # smaller than the tile: several chunks
    for step, grad in enumerate(grads, 1):
        ref[0].grad, ref[1].grad = grad[:decay].clone(), grad[decay:].clone()
        opt.step()
        for p in ref:
            for key in ("exp_avg", "exp_avg_sq"):
                opt.state[p][key].copy_(opt.state[p][key].bfloat16())
        adamw_update_bf16_state(mine, grad.clone(), m, v, step, decay, cfg.lr, cfg, scratch)
    torch.testing.assert_close(mine, torch.cat([p.detach() for p in ref]), rtol=1e-5, atol=1e-6)


STATE_STEPS, STATE_TOL = 30, 2e-2  # docs/precision.md: 500 steps on the corpus stay within the same bound


def test_bf16_state_trains_within_tolerance_of_fp32_state_and_differs():
    """A few dozen steps on the debug model: losses within 2% (relative) of fp32 state, parameters not equal."""
    spec = SPECS["llama"]
    out = {}
    for dtype in ("fp32", "bf16"):
        trainer = StreamedTrainer(spec, knobs_for("lean", state_dtype=dtype, **LEAN), initial_tiles(spec),
                                  optim=AdamWConfig(lr=2e-3, weight_decay=0.1), backend="cpu", timeout_s=30)
        losses = [trainer.step(ids, tg).loss for ids, tg in batches(spec, STATE_STEPS)]
        out[dtype] = losses, trainer.tiles()
    rel = [abs(b - a) / a for a, b in zip(out["fp32"][0], out["bf16"][0])]
    assert max(rel) <= STATE_TOL, f"bf16 state drifts {max(rel):.2e} from fp32 state"
    assert out["bf16"][0][-1] < out["bf16"][0][0] - 0.3  # it learns
    moved = max((out["fp32"][1][u] - out["bf16"][1][u]).abs().max().item() for u in spec.units())
    assert moved > 1e-5, "bf16 state gave the fp32-state parameters exactly: the knob did nothing"


def test_bf16_state_is_8_bytes_per_param_with_ring_and_refused_on_gpu_updates():
    spec = PRESETS["llama3-8b"]
    plan = plan_memory(spec, 8, 2048, knobs_for("lean", state_dtype="bf16"))
    ring = 2 * 4 * max(spec.unit_params(u) for u in spec.units())  # two fp32 tiles of the largest unit
    scratch = 2 * 4 * (1 << 20)  # the m and v widening buffers
    assert plan.host.bytes_per_param == pytest.approx(8 + (ring + scratch) / spec.num_params, rel=1e-12)
    with pytest.raises(ScheduleError, match="state_dtype='bf16'.*GPU"):
        plan_memory(spec, 8, 2048, knobs_for("overlap-split", state_dtype="bf16"))
    with pytest.raises(ScheduleError, match="speculative clipping undoes"):  # the undo needs the fp32 moments
        plan_memory(spec, 8, 2048, knobs_for("arrival", clip=1.0, state_dtype="bf16"))


# ---- 3. the planner and the NVMe tier ------------------------------------------------------------------------------
def host_rows(text: str) -> tuple[list[float], float]:
    block = text.split("host memory")[1].split("\n\n")[0]
    rows = [float(m.group(1)) for m in re.finditer(r"^  (?!total|of which).*?\s([\d.]+)\s+[\d.]+$", block, re.M)]
    total = float(re.search(r"^  total\s+([\d.]+)", block, re.M).group(1))
    return rows, total


@pytest.mark.parametrize("knobs", [knobs_for("lean"), knobs_for("lean", state_dtype="bf16"),
                                   knobs_for("lean", state_tier="nvme-moments"), knobs_for("overlap")])
def test_plan_rows_add_up_to_the_total(knobs):
    plan = plan_memory(PRESETS["dense-120b"], 8, 2048, knobs)
    rows, total = host_rows(format_plan(plan))
    assert sum(rows) == pytest.approx(total, abs=0.01 * len(rows))
    assert sum(plan.host.components.values()) == plan.host.total_bytes


def test_dense_120b_fits_1536_gib_with_exact_fp32_adamw_and_the_named_fix_fits(capsys):
    rc = main(["plan", "--model", "dense-120b", "--host-gib", "1536", "--gpu-gib", "139"])
    out = capsys.readouterr().out
    assert rc == 1 and "host: DOES NOT FIT" in out  # the default schedule (18 B/param)
    fix = re.search(r"=> fits with exact fp32 AdamW with --set (.*?):", out).group(1).split()
    _, knobs = resolve_knobs("overlap", fix)
    plan = plan_memory(PRESETS["dense-120b"], 8, 2048, knobs)
    assert plan.host.total_bytes <= 1536 * GiB and knobs.state_dtype == "fp32" and knobs.state_tier == "host"
    assert main(["plan", "--model", "dense-120b", "--schedule", "lean", "--host-gib", "1536", "--gpu-gib", "139"]) == 0
    assert "host: fits" in capsys.readouterr().out


def test_a_model_that_does_not_fit_is_told_a_fix_that_fits():
    """1 TB host, 120B: only the NVMe tier (or bf16 state) fits; the report says so, and applying it fits."""
    plan = plan_memory(PRESETS["dense-120b"], 8, 2048, knobs_for("lean"))
    ok, lines = fit_report(plan, 1000 * GiB, None)
    text = "\n".join(lines)
    assert not ok and "with exact fp32 AdamW" not in text
    fix = re.search(r"=> fits with --set (.*?):", text).group(1).split()
    _, knobs = resolve_knobs("lean", fix)
    assert plan_memory(PRESETS["dense-120b"], 8, 2048, knobs).host.total_bytes <= 1000 * GiB


def test_nvme_tier_is_priced_by_the_simulator_and_refused_by_train():
    spec = PRESETS["debug"].with_layers(2)
    prof = load_profile("h200")
    host = simulate(lower(build_schedule(spec, 2, 64, knobs_for("lean"))), prof)
    nvme = simulate(lower(build_schedule(spec, 2, 64, knobs_for("lean", state_tier="nvme-moments"))), prof)
    tl = nvme.timeline
    for u in (EMBED, 0, 1, HEAD):  # each host update reads and writes m and v (8 B/param) through the drive
        row = tl[(tl.kind == "U") & (tl.layer == u)].iloc[0]
        drive_s = spec.unit_params(u) * 8 * (1 / prof.nvme_read_Bps + 1 / prof.nvme_write_Bps)
        assert row.end_s - row.start_s >= drive_s * (1 - 1e-9)
    assert nvme.step_s > host.step_s
    with pytest.raises(ScheduleError, match="planned only, not executed"):
        StreamedTrainer(spec, knobs_for("lean", state_tier="nvme-moments"), backend="cpu")


def test_nvme_tier_rules():
    with pytest.raises(ScheduleError, match="nvme-all.*weight_wire='bf16'"):
        plan_memory(PRESETS["debug"], 2, 64, knobs_for("lean", state_tier="nvme-all"))
    plan = plan_memory(PRESETS["debug"], 2, 64, dataclasses.replace(knobs_for("lean", weight_wire="bf16"),
                                                                    state_tier="nvme-all"))
    assert set(plan.host.nvme) == {"fp32 master", "adam m (fp32)", "adam v (fp32)"}


# ---- on the GPU machine ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("extra", [{}, {"state_dtype": "bf16"}, {"micro_batches": 2, "grad_ring": 1}])
def test_cuda_lean_layouts_give_the_cpu_backends_numbers_and_pin_as_planned(extra):
    from test_exec_cuda import DEBUG, B, T, run

    knobs = knobs_for("lean", compute_dtype="fp32", **extra)
    cpu_trainer, cpu = run("cpu", knobs)
    gpu_trainer, gpu = run("cuda", knobs)
    for a, b in zip(cpu, gpu):
        assert b.loss == pytest.approx(a.loss, rel=1e-4), a.step
    host = plan_memory(DEBUG, B, T, knobs).host
    store = gpu_trainer.store
    assert store.bytes_by_component() == {k: v for k, v in host.components.items() if k not in NOT_STORE}
    pages = 4096 * 5 * len(DEBUG.units())
    assert host.pinned_bytes <= store.pinned_bytes() <= host.pinned_bytes + pages


def test_a_bf16_state_run_resumes_bit_exactly(tmp_path):
    """Checkpoints carry the bf16 moments as they are: stopped at step 3 and resumed, the run's losses are those
    of the run that never stopped."""
    from test_hardening_resume import tiny
    from test_hardening_resume import train as run

    from megatrain.train.metrics import read_metrics

    lean = ["schedule.name=lean", "schedule.state_dtype=bf16"]
    run(tiny(tmp_path, *lean, name="straight"))
    run(tiny(tmp_path, *lean, name="stopped"), stop_at_step=3)
    run(tiny(tmp_path, *lean, "run.resume=latest", name="stopped"))
    losses = {}
    for name in ("straight", "stopped"):
        df = read_metrics(tmp_path / "runs" / name / "metrics.jsonl").drop_duplicates("step", keep="last")
        losses[name] = df.sort_values("step")["loss"].tolist()
    assert len(losses["straight"]) == 6 and losses["stopped"] == losses["straight"]
