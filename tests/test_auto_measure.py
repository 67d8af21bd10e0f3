"""`--schedule auto` measures the K best predicted candidates on the run's first steps and trains with the fastest
measured: the measured time decides, not the prediction; the numerics are never changed (the compiled layer aside,
unless the user set it); clipping is priced at the measured share; the steps measured are the run's own."""
import json
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest

from megatrain.cli import main
from megatrain.compile.knobs import NUMERICS_KNOBS, ScheduleKnobs
from megatrain.engine.trainer import StreamedTrainer
from megatrain.model.presets import PRESETS
from megatrain.sim import load_profile, simulate
from megatrain.train.autoswitch import (MAX_MEASURE, RUNOFF_BAND, TIMED_STEPS, UNTIMED_STEPS, AutoChoice,
                                       measure_candidates, varies_compile)
from megatrain.tune.auto import AutoBudget, auto_candidates, choose_auto, host_hedge
from megatrain.units import GiB

SPEC = PRESETS["debug"]


def _train(tmp_path) -> list[str]:
    """`megatrain train` of the debug model on the CPU backend with the shipped cpu profile (no quick profiling)."""
    profile = tmp_path / "cpu.json"
    if not profile.is_file():
        load_profile("cpu").save(profile)
    return ["train", "--batch", "2", "--seq", "16", "--device", "cpu", "--no-progress", "--set",
            f"run.profile={profile}", "--set", "run.checkpoint_every=0", "--set", "run.eval_every=0",
            "--out-dir", str(tmp_path / "runs")]


def _step(time_s: float, clips: bool = False):
    """What AutoChoice reads of a StepResult: its time and whether its update clipped."""
    return SimpleNamespace(time_s=time_s, clipped=clips)


def _choice(base: ScheduleKnobs, measure: int = 3, band: float = 0.0) -> AutoChoice:
    """band 0: exactly `measure` candidates (the debug model's candidates are predicted within 10% of one another,
    so the default band would measure MAX_MEASURE of them)."""
    pick = choose_auto(SPEC, 2, 16, base, "cpu", AutoBudget(GiB, None, "given"))
    return AutoChoice(SPEC, 2, 16, pick.knobs, pick.label, pick.ranked, load_profile("cpu"), measure, band=band)


def _drive(auto: AutoChoice, seconds, clips: bool = False) -> list[str]:
    """Run auto's measuring with step times from `seconds(label)`; returns the candidates run, in order."""
    lines, ran = [], []
    auto.start(100, lines.append)
    auto.log_lines = lines
    running = auto.label
    while True:
        cand = auto.before_step()
        if cand is not None:
            running = cand.label
        if auto.done:
            return ran
        ran.append(running)
        auto.after_step(_step(seconds(running), clips))


def test_the_fastest_measured_wins_over_the_prediction():
    """The best predicted candidate is measured 10x slower than predicted (the prediction is wrong on purpose):
    auto measures 3, chooses the fastest measured, switches to it, and prints predicted and measured for each."""
    auto = _choice(ScheduleKnobs(clip=0))
    first = auto.label
    predicted = {c.label: c.step_s for c in auto.ranked}
    ran = _drive(auto, lambda label: predicted[label] * (10 if label == first else 1.0))
    per = UNTIMED_STEPS + TIMED_STEPS  # the next best predicted (of any host layout) is measured next
    second, third = ran[per], ran[2 * per]
    assert ran[:3 * per] == [first] * per + [second] * per + [third] * per and second == auto.pool[1].label
    # the other two measured within 5% of each other: a run-off, the last measured first (it runs on, no untimed
    # step), then the second
    assert abs(predicted[second] / predicted[third] - 1) <= RUNOFF_BAND
    assert ran[3 * per:] == [third] * TIMED_STEPS + [second] * per
    assert auto.done and auto.chosen.label != first and auto.running is auto.chosen
    assert auto.chosen.label == min((second, third), key=predicted.get)
    assert auto.measured_s(auto.chosen.label) == min(auto.measured_s(label) for label in auto.times)
    lines = auto.log_lines
    assert any(line.startswith("auto: run-off: 2 measured within 5%") and line.endswith(f"{third}, {second}")
               for line in lines)
    table = [line for line in lines if line.startswith("  ") and "measured " in line]
    assert len(table) == 3 and all("predicted " in line and "error " in line for line in table)
    assert sum("<- chosen" in line for line in table) == 1 and sum("median of 4 steps" in line for line in table) == 2
    assert any(f"{first}: predicted" in line and "error -90.0%" in line for line in table)
    # each measured step in ms, in the order run (the host's noise is read off them)
    slow = " ".join(f"{10 * predicted[first] * 1e3:,.0f}" for _ in range(TIMED_STEPS))
    assert any(f"{first}: predicted" in line and line.endswith(f"; steps {slow})") for line in table)
    assert lines[-1] in (f"auto: switching to {auto.chosen.label}, the fastest measured",
                         f"auto: {auto.chosen.label}, the fastest measured, runs on")


def test_the_run_off_undoes_a_drift_that_favours_the_first_measured():
    """The machine slows by 2% a step over the run's first steps (a host warming up). Measured once each, the first
    candidate (1.00 s at rest) looks faster than the second (0.97 s at rest, measured later); the run-off measures
    both again in the reverse order and the second, truly faster, is chosen. A third, 10% slower at rest and measured
    beyond 5% of the fastest, is not run again."""
    auto = _choice(ScheduleKnobs(clip=0))
    order = [c.label for c in auto.ranked[:3]]
    rest = {order[0]: 1.00, order[1]: 0.97, order[2]: 1.10}
    step = iter(range(1, 100))
    ran = _drive(auto, lambda label: rest[label] * (1 + 0.02 * next(step)))
    first_pass = {label: statistics.median(auto.times[label][:TIMED_STEPS]) for label in order}
    assert first_pass[order[0]] < first_pass[order[1]]  # drift made the first pass choose wrong
    per = UNTIMED_STEPS + TIMED_STEPS
    assert ran[3 * per:] == [order[1]] * per + [order[0]] * per  # the run-off: reverse of the first order
    assert len(auto.times[order[2]]) == TIMED_STEPS  # not run again
    assert auto.chosen.label == order[1]


def test_no_run_off_when_one_candidate_is_clearly_fastest_or_the_run_is_too_short():
    auto = _choice(ScheduleKnobs(clip=0))
    order = [c.label for c in auto.ranked[:3]]
    ran = _drive(auto, lambda label: {order[0]: 1.0, order[1]: 0.8, order[2]: 1.2}[label])
    assert len(ran) == 3 * (UNTIMED_STEPS + TIMED_STEPS) and auto.chosen.label == order[1]
    assert not any(line.startswith("auto: run-off:") for line in auto.log_lines)
    short = _choice(ScheduleKnobs(clip=0))
    lines = []
    short.start(3 * (UNTIMED_STEPS + TIMED_STEPS) + 2, lines.append)  # room for 2 steps after the first pass
    while not short.done:
        short.before_step()
        short.after_step(_step(0.01))
    assert len(short.clipped) == 3 * (UNTIMED_STEPS + TIMED_STEPS)
    assert not any(line.startswith("auto: run-off:") for line in lines)  # two contenders need 2 + 3 steps


def test_a_short_run_off_keeps_the_fastest_measured():
    """Three within 5%, room for two in the run-off (3 + 3 steps, neither is the one running): the two fastest
    measured run again, the first measured (the fastest here, the one a drift favours) among them; the slowest, the
    one running, is left out."""
    auto = _choice(ScheduleKnobs(clip=0))
    order = [c.label for c in auto.ranked[:3]]
    seconds = {order[0]: 1.00, order[1]: 1.02, order[2]: 1.03}
    lines = []
    auto.start(5 * (UNTIMED_STEPS + TIMED_STEPS), lines.append)
    running = auto.label
    while not auto.done:
        cand = auto.before_step()
        running = cand.label if cand is not None else running
        auto.after_step(_step(seconds[running]))
    runoff = next(line for line in lines if line.startswith("auto: run-off:"))
    assert runoff.endswith(f"{order[1]}, {order[0]}")  # reverse first order; order[2], the slowest, left out
    assert len(auto.times[order[0]]) == len(auto.times[order[1]]) == 2 * TIMED_STEPS
    assert len(auto.times[order[2]]) == TIMED_STEPS and auto.chosen.label == order[0]


def test_every_candidate_the_simulator_cannot_tell_from_the_best_is_measured():
    """Beyond K, every candidate predicted within the band of the best is measured, up to MAX_MEASURE; one
    predicted further off is not (H200: the best named schedule, 6.5% behind auto's pick, was never measured)."""
    auto = _choice(ScheduleKnobs(clip=0), measure=2, band=0.10)
    _drive(auto, lambda label: 0.01)
    assert MAX_MEASURE == 6 and len(auto.times) == 6  # more than 6 are within 10% (`_choice`): capped, not K = 2
    # the measured ones are the fastest predicted, in order; none predicted beyond the band unless K asks for it
    assert list(auto.times) == [c.label for c in sorted(auto.pool, key=lambda c: c.step_s)][:len(auto.times)]
    assert "within 10% of the best" in auto.log_lines[0]
    narrow = _choice(ScheduleKnobs(clip=0), measure=2, band=0.0)
    _drive(narrow, lambda label: 0.01)
    assert len(narrow.times) == 2


class _Trainer:
    """What measure_candidates and switch_trainer use of a StreamedTrainer: `fails(name, trainer)` says whether the
    switch to `name` runs out of GPU memory (asked once per switch)."""

    store = None

    def __init__(self, auto: AutoChoice, fails):
        self.knobs, self.schedule_name, self.fails = auto.knobs, auto.label, fails

    def program(self, batch, seq):
        return self.schedule_name

    def switch_schedule(self, knobs, batch, seq, name):
        import torch

        if self.fails(name, self):
            raise torch.OutOfMemoryError("CUDA out of memory (made by the test)")
        self.knobs, self.schedule_name = knobs, name
        return name, None

    def use_program(self, program):
        self.schedule_name = program


def test_when_the_switch_to_the_fastest_measured_fails_the_one_running_is_returned():
    """measure_candidates returns what the trainer runs: the fastest measured (the second) cannot start at the switch
    after measuring, so the third, the one that ran last, runs on and is returned (and `chosen`)."""
    auto = _choice(ScheduleKnobs(clip=0))
    order = [c.label for c in auto.ranked]
    seconds = {order[0]: 0.1, order[1]: 0.01, order[2]: 0.02}

    switches = iter(range(1, 100))  # after switching to the second and the third: back to the second fails
    trainer, lines = _Trainer(auto, lambda name, t: next(switches) == 3), []
    ran = measure_candidates(auto, trainer, lambda: _step(seconds[trainer.schedule_name]), lines.append)
    assert ran.label == order[2] == trainer.schedule_name and ran.knobs == trainer.knobs and auto.chosen is ran
    assert f"auto: switching to {order[1]}, the fastest measured" in lines
    assert any(line.startswith(f"auto: {order[1]} could not start (out of GPU memory") and
               line.endswith(f"{order[2]} runs on") for line in lines)


def test_a_run_off_candidate_that_cannot_start_again_is_not_chosen():
    """The first pass measures 3 within 5% of one another; in the run-off the switch back to the fastest of them
    runs out of GPU memory: it leaves the pool (its first-pass time is printed, it is not chosen), and the run-off
    goes on with the others."""
    auto = _choice(ScheduleKnobs(clip=0))
    order = [c.label for c in auto.ranked[:3]]
    seconds = {order[0]: 0.0100, order[1]: 0.0101, order[2]: 0.0102}

    failed = []

    def fails(name, trainer) -> bool:  # the run-off's switch back to the first measured, once
        if name == order[0] and trainer.schedule_name != order[0] and len(auto.times) == 3 and not failed:
            failed.append(name)
            return True
        return False

    trainer, lines = _Trainer(auto, fails), []
    ran = measure_candidates(auto, trainer, lambda: _step(seconds[trainer.schedule_name]), lines.append)
    assert any(line.startswith("auto: run-off: 3 measured") for line in lines)
    assert order[0] in auto.unstarted and ran.label != order[0] and auto.chosen is ran
    assert any(line.startswith(f"  {order[0]}: predicted") and "in the first pass, then could not start again"
               in line for line in lines)
    assert ran.label == order[1]  # the fastest of those that could run


def test_clipping_is_priced_at_the_measured_share():
    """Exact clipping (base clip=1): arrival candidates clip speculatively. Before the run they are priced at 0
    clipping steps; once every measured step clipped, at 1 (the redo of every update)."""
    auto = _choice(ScheduleKnobs(clip=1.0), measure=2)
    assert all(c.result.facts.clip_share == 0.0 for c in auto.ranked)
    ran = _drive(auto, lambda label: 0.01, clips=True)
    speculative = [c for c in auto.pool if c.result.program.placement.speculative_clip]
    assert speculative and all(c.result.facts.clip_share == 1.0 for c in speculative)
    assert any(f"100% of the {len(ran)} steps clipped" in line for line in auto.log_lines)


def test_numerics_are_never_varied_but_the_compiled_layer_may_be():
    base = ScheduleKnobs(clip=0.5, compute_dtype="fp32", grad_wire="bf16", micro_batches=2, loss_chunk_tokens=512)
    for vary in (False, True):
        cands = auto_candidates(SPEC, base, vary_compile=vary)
        for label, k in cands.items():
            assert {n: getattr(k, n) for n in NUMERICS_KNOBS if n != "compile_layers"} == \
                {n: getattr(base, n) for n in NUMERICS_KNOBS if n != "compile_layers"}, label
        assert {k.compile_layers for k in cands.values()} == ({True, False} if vary else {False})
    compiled = auto_candidates(SPEC, replace(base, compile_layers=True))
    assert all(k.compile_layers for k in compiled.values())  # set by the user: kept
    assert varies_compile(False, "cuda") and not varies_compile(True, "cuda") and not varies_compile(False, "cpu")


@pytest.mark.parametrize("extra, vary", [([], True), (["--set", "compile_layers=false"], False)])
def test_train_varies_the_compiled_layer_unless_the_user_set_it(monkeypatch, extra, vary):
    """On a GPU run (run.device=cuda: auto is asked before anything runs) the compiled layer is a candidate knob
    unless the config or --set names compile_layers."""
    seen = {}

    def fake(*args, **kwargs):
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("megatrain.train.autoswitch.choose_before_run", fake)
    with pytest.raises(SystemExit):
        main(["train", "--schedule", "auto", "--device", "cuda", "--gpu-budget-gib", "1", *extra])
    assert seen["vary_compile"] is vary and seen["measure"] == 3


def _losses(run) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def test_train_auto_measures_on_its_own_steps_and_keeps_the_numbers(tmp_path, capsys, monkeypatch):
    """`megatrain train --schedule auto` (K=3) with the best predicted candidate measured 50x slower than it runs:
    the run measures 3 candidates on steps 1-9, trains on with another, and its 12 losses equal those of a plain
    run of the same numerics (the default schedule): the measured steps are training steps of the run."""
    slow = {}
    real = StreamedTrainer.step

    def step(self, ids, targets):  # the machine's timing, made wrong for one schedule on purpose
        r = real(self, ids, targets)
        slow.setdefault("label", self.schedule_name)  # the first step runs the best predicted candidate
        return replace(r, time_s=r.time_s * 50) if self.schedule_name == slow["label"] else r

    monkeypatch.setattr(StreamedTrainer, "step", step)
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-band", "0", "--steps", "12", "--name", "auto"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if line.startswith("  ") and " ms/step (error " in line]
    assert len(table) == 3 and sum("<- chosen" in line for line in table) == 1
    chosen = next(line for line in table if "<- chosen" in line).split(":")[0].strip()
    # the chosen one is switched to, or runs on when it was the last measured (CPU timing decides which of the
    # two fast candidates wins)
    assert chosen != slow["label"] and (f"auto: switching to {chosen}, the fastest measured" in out
                                        or f"auto: {chosen}, the fastest measured, runs on" in out)
    assert not any("recalibrates" in line for line in out)  # one mechanism: measuring
    monkeypatch.setattr(StreamedTrainer, "step", real)
    assert main([*_train(tmp_path), "--steps", "12", "--name", "plain"]) == 0
    auto, plain = _losses(tmp_path / "runs" / "auto"), _losses(tmp_path / "runs" / "plain")
    assert len(auto) == 12 and auto == pytest.approx(plain, rel=1e-6, abs=1e-7)
    saved = (tmp_path / "runs" / "auto" / "config.toml").read_text()  # the schedule that trained on is the one recorded
    assert "optimizer = " in saved


def test_auto_measure_0_trains_with_the_best_predicted(tmp_path, capsys):
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-measure", "0", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "auto: not measuring (--auto-measure 0): training with the best predicted" in out
    assert "auto: measuring" not in out and "auto: switching" not in out
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-measure", "-1"]) == 2
    assert "--auto-measure -1: give the number of candidates to measure, 0 or more" in capsys.readouterr().err
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-band", "1.5"]) == 2
    assert "--auto-band 1.5: give a fraction of the best predicted step time" in capsys.readouterr().err


def test_a_short_run_measures_what_its_steps_allow(tmp_path, capsys):
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-band", "0", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "auto: 4 steps measure 1 candidate(s), not 3" in out and "auto: measured 1 candidate(s)" in out


def test_a_candidate_whose_switch_runs_out_of_gpu_memory_is_skipped_and_the_run_goes_on(tmp_path, capsys,
                                                                                         monkeypatch):
    """The second candidate's buffers do not fit (torch's out-of-memory error at its switch, made here on purpose):
    the Program that ran before takes its buffers back, the candidate is listed as not measured with the reason,
    another is measured in its place, and the run's 12 losses are those of a plain run (nothing is lost)."""
    import torch

    real = StreamedTrainer.use_program
    seen = []

    def use_program(self, program):
        seen.append(program.name)
        if len(set(seen)) == 2 and seen.count(program.name) == 1:  # the second candidate's first switch
            self._work = self._runtime = None  # as a real failure leaves it: the old buffers already dropped
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.32 GiB (made by the test)")
        return real(self, program)

    monkeypatch.setattr(StreamedTrainer, "use_program", use_program)
    assert main([*_train(tmp_path), "--schedule", "auto", "--auto-band", "0", "--steps", "12", "--name", "auto"]) == 0
    out = capsys.readouterr().out
    failed = sorted(set(seen), key=seen.index)[1]
    assert f"auto: {failed} could not start (out of GPU memory at its switch: CUDA out of memory." in out
    assert f"  {failed}: predicted" in out and "not measured: out of GPU memory at its switch" in out
    table = [line for line in out.splitlines() if line.startswith("  ") and " ms/step (error " in line]
    assert len(table) == 3 and failed not in "".join(table)  # three others measured
    monkeypatch.setattr(StreamedTrainer, "use_program", real)
    assert main([*_train(tmp_path), "--steps", "12", "--name", "plain"]) == 0
    auto, plain = _losses(tmp_path / "runs" / "auto"), _losses(tmp_path / "runs" / "plain")
    assert len(auto) == 12 and auto == pytest.approx(plain, rel=1e-6, abs=1e-7)


def test_the_last_measured_slot_goes_to_the_host_hedge(monkeypatch):
    """A hedge outside the K best predicted is measured in the last of the K slots (the K-1 best first, in predicted
    order), and one line says why; a hedge the K best include changes nothing."""
    far = None

    def hedge(pool, profile, band):
        return far

    monkeypatch.setattr("megatrain.train.autoswitch.host_hedge", hedge)
    auto = _choice(ScheduleKnobs(clip=0), measure=3)
    far = auto.ranked[-1]
    predicted = {c.label: c.step_s for c in auto.ranked}
    ran = _drive(auto, lambda label: predicted[label])
    per = UNTIMED_STEPS + TIMED_STEPS
    assert [ran[0], ran[per], ran[2 * per]] == [auto.ranked[0].label, auto.ranked[1].label, far.label]
    assert sum(line.startswith(f"auto: the last of the 3 measured is {far.label}") for line in auto.log_lines) == 1
    inside = _choice(ScheduleKnobs(clip=0), measure=3)
    far = inside.ranked[1]
    ran = _drive(inside, lambda label: predicted[label])
    assert [ran[0], ran[per], ran[2 * per]] == [c.label for c in inside.ranked[:3]]
    assert not any(line.startswith("auto: the last of") for line in inside.log_lines)


def test_the_host_hedge_is_the_close_candidate_least_bound_to_the_host():
    """bench-3b 8 x 2048 without clipping, 48 GiB, the shipped H200 profile: the six best predicted keep 7-14 layers
    resident; the hedge, predicted within 10% of the best, keeps more and is the fastest of them all should the host's
    CPU update run at half the profile's rate."""
    spec = PRESETS["bench-3b"]
    profile = load_profile("h200-measured")
    pick = choose_auto(spec, 8, 2048, ScheduleKnobs(clip=0.0), profile, AutoBudget(48 * GiB, None, "given"),
                       vary_compile=True)
    hedge = host_hedge(pick.ranked, profile, 0.10)
    top = pick.ranked[:MAX_MEASURE - 1]
    assert hedge not in top and hedge.step_s <= 1.10 * pick.ranked[0].step_s
    assert hedge.knobs.resident_layers > max(c.knobs.resident_layers for c in top)
    slow = replace(profile, cpu_adam_params_per_s={t: r / 2 for t, r in profile.cpu_adam_params_per_s.items()})
    hedge_slow = simulate(hedge.result.program, slow).mean_step_s
    assert all(hedge_slow < simulate(c.result.program, slow).mean_step_s for c in top)
    assert host_hedge(pick.ranked[:1], profile, 0.10) is None  # one candidate: nothing to hedge
