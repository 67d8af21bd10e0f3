"""The training loop users run: a RunConfig in, a trained model, checkpoints, metrics and timelines out.

    summary = run_training(load_config("run.toml", ["optimizer.lr=3e-4"]))

What a run does, in this order (nothing is allocated before the checks that can fail cheaply; the run directory is
claimed, locked, first, and written only after step 4, so a refusal up to there leaves nothing: `rundir.py`):

1. schedule rules (the same `build_schedule` as `megatrain plan`) and the memory check: the planner's host and GPU
   bytes against this machine (`check_memory`); a run that does not fit stops here with the numbers and the knobs
   that help;
2. data: opened (memory-mapped) and every token id checked against the vocabulary; the hardware profile read;
   a Hugging Face directory's every tensor checked present with its shape (headers only);
3. the checkpoint to resume verified (checksums, units, model, the moments' dtype) in the run directory
   `run.out_dir/run.name` (`rundir.py`: a fresh run takes the next free `name-1`...; a resume from an older
   checkpoint moves the newer ones aside after step 4), checkpoint directory proven writable, export target free;
4. the host store, weights written into it in place (seeded init or a Hugging Face directory, one unit at a time),
   or a checkpoint read into it (`run.resume`);
5. the simulator's prediction of the step (`run.simulate`);
6. the loop: learning-rate warmup + decay, one streamed step per optimizer step, eval every `run.eval_every`
   steps, a metrics record and a log line per step, a checkpoint every `run.checkpoint_every` steps; every skipped
   update counted and logged (`skips.py`), the run stopped after `run.max_skipped_steps` skipped steps in a row;
   SIGTERM / SIGINT end the run at the next step boundary with a checkpoint (`signals.py`); a failed write of
   metrics or a checkpoint stops the run with one message after a last attempt to checkpoint;
7. the end: final checkpoint, Hugging Face export (`run.export_hf`), timelines, Chrome trace, Gantt chart,
   the predicted-vs-measured table, and the profile fitted to the run (`profile_calibrated.json`, profiling/live.py).

Gradient accumulation (`run.grad_accum = k`) is the schedule's micro-batching: the k batches of an optimizer step
run as one streamed step of k x batch_size sequences with k times the schedule's micro-batches, so each layer's
weights cross PCIe once per optimizer step, not k times, and the gradients accumulate in the GPU slot. The cost is
the activation checkpoints of k batches (the memory check counts them; `offload_checkpoints` moves them to host).

Resume is bit-exact: a checkpoint holds the fp32 master, both AdamW moments, each unit's AdamW step count, the
trainer's step, the RNG states and the data cursor, and the losses after a resume equal those of an uninterrupted
run. A checkpoint first applies a pending "overlap" update (`StreamedTrainer.flush`), so it holds the weights
after its step; applying that update then or at the start of the next step gives the same numbers.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from megatrain.data.filetokens import DataChangedError
from megatrain.parallel.world import World
from megatrain.units import GiB
from megatrain.train.autoswitch import auto_before_step, schedule_overrides
from megatrain.io.checkpoint import CheckpointManager, check_writable
from megatrain.io.errors import CheckpointError
from megatrain.train.checkpointing import SessionCheckpoints, trainer_state
from megatrain.train.config import ConfigError, RunConfig
from megatrain.train.errors import TrainingError
from megatrain.train.evaluate import evaluate
from megatrain.train.export import check_run_export_target, export_run
from megatrain.train.fit import MemoryFitError, check_memory, machine_capacity
from megatrain.train.log import RunLog, compile_note, config_line
from megatrain.train.lr import lr_schedule
from megatrain.train.metrics import (
    METRIC_KEYS,
    MetricsLogger,
    MetricsWriteError,
    format_step_line,
    gpu_peak_bytes,
    reset_gpu_peak,
)
from megatrain.compile.record import ProgramRecord
from megatrain.train.outputs import report_after_run
from megatrain.train.preflight import preflight
from megatrain.train.result import RunSummary
from megatrain.train.resume import branch_off, restore, resume_state
from megatrain.train.rundir import RunLock, claim_run_dir
from megatrain.train.signals import StopRequest
from megatrain.train.skips import Skip, SkipTracker
from megatrain.train.weights import fill_weights
from megatrain.analysis.summary import summarize
from megatrain.engine.trainer import StreamedTrainer
from megatrain.exec.backend import ExecError
from megatrain.exec.optim import AdamWConfig
from megatrain.sim import simulate
from megatrain.parallel.liveness import PeerLost
from megatrain.train.distributed import join, node_store_line
from megatrain.plan.machine import process_rss_bytes

__all__ = ["MemoryFitError", "RunSummary", "run_training", "lr_schedule", "check_memory", "machine_capacity",
           "evaluate"]

KEEP_TIMELINE_STEPS = 10  # measured timelines kept for timeline_measured.csv (the last ones)


# ---- the run ---------------------------------------------------------------------------------------------------
def run_training(cfg: RunConfig, *, log: Callable[[str], None] | None = None,
                 stop_at_step: int | None = None, trackers: tuple = (), auto=None) -> RunSummary:
    """Train as `cfg` says (see the module docstring); returns a RunSummary.

    log: where the log lines go (default: printed, above the progress bar on a terminal); train.log in the run
    directory gets them too. stop_at_step: end the session after this step with a checkpoint, as a preemption
    would (`run.resume` continues it). trackers: callables given each step's metrics record (a dict of
    METRIC_KEYS), e.g. to send them to an experiment tracker (docs/training.md, "Metrics"). auto: the
    `--schedule auto` choice (train/autoswitch.AutoChoice), whose best predicted candidates are measured on the
    run's first steps (each a training step of the run), then the fastest measured trains on. Raises TrainingError
    when the run stops on its own (divergence, a failed write, a hung step); the message says how to continue.
    """

    world, cfg, log, trackers = join(cfg.validate(), _backend_name(cfg.run.device), log, trackers)  # torchrun
    try:
        summary = _Training(cfg, log, stop_at_step, trackers, auto, world).run()
        world.close()  # after a run that failed, the process exits with the error instead
    except PeerLost as e:  # a rank or node died between steps: one line naming it (parallel/liveness.py)
        raise TrainingError(f"the run stopped: {e}") from None
    return summary


class _Training:
    def __init__(self, cfg: RunConfig, log: Callable[[str], None] | None, stop_at_step: int | None,
                 trackers: tuple = (), auto=None, world=None):
        self.cfg = cfg.validate()
        self.auto = auto
        self.world = world if world is not None else World()  # one process, or this rank of a data-parallel run
        self.runlog = RunLog(log)  # console + train.log (megatrain/train/log.py)
        self.trackers = tuple(trackers)
        self.stop_at_step = stop_at_step
        self.metrics: MetricsLogger | None = None
        self.lock: RunLock | None = None
        self.tokens_seen = 0  # target tokens trained on since step 0 (a resumed run continues the count)

    def log(self, line: str) -> None:
        self.runlog(line)

    # -- setup --
    def run(self) -> RunSummary:
        threads = torch.get_num_threads()  # the trainer sets the update threads; restored for the caller
        try:
            self._setup()
            return self._loop()
        finally:
            torch.set_num_threads(threads)
            if self.metrics is not None:
                self.metrics.close()
            if self.lock is not None:
                self.lock.release()
            self.runlog.close()

    def _setup(self) -> None:
        cfg = self.cfg
        run = cfg.run
        self.spec = spec = cfg.model.spec()
        self.accum = run.grad_accum
        # Gradient accumulation = more micro-batches in one streamed step (module docstring).
        self.knobs = cfg.step_knobs()
        self.batch, self.seq = cfg.step_shape()
        self.backend_name = _backend_name(run.device)

        # Where this session writes: claimed (locked, created if needed) before any check or write (rundir.py), so
        # two runs never share a directory; the config printed first is the one it runs with.
        self.lock = claim_run_dir(run.run_dir, fresh=not run.resume)
        run_dir = self.lock.run_dir
        if run_dir != run.run_dir:
            cfg = self.cfg = replace(cfg, run=replace(run, name=run_dir.name))
            run = cfg.run
        self.run_dir = run_dir
        self.log(config_line(cfg, run_dir))
        self.log(f"model {spec.name}: {spec.num_params / 1e6:,.2f} M parameters, {spec.num_layers} layers; schedule "
                 f"{cfg.schedule.name}; batch {cfg.data.batch_size} x {self.accum} accumulated x seq {self.seq}; "
                 f"{self.backend_name} backend")
        if self.world is not None and self.world.distributed:
            self.log(f"data parallel: {self.world.size} ranks, batch {cfg.data.batch_size} x {self.accum} per rank "
                     f"({self.world.size * self.batch} sequences a step); rank 0 logs and writes the outputs")
        try:  # until the store is filled nothing is written: a failure gives the claim back (_nothing_written)
            resume = self._checks_and_store()
        except BaseException:
            self._nothing_written()
            raise
        cfg.save(run_dir)  # only now: a refused resume never overwrites the run's config
        self.runlog.open(run_dir)
        if resume is not None and self.world.rank == 0:  # rank 0 owns the run directory
            branch_off(self.manager, resume, cfg, run_dir, self.log)
        # Opened only now: on resume it drops the records of steps after the checkpoint (they are run again),
        # which must not happen if the checkpoint then failed to load.
        try:
            self.metrics = MetricsLogger(run_dir / "metrics.jsonl", run_dir / "tensorboard" if run.tensorboard
                                         else None, keep_until=resume["step"] if resume else None)
        except MetricsWriteError as e:
            raise self.ckpt.stopped(self.trainer.step_count, str(e)) from e
        # 5. the prediction of the same Program
        self.program = self.trainer.program(self.batch, self.seq)
        ProgramRecord.of(self.program).save(run_dir)  # what ran, rebuildable (compile/record.py)
        for note in self.program.placement.notes:
            self.log(f"note: {note}")
        self.predicted = None
        if self.profile is not None:

            self.predicted = simulate(self.program, self.profile)
            p = self.predicted.summary
            self.log(f"predicted ({self.profile_name} profile): {p.step_s:.3f} s/step, {p.tokens_per_s:,.0f} tok/s, "
                     f"GPU idle {100 * p.gpu_idle_frac:.1f}%")

    def _checks_and_store(self) -> dict | None:
        """Steps 1-4: every check (nothing allocated, nothing written), then the store and its contents; returns the
        checkpoint resumed from (resume.resume_state) or None."""
        cfg, run, spec, run_dir = self.cfg, self.cfg.run, self.spec, self.run_dir
        # 1-2. every check that needs no allocation: schedule rules, memory, data, profile, HF tensors (preflight.py)
        checked = preflight(cfg, spec, self.batch, self.seq, self.knobs, self.backend_name, self.log)
        self.plan, self.data, self.profile, self.profile_name = (checked.plan, checked.data, checked.profile,
                                                                 checked.profile_name)
        # 3. the checkpoint to resume, checked against this run (model, units, moments' dtype): before the store
        # Every rank writes its slices into rank 0's checkpoint directory (the others' run directories are scratch).
        self.manager = CheckpointManager(self.world.share(run_dir / "checkpoints"), keep_last=run.keep_last)
        self.ckpt = SessionCheckpoints(self.manager, self.log, self.world)
        resume = resume_state(cfg, spec, self.manager, self.data, self.knobs) if run.resume else None
        # An existing export of this same run (an earlier session of a resumed run) is replaced at the end.
        self.replace_export = bool(run.export_hf) and self.world.rank == 0 and check_run_export_target(
            run.export_hf, run_dir)
        check_writable(self.manager.directory)
        # 4. the store, then its contents
        self._build_trainer()
        self.skips = SkipTracker(len(self.trainer.store.units), run.max_skipped_steps)
        if resume is not None:
            self.ckpt.last, self.ckpt.step, self.tokens_seen = restore(self.trainer, resume, cfg, self.log)
        else:
            torch.manual_seed(run.seed)
            self.log(fill_weights(cfg.model, spec, self.trainer.store, self.world))
        return resume

    def _nothing_written(self) -> None:
        """A run that stopped before writing anything gives its claim back and says what is left (nothing)."""
        left = self.lock.forget()
        self.lock = None
        if left:
            self.log(f"the run stopped before it started; left behind: {', '.join(map(str, left))} (not empty)")
        else:
            self.log(f"the run stopped before it started: nothing was written (no config, log or checkpoint in "
                     f"{self.run_dir})")

    def _build_trainer(self) -> None:
        o = self.cfg.optimizer
        optim = AdamWConfig(lr=lr_schedule(o, self.cfg.run.steps), betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)
        self.trainer = StreamedTrainer(self.spec, self.knobs, optim=optim, backend=self.backend_name,
                                       cpu_threads=o.threads or None, init=False,
                                       timeout_s=self.cfg.run.wait_timeout_s, world=self.world)
        self.trainer.schedule_name = self.cfg.schedule.name
        store = sum(self.trainer.host_bytes_by_component().values())
        self.log(f"host store: {store / GiB:.3f} GiB, {store / self.spec.num_params:.1f} B/param (planned "
                 f"{self.plan.host.store_bytes / GiB:.3f} GiB); process RSS {process_rss_bytes() / GiB:.2f} GiB")
        if self.world.distributed:  # every rank reports its slices: the node's share (train/distributed.py)
            self.log(node_store_line(self.world, store, self.plan.host.store_bytes))

    # -- checkpoints --
    def _save(self, step: int) -> Path:
        """Checkpoint `step` (SessionCheckpoints: one retry, then a TrainingError saying how to resume)."""
        store, t0 = self.trainer.store, time.perf_counter()
        self._log_skips(self.skips.settle(self.trainer.flush()))  # the pending "overlap" update belongs to this step
        state = trainer_state(store, self.data, self.spec, self.cfg, self.tokens_seen)
        path = self.ckpt.save_store(step, store, state, self.trainer.step_count)
        self.log(f"checkpoint {path} ({time.perf_counter() - t0:.2f} s)")
        return path

    # -- the loop --
    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        ranks = self.world.size if self.world is not None else 1  # every rank reads the global batch, keeps its rows
        parts = [self.data.train.next_batch() for _ in range(self.accum * ranks)]
        if len(parts) == 1:
            return parts[0].inputs, parts[0].targets
        return torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts])  # (accum*B, T)

    def _log_skips(self, skips: list[Skip]) -> list[Skip]:
        for s in skips:
            self.log(f"WARNING: {s.describe(self.skips.n_units)}")
        return skips

    def switch_schedule(self, knobs, program, predicted, applied) -> None:
        """Run `knobs` from the next step: the public way to change a running session's schedule (what
        `--schedule auto` does while it measures its candidates, train/autoswitch.py). `program`: the Program the
        trainer now runs (after `switch_trainer`); `predicted`: its simulation; `applied`: the update plan the
        switch's flush applied (its skipped units are counted and logged). The saved config records the schedule
        that runs from here on."""
        self._log_skips(self.skips.settle(applied))
        self.knobs, self.program, self.predicted = knobs, program, predicted
        self.cfg = self.cfg.with_overrides(schedule_overrides(knobs, self.cfg.schedule.micro_batches))
        self.cfg.save(self.run_dir)

    def _step(self, step: int):
        """One optimizer step; an executor failure (a hung or failing task) ends the run with a TrainingError."""

        ids, targets = self._next_batch()
        try:
            return self.trainer.step(ids, targets)
        except ExecError as e:
            raise self.ckpt.stopped(self.trainer.step_count, f"step {step} failed: {e}") from e

    def _loop(self) -> RunSummary:
        cfg, run, trainer = self.cfg, self.cfg.run, self.trainer
        start = since = trainer.step_count  # since: the first step of the Program that runs (auto may switch)
        summary = RunSummary(self.run_dir, start, start, predicted=self.predicted,
                             skipped_steps=self.skips.skipped_steps)
        timelines, step_times, idles = [], [], []
        flops_per_token = self.spec.model_flops_per_token()
        device = trainer.backend.device
        bar = self.runlog.progress_bar(total=run.steps, initial=start, enabled=run.progress, desc=run.name)
        if start < run.steps and compile_note(self.knobs, self.backend_name):
            self.log(compile_note(self.knobs, self.backend_name))
        if self.auto is not None:  # --schedule auto: its candidates are measured on the first steps (autoswitch.py)
            trainer.schedule_name = self.auto.label
            self.auto.start(run.steps - start, self.log)
        t_start = time.perf_counter()
        try:
            with StopRequest(self.log) as stop:
                # a closed stdout (`| head`) stops the run as SIGTERM does (train/log.py)
                self.runlog.when_console_lost(lambda: stop.request("SIGPIPE", "stdout was closed"))
                for index in range(start, run.steps):
                    step = index + 1
                    changed = auto_before_step(self) if self.auto is not None else None
                    if changed is not None:  # --schedule auto: the next candidate to measure, or the fastest
                        summary.predicted = self.predicted
                    if changed:  # a new Program from this step: its steps are measured from here
                        since = index
                        for kept in (timelines, step_times, idles):
                            kept.clear()
                    reset_gpu_peak(device)
                    r = self._step(step)
                    if self.auto is not None:
                        self.auto.after_step(r)
                    skips = self._log_skips(self.skips.settle(r.update))
                    measured = summarize(r.timeline, self.program)
                    eval_loss = None
                    if run.eval_every and (step % run.eval_every == 0 or step == run.steps):
                        eval_loss = evaluate(trainer, self.data, run.eval_batches, cfg.data.batch_size)
                        if eval_loss is not None:
                            summary.eval_losses[step] = eval_loss
                    gpu = gpu_peak_bytes(device)
                    tps = r.tokens / r.time_s
                    record = dict(zip(METRIC_KEYS, (
                        step, r.loss, eval_loss, r.update.lr, r.grad_norm, bool(skips), self.skips.unit_count(skips),
                        r.tokens, r.time_s, tps, flops_per_token * tps / 1e12, 100 * measured.gpu_idle_frac,
                        process_rss_bytes() / GiB, None if gpu is None else gpu / GiB, time.perf_counter() - t_start)))
                    summary.losses.append(r.loss)
                    summary.tokens += r.tokens
                    self.tokens_seen += r.tokens
                    summary.steps = step
                    metrics_error = self._write_metrics(record)
                    for track in self.trackers:
                        track(dict(record))
                    if step % run.log_every == 0 or step == run.steps or eval_loss is not None:
                        self.log(format_step_line(record, run.steps))
                    bar.update(1)
                    bar.set_postfix(loss=f"{r.loss:.4f}", refresh=False)
                    timelines.append(r.timeline.assign(step=step))
                    del timelines[:-KEEP_TIMELINE_STEPS]
                    step_times.append(r.time_s)
                    idles.append(100 * measured.gpu_idle_frac)
                    if self.skips.diverged:
                        raise self.ckpt.diverged(step, self.skips.consecutive, run.max_skipped_steps)
                    if run.checkpoint_every and step % run.checkpoint_every == 0:
                        if self.skips.consecutive:  # keep the last good checkpoint: do not prune it for this one
                            self.log(f"checkpoint of step {step} not written: its update was skipped (the last good "
                                     f"checkpoint, {self.ckpt.last}, is kept)")
                        else:
                            self._save(step)
                    # Every rank stops at the same step, whichever saw the reason (a signal, a full disk on rank 0):
                    # the checkpoint of a data-parallel run is written by all ranks together.
                    failed, stopping = self.world.any_each(metrics_error is not None, self._stop_wanted(step, stop))
                    if failed:
                        raise self._metrics_failed(step, metrics_error)
                    if stopping and self._stop_here(step, stop, summary):
                        break
        except DataChangedError as e:  # a data file changed under the run (data/filetokens.py): say where to resume
            self.runlog.close_bar()
            raise self.ckpt.stopped(trainer.step_count, str(e)) from e
        except KeyboardInterrupt:
            self.runlog.close_bar()
            where = (f"the last checkpoint is {self.ckpt.last} (continue with --resume)" if self.ckpt.last
                     else "no checkpoint was written, so there is nothing to resume: start the run again")
            self.log(f"interrupted after step {trainer.step_count}; {where}")
            raise
        self.runlog.close_bar()
        summary.elapsed_s = time.perf_counter() - t_start
        if not summary.stopped_early:  # the end: final checkpoint and export, then the outputs (outputs.py)
            self._finish(summary, start)
        summary.checkpoint = self.ckpt.last
        title = f"{self.spec.name}, schedule {self.cfg.schedule.name}, batch {self.batch} x seq {self.seq}"
        return report_after_run(summary, self.run_dir, since, timelines, step_times, idles, self.predicted,
                                self.profile_name, self.program, title, self.skips.skipped_unit_updates, self.log)

    def _write_metrics(self, record: dict) -> MetricsWriteError | None:
        """Append the step's record; the error of a failed write (disk full), which stops the run after a checkpoint
        (`_metrics_failed`, on every rank)."""
        try:
            self.metrics.write(record)
        except MetricsWriteError as e:
            return e
        return None

    def _metrics_failed(self, step: int, error: MetricsWriteError | None) -> TrainingError:
        """Checkpoint the state in memory and say how to continue: the metrics could not be written (here, or on
        rank 0 when `error` is None)."""
        if self.ckpt.step != step:
            self._save(step)  # raises its own TrainingError if this fails too
        what = error if error is not None else "rank 0 could not write its metrics"
        return TrainingError(f"the run stopped after step {step}: {what}. The state after step {step} was saved to "
                             f"{self.ckpt.last} (metrics.jsonl lacks that step's record); free space and continue "
                             "with --resume")

    def _stop_wanted(self, step: int, stop: StopRequest) -> bool:
        """Whether this process would stop after `step` before the last one: a signal, or `stop_at_step`."""
        if step >= self.cfg.run.steps:
            return False  # the normal end checkpoints anyway
        return stop.requested or (self.stop_at_step is not None and step >= self.stop_at_step)

    def _stop_here(self, step: int, stop: StopRequest, summary: RunSummary) -> bool:
        """Stop after `step` (some rank wanted to, `_stop_wanted`): checkpoint (unless done) and end the session with
        how to continue."""
        if step >= self.cfg.run.steps:
            return False
        if self.ckpt.step != step:
            self._save(step)
        summary.stopped_early, summary.stop_signal = True, stop.signal_name
        why = stop.signal_name or ("stop_at_step" if self.stop_at_step is not None and step >= self.stop_at_step
                                   else "another rank was asked to stop")
        self.log(f"stopped after step {step} ({why}); checkpoint {self.ckpt.last}; continue with "
                 f"`megatrain train --resume --name {self.run_dir.name} --out-dir {self.run_dir.parent}` and the "
                 "same other options")
        return True

    # -- the end --
    def _finish(self, summary: RunSummary, start: int) -> None:
        """Final checkpoint and export; the skips the last flush settles are counted too."""
        run = self.cfg.run
        self._log_skips(self.skips.settle(self.trainer.flush()))
        if run.checkpoint_at_end and self.ckpt.step != summary.steps and summary.steps > start:
            self._save(summary.steps)
        if run.export_hf and self.world.rank == 0:
            try:
                summary.export_dir = export_run(self.cfg, self.spec, self.trainer, self.world, self.data.tokenizer,
                                                self.run_dir, self.ckpt.last, self.replace_export, self.log)
            except (CheckpointError, OSError) as e:
                where = (f"the trained weights are in checkpoint {self.ckpt.last}" if self.ckpt.last
                         else "no checkpoint holds the trained weights (run.checkpoint_at_end=false)")
                raise TrainingError(f"{e}; {where}: fix the cause and export again") from e


def _backend_name(device: str) -> str:
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ConfigError("run.device='cuda' but torch sees no CUDA device here; use run.device='cpu' or 'auto'")
    return "cuda" if device == "cuda" or (device == "auto" and cuda) else "cpu"

