"""`megatrain train` arguments -> RunConfig -> `run_training`.

    parser = argparse.ArgumentParser(); add_train_arguments(parser)
    sys.exit(run_from_args(parser.parse_args()))

A TOML config (`--config`), then shortcuts for the common keys (`--model`, `--steps`, `--schedule`, ...), then
`--set section.key=value` overrides (an explicit --set wins), and `--resume [CHECKPOINT]`. Every mistake is a
ConfigError naming the key (megatrain.cli prints it as one line).
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

from megatrain.compile.knobs import DEFAULT_SCHEDULE, NAMED_SCHEDULES, resolve_knobs
from megatrain.compile.resolve import check_run_for_ranks
from megatrain.ir.dag import ScheduleError
from megatrain.plan.machine import gpu_memory
from megatrain.tomlfile import read_toml
from megatrain.train.config import ConfigError, RunConfig, load_config

_SHORTCUTS = {"model": "model.name", "steps": "run.steps", "schedule": "schedule.name", "batch": "data.batch_size",
              "seq": "data.seq_len", "lr": "optimizer.lr", "device": "run.device", "name": "run.name",
              "out_dir": "run.out_dir", "data": "data.path", "wait_timeout": "run.wait_timeout_s"}


def add_train_arguments(parser) -> None:
    """The `megatrain train` options: a TOML config, `--set` overrides, `--resume`, and shortcuts for the
    common keys (each shortcut is a `--set` of the key in brackets; an explicit --set wins)."""
    parser.add_argument("--config", metavar="TOML", help="run config file (defaults: debug model, bundled corpus)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                        help="override a config key, e.g. --set optimizer.lr=3e-4 (a bare schedule knob such as "
                             "buffers=2 means schedule.buffers=2); repeatable")
    parser.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                        help="continue the run from its latest checkpoint, or from the checkpoint directory given")
    parser.add_argument("--model", help="[model.name] preset or Hugging Face model directory")
    parser.add_argument("--data", help="[data.path] token file (.bin), nanoGPT dir, .jsonl or .txt")
    parser.add_argument("--steps", type=int, help="[run.steps]")
    parser.add_argument("--schedule", help="[schedule.name] a named schedule, a TOML file of schedule knobs, or "
                                           "'auto': the fastest predicted one that fits --gpu-budget-gib and keeps "
                                           "the numerics of the config (clipping, dtypes, kernel)")
    parser.add_argument("--gpu-budget-gib", dest="gpu_budget_gib", type=float,
                        help="--schedule auto: GPU memory the schedule may plan for (default: the GPU's free memory "
                             "less 10%%; on the CPU backend half the usable host memory: megatrain/tune/auto.py)")
    parser.add_argument("--batch", type=int, help="[data.batch_size]")
    parser.add_argument("--seq", type=int, help="[data.seq_len]")
    parser.add_argument("--lr", type=float, help="[optimizer.lr]")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="[run.device]")
    parser.add_argument("--name", help="[run.name] run directory name under run.out_dir")
    parser.add_argument("--out-dir", dest="out_dir", help="[run.out_dir]")
    parser.add_argument("--wait-timeout", dest="wait_timeout", type=float, metavar="SECONDS",
                        help="[run.wait_timeout_s] bound of every executor wait; a hung task stops the step with an "
                             "error naming it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    parser.add_argument("--timeline", metavar="CSV", help="also write the last step's measured timeline here "
                                                          "(the run directory has the last steps' anyway)")


def config_from_args(args) -> RunConfig:
    """The RunConfig that `megatrain train` arguments describe (file, then shortcuts, then --set)."""
    overrides = []
    for attr, key in _SHORTCUTS.items():
        value = getattr(args, attr, None)
        if value is None or (attr == "schedule" and value == "auto"):
            continue
        if attr == "schedule" and value not in NAMED_SCHEDULES:  # a schedule file: the same [schedule] table
            try:
                resolve_knobs(value)  # a named schedule or a schedule file, checked here against the file
                data = read_toml(value, ScheduleError, "schedule file")
                table = data.get("schedule", data)
            except ScheduleError as e:
                raise ConfigError(f"--schedule {value}: {e}") from None
            overrides += [f"schedule.name={table.get('name', DEFAULT_SCHEDULE)}"]
            overrides += [f"schedule.{k}={v}" for k, v in table.items() if k != "name"]
            continue
        overrides.append(f"{key}={value}")
    for item in getattr(args, "overrides", []) or []:
        key = item.split("=", 1)[0].strip()
        overrides.append(item if "." in key or "=" not in item else f"schedule.{item.strip()}")
    if getattr(args, "resume", None):
        overrides.append(f"run.resume={args.resume}")
    if getattr(args, "no_progress", False):
        overrides.append("run.progress=false")
    cfg = load_config(getattr(args, "config", None), overrides)
    if getattr(args, "schedule", None) == "auto":
        overrides, args.auto_choice = _auto_schedule(cfg, getattr(args, "gpu_budget_gib", None),
                                                     getattr(args, "auto_measure", None),
                                                     getattr(args, "auto_band", None))
        cfg = cfg.with_overrides(overrides)
    return cfg


def _auto_schedule(cfg: RunConfig, budget_gib: float | None, measure: int | None = None, band: float | None = None):
    """`--schedule auto`: the schedule overrides of the fastest predicted schedule for this run (megatrain/tune/auto.py:
    the one `auto`, with the one budget rule), printed with the next best, and the AutoChoice that measures the best
    few on the run's first steps (train/autoswitch.py); the config's numerics (clipping, dtypes, kernel,
    micro-batches) are kept. Without run.profile it uses the profile of profiling/store.py's precedence, and
    measures this machine quickly first (into the per-user cache) when that is only the shipped default. measure:
    candidates measured on the run's first steps (--auto-measure; None: the default), band: also every one predicted
    within that fraction of the best (--auto-band; None: the default); the compiled layer is a candidate knob unless
    the config sets schedule.compile_layers (autoswitch.varies_compile)."""
    try:  # each rank would choose (and measure) on its own, and ranks must run one Program (the resolver says so)
        check_run_for_ranks(int(os.environ.get("WORLD_SIZE", "1")), auto=True)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None

    # Only `auto` needs these: the simulator and the candidates (tune), the profiler and torch (autoswitch).
    from megatrain.train import autoswitch
    from megatrain.tune.auto import BudgetError  # (local for the same reason)

    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and gpu_memory() is not None)
    spec, (batch, seq), base = cfg.model.spec(), cfg.step_shape(), cfg.step_knobs()
    measure = autoswitch.DEFAULT_MEASURE if measure is None else measure
    if measure < 0:
        raise ConfigError(f"--auto-measure {measure}: give the number of candidates to measure, 0 or more")
    band = autoswitch.DEFAULT_BAND if band is None else band
    try:
        backend = "cuda" if cuda else "cpu"
        # the compiled layer is a candidate knob unless set in the config or --set
        vary = autoswitch.varies_compile("compile_layers" in cfg.schedule.overrides, backend)
        choice, _ = autoswitch.choose_before_run(spec, batch, seq, base, backend, cfg.run.run_dir, cfg.run.profile,
                                                 budget_gib, resumed=bool(cfg.run.resume), measure=measure,
                                                 vary_compile=vary, band=band)
    except autoswitch.BandError:  # autoswitch's range check, before anything is measured: in the option's words
        raise ConfigError(f"--auto-band {band}: give a fraction of the best predicted step time, 0 (measure exactly "
                          "--auto-measure candidates) up to below 1") from None
    except (ScheduleError, BudgetError) as e:
        raise ConfigError(f"--schedule auto: {e}") from None
    # No run.profile is set for the run: the profile auto chose with is the one the run resolves itself
    # (profiling/store.py; auto wrote this machine's into the cache when it had to measure it).
    return autoswitch.schedule_overrides(choice.knobs, cfg.schedule.micro_batches), choice


def run_from_args(args) -> int:
    """`megatrain train`: build the config from the arguments and train; exit status 0, 128 + the signal number
    when SIGTERM / SIGINT stopped it at a step boundary (with a checkpoint), 130 if interrupted at once.
    User mistakes raise ConfigError / DataError / CheckpointError, a run that stops on its own TrainingError
    (megatrain.cli prints them as one line)."""
    cfg = config_from_args(args)  # first: a mistake in the arguments or the config is reported before torch loads

    from megatrain.train.loop import run_training  # torch and the executor: loaded once the config is checked
    try:
        summary = run_training(cfg, auto=getattr(args, "auto_choice", None))
    except KeyboardInterrupt:
        return 130
    if summary.stop_signal is not None:
        return 128 + int(signal.Signals[summary.stop_signal])
    measured = summary.run_dir / "timeline_measured.csv"
    if getattr(args, "timeline", None) and measured.is_file():
        import pandas as pd  # only for --timeline

        from megatrain.analysis.summary import one_step  # only for --timeline

        one_step(pd.read_csv(measured)).to_csv(args.timeline, index=False)
    return 0
