"""The training loop users run: a RunConfig in, a trained model, checkpoints, metrics and timelines out.

    summary = run_training(load_config("run.toml", ["optimizer.lr=3e-4"]))

What a run does, in this order (nothing is allocated before the checks that can fail cheaply):

1. memory check: the planner's host and GPU bytes against this machine (`check_memory`); a run that does not fit
   stops here with the numbers and the knobs that help;
2. data: opened (memory-mapped) and every token id checked against the vocabulary;
3. run directory `run.out_dir/run.name` (a fresh run never writes into an earlier run's directory: it takes the
   next free `name-1`, `name-2`...), checkpoint directory proven writable, export target free;
4. the host store, weights written into it in place (seeded init or a Hugging Face directory, one unit at a time),
   or a checkpoint read into it (`run.resume`);
5. the simulator's prediction of the step (`run.simulate`);
6. the loop: learning-rate warmup + decay, one streamed step per optimizer step, eval every `run.eval_every`
   steps, a metrics record and a log line per step, a checkpoint every `run.checkpoint_every` steps;
7. the end: final checkpoint, Hugging Face export (`run.export_hf`), timelines, Chrome trace, Gantt chart, and
   the predicted-vs-measured table.

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

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..ir.memory import GiB
from . import safetensors_io as stio
from .checkpoint import (
    KINDS,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    check_writable,
    key_unit,
    rng_state,
    set_rng_state,
    unit_key,
)
from .config import ConfigError, RunConfig
from .data import open_data
from .evaluate import evaluate
from .export import check_export_target
from .fit import MemoryFitError, check_memory, machine_capacity
from .log import RunLog, compile_note, config_line
from .lr import lr_change_note, lr_schedule
from .metrics import (
    METRIC_KEYS,
    MetricsLogger,
    format_step_line,
    gpu_peak_bytes,
    host_rss_bytes,
    reset_gpu_peak,
)

__all__ = ["MemoryFitError", "RunSummary", "run_training", "lr_schedule", "check_memory", "machine_capacity",
           "evaluate", "add_train_arguments", "config_from_args", "run_from_args"]

KEEP_TIMELINE_STEPS = 10  # measured timelines kept for timeline_measured.csv (the last ones)



# ---- summary ---------------------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    """What `run_training` did."""

    run_dir: Path
    start_step: int  # steps done before this session (0 for a fresh run)
    steps: int  # steps done at the end of this session
    losses: list[float] = field(default_factory=list)  # training loss of each step of this session
    eval_losses: dict[int, float] = field(default_factory=dict)  # {step: held-out loss}
    tokens: int = 0  # target tokens trained on in this session
    elapsed_s: float = 0.0
    measured_step_s: float | None = None  # median step time (the first step of the session left out)
    measured_idle_pct: float | None = None  # median GPU idle %
    predicted: object | None = field(default=None, repr=False)  # megatrain.sim.SimResult (run.simulate)
    checkpoint: Path | None = None  # the newest checkpoint
    export_dir: Path | None = None
    stopped_early: bool = False  # stop_at_step ended the session before run.steps

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


# ---- the run ---------------------------------------------------------------------------------------------------
def run_training(cfg: RunConfig, *, log: Callable[[str], None] | None = None,
                 stop_at_step: int | None = None, trackers: tuple = ()) -> RunSummary:
    """Train as `cfg` says (see the module docstring); returns a RunSummary.

    log: where the log lines go (default: printed, above the progress bar on a terminal); train.log in the run
    directory gets them too. stop_at_step: end the session after this step with a checkpoint, as a preemption
    would (`run.resume` continues it). trackers: callables given each step's metrics record (a dict of
    METRIC_KEYS), e.g. to send them to an experiment tracker (docs/training.md, "Metrics").
    """
    return _Training(cfg, log, stop_at_step, trackers).run()



class _Training:
    def __init__(self, cfg: RunConfig, log: Callable[[str], None] | None, stop_at_step: int | None,
                 trackers: tuple = ()):
        self.cfg = cfg.validate()
        self.runlog = RunLog(log)  # console + train.log (megatrain/training/log.py)
        self.trackers = tuple(trackers)
        self.stop_at_step = stop_at_step
        self.metrics: MetricsLogger | None = None
        self.tokens_seen = 0  # target tokens trained on since step 0 (a resumed run continues the count)
        self.last_checkpoint: Path | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint

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
            self.runlog.close()

    def _setup(self) -> None:
        cfg = self.cfg
        run = cfg.run
        self.spec = spec = cfg.model.spec()
        knobs = cfg.schedule.knobs()
        self.accum = run.grad_accum
        # Gradient accumulation = more micro-batches in one streamed step (module docstring).
        self.knobs = replace(knobs, micro_batches=knobs.micro_batches * self.accum)
        self.batch, self.seq = cfg.data.batch_size * self.accum, cfg.data.seq_len
        self.backend_name = _backend_name(run.device)

        # Where this session writes; the config printed first is the one it runs with.
        run_dir = run.run_dir if run.resume else _fresh_run_dir(run.run_dir)
        if run_dir != run.run_dir:
            cfg = self.cfg = replace(cfg, run=replace(run, name=run_dir.name))
            run = cfg.run
        self.run_dir = run_dir
        self.log(config_line(cfg, run_dir))
        self.log(f"model {spec.name}: {spec.num_params / 1e6:,.2f} M parameters, {spec.num_layers} layers; schedule "
                 f"{cfg.schedule.name}; batch {cfg.data.batch_size} x {self.accum} accumulated x seq {self.seq}; "
                 f"{self.backend_name} backend")

        # 1. memory, before anything is allocated
        self.plan, lines = check_memory(spec, self.batch, self.seq, self.knobs, self.backend_name)
        self.log("memory: " + "; ".join(line.strip() for line in lines))
        # 2. data (memory-mapped; every token id checked against the vocabulary)
        self.data = open_data(cfg.data, spec.vocab_size, cfg.model)
        self.log(f"data: {self.data.describe()}")
        if self.seq > spec.max_position_embeddings:
            self.log(f"note: data.seq_len={self.seq} is beyond the model's max_position_embeddings="
                     f"{spec.max_position_embeddings}; RoPE extrapolates there")
        if run.eval_every and self.data.eval is None:
            self.log("note: run.eval_every is set but there is no held-out split (data.eval_fraction = 0); no eval")
        # 3. the run directory, checkpoints, export target, TensorBoard: all checked before the store exists
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=run.keep_last)
        resume_state = self._resume_state() if run.resume else None
        # An existing export of this same run (an earlier session of a resumed run) is replaced at the end.
        self.replace_export = bool(run.export_hf) and check_export_target(run.export_hf, run_dir)
        check_writable(self.manager.directory)
        cfg.save(run_dir)
        self.runlog.open(run_dir)
        # 4. the store, then its contents
        self._build_trainer()
        if resume_state is not None:
            self._restore(resume_state)
        else:
            torch.manual_seed(run.seed)
            self._fill_weights()
        # Opened only now: on resume it drops the records of steps after the checkpoint (they are run again),
        # which must not happen if the checkpoint then failed to load.
        self.metrics = MetricsLogger(run_dir / "metrics.jsonl", run_dir / "tensorboard" if run.tensorboard else None,
                                     keep_until=resume_state["step"] if resume_state else None)
        # 5. the prediction of the same Program
        self.program = self.trainer.program(self.batch, self.seq)
        self.predicted = None
        if run.simulate:
            from ..sim import simulate

            profile = run.profile or ("h200-measured" if self.backend_name == "cuda" else "cpu")
            self.predicted = simulate(self.program, profile)
            self.profile_name = Path(profile).stem
            p = self.predicted.summary
            self.log(f"predicted ({self.profile_name} profile): {p.step_s:.3f} s/step, {p.tokens_per_s:,.0f} tok/s, "
                     f"GPU idle {100 * p.gpu_idle_frac:.1f}%")

    def _build_trainer(self) -> None:
        from ..exec.optim import AdamWConfig
        from ..exec.trainer import StreamedTrainer

        o = self.cfg.optimizer
        optim = AdamWConfig(lr=lr_schedule(o, self.cfg.run.steps), betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, max_grad_norm=o.grad_clip or None)
        self.trainer = StreamedTrainer(self.spec, self.knobs, optim=optim, backend=self.backend_name,
                                       cpu_threads=o.threads or None, init=False)  # _fill_weights fills the store
        self.trainer.schedule_name = self.cfg.schedule.name
        store = sum(self.trainer.host_bytes_by_component().values())
        self.log(f"host store: {store / GiB:.3f} GiB, {store / self.spec.num_params:.1f} B/param (planned "
                 f"{self.plan.host.store_bytes / GiB:.3f} GiB); process RSS {host_rss_bytes() / GiB:.2f} GiB")

    def _fill_weights(self) -> None:
        """Seeded init or a Hugging Face directory, written unit by unit into the store's own master tiles."""
        m, store = self.cfg.model, self.trainer.store
        t0 = time.perf_counter()
        if m.pretrained:
            from .hf_checkpoint import load_hf_into

            load_hf_into(m.name, self.spec, store.master, strict=not m.num_layers)
            what = f"loaded from {m.name}"
        else:
            from ..init import init_into

            init_into(self.spec, store.master, seed=m.seed, std=m.init_std)
            what = f"random init (seed {m.seed}, std {m.init_std})"
        for u in store.units:
            store.refresh_stream(u)
        self.log(f"weights: {what} in {time.perf_counter() - t0:.2f} s")

    # -- checkpoints --
    def _resume_state(self) -> dict:
        """The checkpoint to resume from, checked against this run before anything is allocated."""
        path = self.manager.resolve(self.cfg.run.resume)
        try:
            meta = json.loads((path / STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"cannot read {path / STATE_FILE}: {e}") from None
        state, step = meta.get("state", {}), int(meta.get("step", -1))
        saved_spec = state.get("spec", {})
        mine = json.loads(json.dumps(self.spec.to_dict()))
        diff = sorted(k for k in set(saved_spec) | set(mine) if saved_spec.get(k) != mine.get(k))
        if diff:
            raise CheckpointError(f"checkpoint {path} was written for another model ({', '.join(diff)} differ: "
                                  f"{ {k: saved_spec.get(k) for k in diff} } vs { {k: mine.get(k) for k in diff} }); "
                                  "resume with the model config it was written with")
        if step >= self.cfg.run.steps:
            raise ConfigError(f"checkpoint {path} is at step {step} and run.steps={self.cfg.run.steps}: nothing left "
                              "to train; raise run.steps to continue")
        if "data" not in state or "optimizer_steps" not in state:
            raise CheckpointError(f"{path / STATE_FILE} has no data cursor or optimizer step counts; it was not "
                                  "written by `megatrain train`")
        for kind in KINDS:  # every file present and complete (headers against file sizes), before allocating
            try:
                stio.read_header(path / f"{kind}.safetensors")
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {path} has no {kind}.safetensors") from None
            except stio.SafetensorsFormatError as e:
                raise CheckpointError(f"checkpoint {path} is damaged: {e}") from None
        self.data.train.load_state_dict(state["data"])  # same data and packing? (DataError if not)
        return {"path": path, "step": step, "state": state}

    def _save(self, step: int) -> Path:
        store, t0 = self.trainer.store, time.perf_counter()
        self.trainer.flush()  # the pending "overlap" update belongs to this step
        state = {
            "rng": rng_state(),
            "data": self.data.train.state_dict(),
            "optimizer_steps": {unit_key(u): n for u, n in store.steps.items()},
            "tokens_seen": self.tokens_seen,
            "spec": self.spec.to_dict(),
            "schedule": self.cfg.schedule.name,
            "config": self.cfg.to_dict(),
        }
        path = self.manager.save(step, {"master": store.master, "adam_m": store.exp_avg, "adam_v": store.exp_avg_sq},
                                 state, units=store.units)
        self.last_checkpoint, self.saved_step = path, step
        self.log(f"checkpoint {path} ({time.perf_counter() - t0:.2f} s)")
        return path

    def _restore(self, resume: dict) -> None:
        store, t0 = self.trainer.store, time.perf_counter()
        kinds = {"master": store.master, "adam_m": store.exp_avg, "adam_v": store.exp_avg_sq}
        loaded = self.manager.load(resume["path"], dest=lambda kind, u: kinds[kind](u))
        for u in store.units:
            store.refresh_stream(u)
        state = loaded.state
        store.steps = {key_unit(k): int(n) for k, n in state["optimizer_steps"].items()}
        self.trainer.step_count = loaded.step
        set_rng_state(state["rng"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.last_checkpoint, self.saved_step = loaded.path, loaded.step
        if state.get("schedule") != self.cfg.schedule.name:
            self.log(f"note: resuming a run of schedule {state.get('schedule')!r} with {self.cfg.schedule.name!r} "
                     "(the schedule changes speed, not results)")
        self.log(f"resumed from {loaded.path} at step {loaded.step} ({time.perf_counter() - t0:.2f} s)")
        note = lr_change_note(state.get("config"), self.cfg, loaded.step)
        if note:
            self.log(note)

    # -- the loop --
    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.data.train.next_batch() for _ in range(self.accum)]
        if len(parts) == 1:
            return parts[0].inputs, parts[0].targets
        return torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts])  # (accum*B, T)

    def _loop(self) -> RunSummary:
        from ..analysis.summary import summarize

        cfg, run, trainer = self.cfg, self.cfg.run, self.trainer
        start = trainer.step_count
        summary = RunSummary(self.run_dir, start, start, predicted=self.predicted)
        timelines, step_times, idles = [], [], []
        flops_per_token = self.spec.model_flops_per_token()
        device = trainer.backend.device
        bar = self.runlog.progress_bar(total=run.steps, initial=start, enabled=run.progress, desc=run.name)
        if start < run.steps and compile_note(self.knobs, self.backend_name):
            self.log(compile_note(self.knobs, self.backend_name))
        t_start = time.perf_counter()
        try:
            for index in range(start, run.steps):
                ids, targets = self._next_batch()
                reset_gpu_peak(device)
                r = trainer.step(ids, targets)
                step = index + 1
                measured = summarize(r.timeline, self.program)
                eval_loss = None
                if run.eval_every and (step % run.eval_every == 0 or step == run.steps):
                    eval_loss = evaluate(trainer, self.data, run.eval_batches, cfg.data.batch_size)
                    if eval_loss is not None:
                        summary.eval_losses[step] = eval_loss
                gpu = gpu_peak_bytes(device)
                tps = r.tokens / r.time_s
                record = dict(zip(METRIC_KEYS, (
                    step, r.loss, eval_loss, r.update.lr, r.grad_norm, r.skipped, r.tokens, r.time_s, tps,
                    flops_per_token * tps / 1e12, 100 * measured.gpu_idle_frac, host_rss_bytes() / GiB,
                    None if gpu is None else gpu / GiB, time.perf_counter() - t_start)))
                self.metrics.write(record)
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
                summary.losses.append(r.loss)
                summary.tokens += r.tokens
                self.tokens_seen += r.tokens
                summary.steps = step
                if run.checkpoint_every and step % run.checkpoint_every == 0:
                    self._save(step)
                if self.stop_at_step is not None and step >= self.stop_at_step and step < run.steps:
                    if self.saved_step != step:
                        self._save(step)
                    summary.stopped_early = True
                    self.log(f"stopped after step {step} (stop_at_step); continue with --resume")
                    break
        except KeyboardInterrupt:
            self.runlog.close_bar()
            where = f"the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint yet"
            self.log(f"interrupted after step {trainer.step_count}; {where} (continue with --resume)")
            raise
        self.runlog.close_bar()
        summary.elapsed_s = time.perf_counter() - t_start
        if not summary.stopped_early:
            trainer.flush()
            if run.checkpoint_at_end and self.saved_step != summary.steps and summary.steps > start:
                self._save(summary.steps)
            if run.export_hf:
                summary.export_dir = self._export()
        summary.checkpoint = self.last_checkpoint
        warm = step_times[1:] or step_times
        if warm:
            summary.measured_step_s = statistics.median(warm)
            summary.measured_idle_pct = statistics.median(idles[1:] or idles)
        if timelines:
            self._write_timelines(timelines)
        self._report(summary)
        return summary

    # -- the end --
    def _export(self) -> Path:
        from .export import export_weights

        t0 = time.perf_counter()
        path = export_weights(self.cfg.run.export_hf, self.spec, self.trainer.store.master, self.cfg.to_dict(),
                              tokenizer=self.data.tokenizer, overwrite=self.replace_export,
                              provenance={"run_dir": str(self.run_dir), "checkpoint": str(self.last_checkpoint),
                                          "step": self.trainer.step_count})
        self.log(f"exported to {path} (Hugging Face, bf16; tokenizer {self.data.tokenizer.describe()}) in "
                 f"{time.perf_counter() - t0:.2f} s")
        return path

    def _write_timelines(self, timelines: list) -> None:
        import pandas as pd

        from ..analysis.summary import one_step
        from ..analysis.viz import gantt, write_chrome_trace

        measured = pd.concat(timelines, ignore_index=True)
        measured.to_csv(self.run_dir / "timeline_measured.csv", index=False)
        last = int(measured["step"].max())
        pair = {f"measured (step {last})": one_step(measured, last)}
        if self.predicted is not None:
            self.predicted.timeline.to_csv(self.run_dir / "timeline_sim.csv", index=False)
            pair = {f"predicted ({self.profile_name})": self.predicted.timeline, **pair}
        write_chrome_trace(self.run_dir / "trace.json", pair, self.program)
        gantt(pair, self.run_dir / "gantt.png", title=f"{self.spec.name}, schedule {self.cfg.schedule.name}, "
                                                      f"batch {self.batch} x seq {self.seq}")

    def _report(self, s: RunSummary) -> None:
        done = s.steps - s.start_step
        if not done:
            return
        self.log(f"done: {done} steps ({s.start_step + 1}-{s.steps}) in {s.elapsed_s:.1f} s; loss {s.losses[0]:.4f} -> "
                 f"{s.losses[-1]:.4f}" + (f"; eval loss {list(s.eval_losses.values())[-1]:.4f}"
                                          if s.eval_losses else ""))
        tokens = s.tokens / done
        rows = [("time/step", "s", s.measured_step_s), ("tokens/s", "", tokens / s.measured_step_s),
                ("GPU idle", "%", s.measured_idle_pct)]
        pred = None
        if s.predicted is not None:
            p = s.predicted.summary
            pred = [p.step_s, p.tokens_per_s, 100 * p.gpu_idle_frac]
        head = f"{'':<12}{'predicted (' + self.profile_name + ')' if pred else '':>22}{'measured (median)':>22}"
        lines = [head]
        for i, (name, unit, value) in enumerate(rows):
            fmt = ",.0f" if name == "tokens/s" else ".3f" if unit == "s" else ".1f"
            left = f"{format(pred[i], fmt)} {unit}" if pred else ""
            lines.append(f"{name:<12}{left:>22}{format(value, fmt) + ' ' + unit:>22}")
        for line in lines:
            self.log(line)
        self.log(f"run directory: {self.run_dir}")


def _backend_name(device: str) -> str:
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ConfigError("run.device='cuda' but torch sees no CUDA device here; use run.device='cpu' or 'auto'")
    return "cuda" if device == "cuda" or (device == "auto" and cuda) else "cpu"


def _fresh_run_dir(path: Path) -> Path:
    """`path`, or `path-1`, `path-2`... when it already holds a run (metrics or checkpoints): a fresh run never
    writes into, or prunes the checkpoints of, an earlier one."""
    def used(p: Path) -> bool:
        return (p / "metrics.jsonl").is_file() and (p / "metrics.jsonl").stat().st_size > 0 or \
            any((p / "checkpoints").glob("step_*"))

    candidate, n = path, 0
    while used(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


# ---- command line (megatrain/training/command.py; re-exported so `megatrain.training.loop` is the one entry point) -------
from .command import add_train_arguments, config_from_args, run_from_args  # noqa: E402
