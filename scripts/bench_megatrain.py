"""One megatrain training run on the GPU machine, measured the way bench/baseline_train.py measures the peers.

Random token ids, 2 warm-up steps, median of the timed steps; model TFLOP/s = 6·N·tokens / step time (recompute
not counted, as BENCHMARKS.md counts). Prints one `RESULT {...}` JSON line, plus the predicted numbers of the
simulator for the same Program when a profile is given: with that profile (`predicted_*`), with it fitted to this
run's timed steps (live calibration, profiling/live.py: `calibrated_*`, in-sample), and with a profile calibrated
on another run (`--calibrated-profile FILE`: `transfer_*`, out of sample). `--save-calibrated FILE` writes this
run's calibrated profile for that.

`--schedule auto` chooses as `megatrain train --schedule auto` does, through the same code
(train/autoswitch.py `choose_before_run`: the budget rule of megatrain/tune/auto.py, `--profile` if given, else this
machine's profile in the per-user cache, measured quickly first when there is none: docs/profiles.md; the compiled
layer tried both ways unless `--set compile_layers=...` is given), then measures the `--auto-measure K` (default 3)
best predicted candidates of the host layout of the best as the trainer does (`AutoChoice.before_step` /
`after_step`, `switch_trainer`: 1 untimed + 2 timed steps each) and keeps the fastest measured; then `--warmup`
steps of it and the timed steps. The RESULT line lists every measured candidate (`auto_measured`: predicted at the
measured clip share, measured).

    PYTHONPATH=. python scripts/bench_megatrain.py --model bench-3b --batch 8 --seq 2048 --schedule overlap
    PYTHONPATH=. python scripts/bench_megatrain.py --schedule overlap-split --set retain_grads=10 --set state_buffers=3
    PYTHONPATH=. python scripts/bench_megatrain.py --schedule overlap-split --tune --profile my_profile.json
    PYTHONPATH=. python scripts/bench_megatrain.py --schedule auto --set clip=0 --gpu-budget-gib 16

`--tune` picks gpu_optimizer_fraction, retain_grads and state_buffers (2 or 3) by simulation with `--profile`, under
the same GPU budget (a GPU-share placement, or "overlap", which is tuned as "overlap-split"). The budget is
`--gpu-budget-gib` (alias `--gpu-limit-gib`), else the rule of megatrain/tune/auto.py: the GPU's free memory less
10%, half the usable host memory on the CPU backend.
"""
from __future__ import annotations

import argparse
import json
import time

import psutil
import torch

from megatrain.compile.advice import plan_memory
from megatrain.compile.knobs import DEFAULT_SCHEDULE, resolve_knobs
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.optim import AdamWConfig
from megatrain.model.presets import get_model
from megatrain.profiling.store import resolve_profile
from megatrain.sim import load_profile
from megatrain.ir.facts import StepFacts
from megatrain.train.autoswitch import (DEFAULT_BAND, DEFAULT_MEASURE, MAX_MEASURE, choose_before_run,
                                       measure_candidates, varies_compile)
from megatrain.tune.auto import auto_budget
from megatrain.tune.search import best_gpu_fraction
from megatrain.units import GiB


BENCH_LR = 1e-5  # AdamW's learning rate in every benchmark run (the peers take it: scripts/peers/peerconf.py)
BENCH_WARMUP = 2  # untimed steps before the timed ones (the peers' default too: peerconf.DEFAULT_WARMUP)


def bench_batches(vocab: int, batch: int, seq: int) -> list[torch.Tensor]:
    """The benchmark's data: 4 batches of (batch, seq + 1) random ids, generator seed 0; step i trains on batch
    i % 4 (the peers train on the same: scripts/peers/run_peer.py `batches`, tied by tests/test_peers_dryrun.py)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(4)]


def _default_timeout_s(spec, batch: int, seq: int, knobs, profile: str) -> float:
    """300 s, or three simulated steps when a step is predicted to take longer than 100 s."""
    if not profile:
        return 300.0
    from megatrain.compile.builders import build_schedule
    from megatrain.compile.lower import lower
    from megatrain.sim import load_profile, simulate

    step_s = simulate(lower(build_schedule(spec, batch, seq, knobs)), load_profile(profile)).step_s
    return max(300.0, 3 * step_s)


def predictions(program, a, timelines, tokens: int, clip_share: float = 0.0) -> dict:
    """Predicted step and tokens/s of the Program that ran: with --profile (`predicted_*`), with it calibrated to
    this run's timed steps (`calibrated_*`), and with --calibrated-profile (`transfer_*`). Each prices clipping at
    `clip_share`, the share of the timed steps that clipped (a fact of the data, as batch and sequence are, not a
    timing fitted to the run; it changes the work of speculative clipping only), recorded as
    `predicted_clip_share`; `predicted_clipping_step_s` is a step that clips."""
    from megatrain.ir.facts import StepFacts
    from megatrain.profiling.live import calibrate_run
    from megatrain.sim import load_profile, simulate

    facts = StepFacts(clip_share=clip_share)
    pred = simulate(program, load_profile(a.profile), facts)
    out = {"predicted_step_s": round(pred.step_s, 4), "predicted_tokens_per_s": round(tokens / pred.step_s, 1),
           "predicted_gpu_idle_pct": round(100 * pred.summary.gpu_idle_frac, 1),
           "predicted_clip_share": round(clip_share, 4)}
    # the physical bound of this step on the profile's machine (sim/bound.py): what binds, and the tokens/s no
    # schedule of this Program can beat there; scripts/bench.py sets the measured median against it
    bound = pred.bound
    out.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in bound.to_dict().items()},
               bound_tokens_per_s=round(tokens / bound.bound_s, 1) if bound.bound_s > 0 else None)
    if program.placement.speculative_clip:  # and a step that clips
        out["predicted_clipping_step_s"] = round(simulate(program, pred.profile, StepFacts(clip_share=1.0)).step_s, 4)
    cal = calibrate_run(program, pred.profile, timelines, warmup=0)
    out.update(calibrated_step_s=round(cal.after.step_s, 4),
               calibrated_tokens_per_s=round(tokens / cal.after.step_s, 1), calibration_reason=cal.reason())
    if a.save_calibrated:
        from pathlib import Path

        Path(a.save_calibrated).parent.mkdir(parents=True, exist_ok=True)
        cal.profile.save(a.save_calibrated)
    if a.calibrated_profile:
        t = simulate(program, load_profile(a.calibrated_profile), facts).step_s
        out.update(transfer_step_s=round(t, 4), transfer_tokens_per_s=round(tokens / t, 1),
                   transfer_profile=a.calibrated_profile)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bench-3b")
    p.add_argument("--layers", type=int, help="override the layer count (depth scaling)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--schedule", default="overlap")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--warmup", type=int, default=BENCH_WARMUP)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--profile", help="profile for the prediction ('' to skip the predictions; default: the one every "
                                     "command uses on this machine, docs/profiles.md, which --schedule auto ranks "
                                     "with too)")
    p.add_argument("--calibrated-profile", help="also predict with this profile (calibrated on another run)")
    p.add_argument("--save-calibrated", help="write this run's live-calibrated profile here")
    p.add_argument("--timeline", help="write the last measured timeline CSV here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the CPU backend (CI runs scripts/bench.py on it with the debug model)")
    p.add_argument("--auto-measure", type=int, default=DEFAULT_MEASURE, metavar="K",
                   help="--schedule auto: candidates measured before the timed steps (0: the best predicted)")
    p.add_argument("--auto-band", type=float, default=DEFAULT_BAND, metavar="FRACTION",
                   help=f"--schedule auto: also measure every candidate predicted within FRACTION of the best "
                        f"({MAX_MEASURE} at most; 0: exactly K)")
    p.add_argument("--clip-share", type=float, default=0.0, metavar="SHARE",
                   help="--schedule auto: share of clipping steps assumed before any is measured (default 0)")
    p.add_argument("--tune", action="store_true",
                   help="choose the GPU share of the optimizer (and kept gradients, state buffers) by simulation")
    p.add_argument("--gpu-budget-gib", "--gpu-limit-gib", dest="gpu_budget_gib", type=float,
                   help="planned GPU peak limit for --tune and --schedule auto (default: megatrain/tune/auto.py's "
                        "rule, the GPU's free memory less 10%%)")
    p.add_argument("--timeout-s", type=float,
                   help="the runtime's wait timeout (default: 300 s, or 3x the simulated step when that is longer: "
                        "a 524k-token step waits minutes for one task legitimately)")
    a = p.parse_args()

    spec = get_model(a.model)
    if a.layers:
        spec = spec.with_layers(a.layers)
    auto = None
    if a.schedule == "auto":  # the fastest predicted schedule within the budget, numerics of --set kept
        base = resolve_knobs(DEFAULT_SCHEDULE, a.set)[1]
        explicit = any(item.split("=", 1)[0].strip().removeprefix("schedule.") == "compile_layers" for item in a.set)
        auto, chosen_with = choose_before_run(spec, a.batch, a.seq, base, a.device, "runs",
                                              a.profile or None, a.gpu_budget_gib,
                                              log=lambda line: print(line, flush=True), measure=a.auto_measure,
                                              vary_compile=varies_compile(explicit, a.device),
                                              assumed=StepFacts(clip_share=a.clip_share), band=a.auto_band)
        a.profile = chosen_with if a.profile is None else a.profile  # '' still skips the predictions
        name, knobs = f"auto:{auto.label}", auto.knobs
    else:
        name, knobs = resolve_knobs(a.schedule, a.set)
    if a.profile is None:  # the profile every command would use here (profiling/store.py), said in one line
        choice = resolve_profile(a.device)
        print(choice.line(), flush=True)
        a.profile = choice.profile
    cuda = a.device == "cuda"
    if a.tune:
        budget = auto_budget(a.device, a.gpu_budget_gib, with_host=False)
        best = best_gpu_fraction(spec, a.batch, a.seq, knobs, a.profile or resolve_profile(a.device).profile,
                                 gpu_bytes=budget.gpu_bytes, state_buffers=(2, 3))
        print(best.table.head(8).to_string(index=False), flush=True)
        knobs = best.knobs
        name = (f"{knobs.optimizer}[gpu_optimizer_fraction={knobs.gpu_optimizer_fraction:.4f},"
                f"retain_grads={knobs.retain_grads},state_buffers={knobs.state_buffers}]")
    plan = plan_memory(spec, a.batch, a.seq, knobs)
    t0 = time.perf_counter()
    optim = AdamWConfig(lr=BENCH_LR)
    timeout_s = a.timeout_s or _default_timeout_s(spec, a.batch, a.seq, knobs, a.profile)
    trainer = StreamedTrainer(spec, knobs, optim=optim, backend=a.device, timeout_s=timeout_s)
    init_s = time.perf_counter() - t0
    data = bench_batches(spec.vocab_size, a.batch, a.seq)
    times, losses, results = [], [], []

    def step(i):
        r = trainer.step(data[i % 4][:, :-1].contiguous(), data[i % 4][:, 1:].contiguous())
        losses.append(r.loss)
        return r

    i = 0
    measured = []
    if auto is not None:  # measure the best predicted candidates, as `megatrain train --schedule auto` does
        chosen = measure_candidates(auto, trainer, lambda: step(len(losses)), lambda line: print(line, flush=True))
        i = len(losses)
        name, knobs = f"auto:{chosen.label}", chosen.knobs
        plan = plan_memory(spec, a.batch, a.seq, knobs)
        measured = [{"schedule": c.label, "predicted_step_s": round(c.step_s, 4),
                     "measured_step_s": round(auto.measured_s(c.label), 4)} for c in auto.pool if c.label in auto.times]
    for _ in range(a.warmup):
        step(i)
        i += 1
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.steps):
        r = step(i)
        i += 1
        times.append(r.time_s)
        results.append(r)
    trainer.flush()
    med_i = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    med = times[med_i]
    tokens = a.batch * a.seq
    out = {
        "mode": "megatrain", "schedule": name, "model": spec.name, "params_B": round(spec.num_params / 1e9, 3),
        "batch": a.batch, "seq": a.seq, "median_step_s": round(med, 4), "tokens_per_s": round(tokens / med, 1),
        "model_TFLOPs": round(spec.model_flops_per_token() * tokens / med / 1e12, 1),
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "peak_gpu_GiB": round(torch.cuda.max_memory_allocated() / GiB, 2) if cuda else 0.0,
        "planned_gpu_GiB": round(plan.gpu.peak_bytes / GiB, 2),
        "host_rss_GiB": round(psutil.Process().memory_info().rss / GiB, 2),
        "planned_host_GiB": round(plan.host.total_bytes / GiB, 2),
        "host_rss_over_plan": round(psutil.Process().memory_info().rss / plan.host.total_bytes, 4),
        "planned_host_B_per_param": round(plan.host.bytes_per_param, 2),
        "store_GiB": round(sum(trainer.host_bytes_by_component().values()) / GiB, 2),
        "init_s": round(init_s, 1),
    }
    if measured:
        out["auto_measured"] = measured
    norms = sorted(r.grad_norm for r in results if r.grad_norm is not None)
    if norms:  # how often exact clipping scaled the update (at the schedule's max norm)
        out["grad_norm_median"] = round(norms[len(norms) // 2], 4)
        out["clipped_steps"] = f"{sum(r.clipped for r in results)}/{len(results)}"
        # speculative clipping (arrival placements): updates undone and redone, and updates deferred to the norm
        out["redone_updates"] = sum(len(r.update.redone_units) for r in results)
        out["deferred_updates"] = sum(len(r.update.deferred_units) for r in results)
    tl = results[med_i].timeline
    try:
        from megatrain.analysis.summary import summarize

        s = summarize(tl, trainer.program(a.batch, a.seq))
        out["gpu_idle_pct"] = round(100 * s.gpu_idle_frac, 1)
        out["measured_waits_s"] = {k: round(v, 4) for k, v in s.wait_s.items()}
        out["cpu_busy_pct"] = round(100 * s.cpu_busy_frac, 1)
    except Exception as e:  # the analysis module is optional here; say why it is missing
        out["analysis_error"] = repr(e)
    if a.profile:
        try:
            share = sum(r.clipped for r in results) / len(results)  # of the timed steps
            out.update(predictions(trainer.program(a.batch, a.seq), a, [r.timeline for r in results], tokens, share))
        except Exception as e:
            out["predict_error"] = repr(e)
    if a.timeline:
        tl.to_csv(a.timeline, index=False)
    from megatrain.compile.record import ProgramRecord

    out["record"] = ProgramRecord.of(trainer.program(a.batch, a.seq)).to_dict()  # what ran: knobs, shape, hash
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
