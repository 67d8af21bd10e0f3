"""Live calibration fits what runs (issue 24 item 4): clipping steps (deferred host updates, GPU undo + redo), the
compiled layer and every task kind are priced, so the in-sample fit lands within 3% and the fitted rates are the
machine's, not the run's.

The synthetic tests are deterministic: "measured" steps are simulated on a hidden true profile (with a GPU redo
that costs 4.5 updates, not the default 2) and the fit starts from a profile wrong about every rate. The real-run
tests train a few steps on the CPU backend (2 shared cores: medians over steps, looser bounds, said where)."""
from __future__ import annotations

import dataclasses
import statistics
import warnings

import pytest

from megatrain.compile.builders import build_schedule
from megatrain.compile.knobs import knobs_for
from megatrain.compile.lower import lower
from megatrain.ir.facts import StepFacts
from megatrain.model.presets import PRESETS
from megatrain.model.spec import ModelSpec
from megatrain.profiling.compare import step_time_s
from megatrain.profiling.rounds import measure_rounds
from megatrain.profiling.live import calibrate_run
from megatrain.sim import CopyCurve, load_profile, simulate

# In-sample bound of a fit to simulated steps: the fit is a fixed point through the simulator, 6 iterations.
SYNTHETIC_BOUND = 0.03
EVERY_STEP_CLIPS = 1e-6  # a max norm every step's gradients exceed
NEVER_CLIPS = 1e6

# A model whose updates weigh as much as its compute at 32 tokens, so that an unpriced redo or a wrong update rate
# shows in the step time (the debug model's updates are a few percent of its step).
WIDE = ModelSpec("wide-debug", "llama", 256, 384, 1536, 4, 6, 2, 64, rms_norm_eps=1e-5, max_position_embeddings=1024)

CASES = {  # schedule, knob overrides: every kind of update placement, clipping on (speculative) and off
    "serial": ("serial", {}),
    "overlap": ("overlap", {}),
    "arrival": ("arrival", {}),
    "arrival, every step clips": ("arrival", {"clip": EVERY_STEP_CLIPS}),
    "arrival, clip never reached": ("arrival", {"clip": NEVER_CLIPS}),
    # clip_redo "step-end": the GPU units are undone and redone in every step that clips, so the redo's price is
    # seen (by default, a step after one that clipped defers them: the case below)
    "arrival-resident (eager), every step clips": ("arrival-resident", {"compile_layers": False,
                                                                       "resident_layers": 2, "clip_redo": "step-end",
                                                                       "clip": EVERY_STEP_CLIPS}),
    "arrival-resident (eager), every step clips, redos in the next step": (
        "arrival-resident", {"compile_layers": False, "resident_layers": 2, "clip": EVERY_STEP_CLIPS}),
    "arrival-resident (compiled)": ("arrival-resident", {"resident_layers": 2}),
    "overlap-split": ("overlap-split", {}),
    "lean": ("lean", {}),
}


def truth_and_start():
    """A hidden "true" machine (GPU redo at 4.5 updates) and a profile wrong about every rate."""
    start = load_profile("cpu")
    truth = dataclasses.replace(
        start, name="truth", matmul_flops_per_s={k: v / 3 for k, v in start.matmul_flops_per_s.items()},
        cpu_adam_params_per_s={2: 0.2e9}, gpu_adam_params_per_s=0.5e9, clip_redo_updates=4.5,
        h2d=CopyCurve.constant(2e9, 5e-6), d2h=CopyCurve.constant(3e9, 5e-6), host_memory_Bps=12e9,
        task_overhead_s={"h2d": 3e-4, "compute": 8e-4, "d2h": 2e-4, "cpu": 1e-3, "N": 5e-4})
    return truth, start


def program_of(case: str, spec=PRESETS["debug"], batch=8, seq=128):
    name, kw = CASES[case]
    knobs = knobs_for(name, compute_dtype="fp32", **kw)
    prog = lower(build_schedule(spec, batch, seq, knobs))
    prog.name = case
    return prog


def as_measured(timeline, prog, profile):
    """A simulated Timeline as the executor measures it: the launch overhead the simulator charges inside a task is
    a gap before its start event (profiling/overhead.py)."""
    over = [min(profile.overhead(prog.tasks[t].stream, prog.tasks[t].kind), e - s)
            for t, s, e in zip(timeline["task"], timeline["start_s"], timeline["end_s"])]
    return timeline.assign(start_s=timeline["start_s"] + over)


def measured_on(prog, truth, clip_share: float, n: int = 4):
    """n steps "measured" on the true machine, each recording whether it clipped (as StreamedTrainer.step does)."""
    steps = []
    for i in range(n):
        tl = as_measured(simulate(prog, truth, StepFacts(clip_share)).timeline, prog, truth).assign(step=i)
        tl.attrs["clipped"] = clip_share >= 1.0
        steps.append(tl)
    return steps


@pytest.mark.parametrize("case", list(CASES))
def test_in_sample_fit_of_every_schedule_is_within_3_percent(case):
    truth, start = truth_and_start()
    prog = program_of(case)
    clips = prog.placement.speculative_clip and CASES[case][1].get("clip") == EVERY_STEP_CLIPS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the compiled case starts from eager tables (the simulator says so)
        cal = calibrate_run(prog, start, measured_on(prog, truth, 1.0 if clips else 0.0), warmup=1)
    assert abs(cal.error_after) < SYNTHETIC_BOUND, (case, cal.error_before, cal.error_after)
    # No kind is left unpriced: each kind's summed time per step is near the measured one. Not exact: copies of
    # one direction share one fitted curve, scaled from the starting profile's shape (P and S differ in size).
    k, err = cal.kinds, (cal.kinds["pred_s"] - cal.kinds["meas_s"]).abs()
    assert ((err <= 0.25 * k["meas_s"] + 1e-5) & (err <= 0.01 * cal.measured_step_s)).all(), k.to_string()


def test_a_run_where_every_step_clips_fits_the_machines_rates():
    """The bug of issue 24: calibrating clip-every-step steps as if no step clipped (the redo and deferred updates
    unpriced) fits a CPU update many times too fast and still misses the step; with the facts the fitted rates are
    the truth's, and the GPU redo's cost is found."""
    truth, start = truth_and_start()
    # a model whose updates outweigh their launch overheads, so that the rates are well determined
    prog = program_of("arrival-resident (eager), every step clips", WIDE, 1, 32)
    steps = measured_on(prog, truth, 1.0)
    cal = calibrate_run(prog, start, steps)
    assert cal.before.facts.clip_share == 1.0 and cal.after.facts.clip_share == 1.0
    assert abs(cal.error_after) < SYNTHETIC_BOUND
    assert cal.profile.cpu_adam_rate() == pytest.approx(truth.cpu_adam_rate(), rel=0.05)
    assert cal.profile.gpu_adam_params_per_s == pytest.approx(truth.gpu_adam_params_per_s, rel=0.05)
    assert cal.profile.clip_redo_updates == pytest.approx(truth.clip_redo_updates, rel=0.05)
    # What calibration did before: every step simulated as one that does not clip. The host rate survives (U and
    # V on the host are one flow), but the GPU redo stays unpriced and the fit misses the step it was fitted to.
    blind = calibrate_run(prog, start, steps, clipped=[False] * len(steps))
    assert blind.error_after < -0.1, blind.error_after
    assert "clipped" in cal.lines()[0]


def test_clipping_and_quiet_steps_fit_the_same_update_rates():
    truth, start = truth_and_start()
    prog = program_of("arrival, every step clips", WIDE, 1, 32)
    clipping = calibrate_run(prog, start, measured_on(prog, truth, 1.0))
    quiet = calibrate_run(prog, start, measured_on(prog, truth, 0.0))
    assert clipping.profile.cpu_adam_rate() == pytest.approx(quiet.profile.cpu_adam_rate(), rel=0.02)
    # the same host work, in the V tasks of a step after one that clipped, in the U tasks of a quiet one
    by_kind = {name: cal.after.timeline.groupby("kind")["end_s"].sum() - cal.after.timeline.groupby("kind")[
        "start_s"].sum() for name, cal in (("clipping", clipping), ("quiet", quiet))}
    assert by_kind["clipping"]["V"] > 5 * by_kind["clipping"]["U"] and by_kind["quiet"]["U"] > 5 * by_kind["quiet"]["V"]


def test_a_run_mixing_clipping_and_quiet_steps_is_weighed():
    truth, start = truth_and_start()
    prog = program_of("arrival-resident (eager), every step clips", WIDE, 1, 32)
    steps = measured_on(prog, truth, 0.0, 3) + measured_on(prog, truth, 1.0, 1)
    cal = calibrate_run(prog, start, steps, warmup=0)
    assert cal.after.facts.clip_share == 0.25
    want = 0.75 * step_time_s(steps[0]) + 0.25 * step_time_s(steps[-1])  # medians of each kind of step
    assert cal.measured_step_s == pytest.approx(want, rel=1e-9)
    assert step_time_s(steps[-1]) > 1.05 * step_time_s(steps[0])
    assert abs(cal.error_after) < SYNTHETIC_BOUND


def test_speculative_steps_that_do_not_say_whether_they_clipped_are_refused():
    truth, start = truth_and_start()
    prog = program_of("arrival, every step clips")
    steps = [as_measured(simulate(prog, truth).timeline, prog, truth) for _ in range(3)]
    with pytest.raises(ValueError, match="which steps clipped"):
        calibrate_run(prog, start, steps)
    with pytest.raises(ValueError, match="one per timeline"):
        calibrate_run(prog, start, steps, clipped=[True])
    plain = program_of("arrival")  # without speculative clipping a step's work does not depend on it
    calibrate_run(plain, start, [simulate(plain, truth).timeline for _ in range(3)])


def test_the_compiled_layer_is_fitted_and_priced_apart_from_the_eager_one():
    truth, start = truth_and_start()
    compiled = program_of("arrival-resident (compiled)")
    eager = lower(build_schedule(PRESETS["debug"], 8, 128, dataclasses.replace(
        knobs_for("arrival-resident", compute_dtype="fp32", resident_layers=2), compile_layers=False)))
    assert compiled.placement.layer_kernel == "compiled" and eager.placement.layer_kernel == "eager"
    fast = dataclasses.replace(truth, matmul_flops_per_s={k: 10 * v for k, v in start.matmul_flops_per_s.items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cal = calibrate_run(compiled, start, measured_on(compiled, fast, 0.0))
    layer = [t for t in cal.profile.compute_tables if t.unit == "layer" and t.seq == 128 and t.dtype == "fp32"]
    assert layer and all(t.compiled for t in layer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled tables exist now: no eager fallback
        assert simulate(compiled, cal.profile).step_s == pytest.approx(cal.after.step_s)
    # the eager program keeps the starting profile's eager pricing of the layer
    assert simulate(eager, cal.profile).step_s > 1.5 * cal.after.step_s


def test_deferred_updates_cost_one_update_each_and_their_rates_are_fitted():
    """clip_redo "next-step" (the default): in a step that clips (after one that clipped) every update waits for
    the norm, the host's in the next step's V, the GPU's in this step's V, each one update and its U nothing,
    whatever the redo would cost; a run where every step clips still fits both update rates."""
    prog = program_of("arrival-resident (eager), every step clips, redos in the next step", WIDE, 1, 32)
    p = load_profile("cpu")
    for k in (2.0, 5.0):
        tl = simulate(prog, dataclasses.replace(p, clip_redo_updates=k), StepFacts(1.0)).timeline
        dur = dict(zip(tl["task"], tl["end_s"] - tl["start_s"]))
        for u in (0, 1):  # the resident layers
            assert dur[f"U{u}"] == pytest.approx(p.overhead("compute", "U"), abs=1e-12)
            assert dur[f"V{u}"] == pytest.approx(p.overhead("compute", "V") + prog.tasks[f"V{u}"].params
                                                 / p.gpu_adam_params_per_s, rel=1e-9)
    truth, start = truth_and_start()
    cal = calibrate_run(prog, start, measured_on(prog, truth, 1.0))
    assert abs(cal.error_after) < SYNTHETIC_BOUND
    assert cal.profile.cpu_adam_rate() == pytest.approx(truth.cpu_adam_rate(), rel=0.05)
    assert cal.profile.gpu_adam_params_per_s == pytest.approx(truth.gpu_adam_params_per_s, rel=0.05)


def test_the_gpu_redo_costs_its_profiled_updates():
    prog = program_of("arrival-resident (eager), every step clips")
    p = load_profile("cpu")
    rows = {}
    for k in (2.0, 5.0):
        tl = simulate(prog, dataclasses.replace(p, clip_redo_updates=k), StepFacts(1.0)).timeline
        rows[k] = tl[(tl["kind"] == "V") & (tl["stream"] == "compute")]
    v = prog.tasks[rows[2.0]["task"].iloc[0]]
    d = {k: float((r["end_s"] - r["start_s"]).iloc[0]) for k, r in rows.items()}
    assert d[5.0] - d[2.0] == pytest.approx(3.0 * v.params / p.gpu_adam_params_per_s, rel=1e-6)


# ---- real steps on the CPU backend ----------------------------------------------------------------------------
REAL = ["serial", "overlap", "arrival, every step clips", "arrival, clip never reached",
        "arrival-resident (eager), every step clips", "overlap-split"]
# Measured on the 2-core machine shared with 5 other sessions, 12 steps, 2 warm-up: in-sample errors of -0.4% ..
# +3.0% when quiet, up to +20% when other processes loaded some steps. The bounds leave room for that: the 3%
# claim is the synthetic tests' above (CPU timing here is not stable enough to hold it).
REAL_BOUND = 0.25
REAL_MEDIAN_BOUND = 0.1


@pytest.fixture(scope="module")
def real_runs():
    # the compiled layer is left out here: torch.compile of the layer takes about a minute on the CPU backend
    variants = {case: knobs_for(CASES[case][0], compute_dtype="fp32", **CASES[case][1]) for case in REAL}
    rows = measure_rounds(WIDE, variants, 1, 32, rounds=1, warmup=2, steps=10, device="cpu")
    return {row.config: (row.program, row.timelines) for row in rows}  # the 10 timed steps (after 2 warm-up)


def test_real_steps_fit_in_sample(real_runs):
    start = load_profile("cpu")
    errors = {}
    for case, (prog, steps) in real_runs.items():
        if prog.placement.speculative_clip:  # what the trainer recorded: the max norm decides
            flags = [t.attrs["clipped"] for t in steps]
            clips_always = CASES[case][1].get("clip") == EVERY_STEP_CLIPS
            assert all(flags) if clips_always else not any(flags), (case, flags)
        errors[case] = calibrate_run(prog, start, steps, warmup=0).error_after
    assert all(abs(e) <= REAL_BOUND for e in errors.values()), errors
    assert abs(statistics.median(errors.values())) <= REAL_MEDIAN_BOUND, errors


def test_real_clipping_steps_do_not_inflate_the_update_rate(real_runs):
    """The same schedule with every step clipping and with none: their fitted host update rates agree (each step
    of both does one update per unit; the clipping one in V, after the norm). Before the fix the clipping run's
    host rate was not fitted at all (its U tasks' measured work was below their overhead; ratios 0.24-0.75)."""
    start = load_profile("cpu")
    rate = {case: calibrate_run(real_runs[case][0], start, real_runs[case][1], warmup=0).profile.cpu_adam_rate()
            for case in ("arrival, every step clips", "arrival, clip never reached")}
    a, b = rate.values()
    # Measured ratios 0.55, 0.82, 0.99 (three runs). Not 1: on the CPU backend a host update beside the
    # compute shares the two cores, which the simulator does not model (it models host memory shared with the
    # copies, with the cpu profile's host_memory_Bps, which calibration does not fit), while a deferred update runs
    # after the backward. The synthetic test above holds the exact claim (2%).
    assert 0.4 < a / b < 2.5, rate


def test_compute_measured_beside_copies_is_fitted_back_to_its_time_alone():
    """The machine slows compute while copies are in flight (`compute_beside_copy`, as the profile measured it).
    The steps' task durations include that slowdown; the fitted tables hold the time alone (each task's duration
    divided by the slowdown its copy overlap implies), so the simulator, which slows them again, is not counted
    twice: the fitted layer F and B are the true machine's, and the in-sample fit holds."""
    from megatrain.profiling.fit import copied
    from megatrain.sim import CostModel

    beside = {"F": 1.25, "R": 1.25, "B": 1.4}
    truth, start = (dataclasses.replace(p, compute_beside_copy=beside) for p in truth_and_start())
    # copies slow enough to run beside most of a layer's compute (the truth's GB/s copies end in a few us)
    truth = dataclasses.replace(truth, h2d=CopyCurve.constant(2e7, 5e-6), d2h=CopyCurve.constant(3e7, 5e-6))
    prog = program_of("overlap")
    steps = measured_on(prog, truth, 0.0)
    overlapped = copied(steps[0]).set_index("task")["copied"]
    layer = [t for t in prog.tasks.values() if t.stream == "compute" and t.kind in ("F", "B") and t.unit >= 0]
    assert max(overlapped[t.id] for t in layer) > 0.5  # copies do run beside the layers here
    cal = calibrate_run(prog, start, steps, warmup=0)
    assert abs(cal.error_after) <= SYNTHETIC_BOUND
    fitted, true = CostModel(prog, cal.profile), CostModel(prog, truth)
    for kind in ("F", "B"):
        tasks = [t for t in layer if t.kind == kind]
        mean = statistics.mean(fitted.compute_s(t) for t in tasks) / statistics.mean(true.compute_s(t) for t in tasks)
        assert mean == pytest.approx(1.0, abs=0.01), kind
