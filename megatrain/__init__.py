"""megatrain: train LLMs whose parameters and optimizer state live in host memory, streamed layer by layer to
one GPU, with every schedule simulated before it is run.

Schedule (DAG) -> lower() -> Program -> simulator / executor -> Timeline. See docs/design.md.
"""
from .analysis.summary import StepSummary, summarize
from .analysis.timeline import TIMELINE_COLUMNS, make_timeline
from .analysis.viz import chrome_trace, gantt, write_chrome_trace
from .ir.builders import build_schedule
from .ir.dag import Schedule, ScheduleError
from .ir.knobs import DEFAULT_SCHEDULE, NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from .ir.program import GpuMemoryPlan, Program, ProgramTask, lower
from .ir.tasks import Task, TaskKind
from .presets import PRESETS, get_model
from .sim import HardwareProfile, SimResult, SimulationError, load_profile, simulate
from .spec import EMBED, HEAD, ModelSpec, SpecError, load_hf_config, spec_from_hf_config

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SCHEDULE", "NAMED_SCHEDULES", "ScheduleKnobs", "build_schedule", "knobs_for", "PRESETS", "get_model",
    "GpuMemoryPlan", "Program", "ProgramTask", "lower", "Schedule", "ScheduleError", "EMBED", "HEAD", "ModelSpec",
    "SpecError", "load_hf_config", "spec_from_hf_config", "Task", "TaskKind", "TIMELINE_COLUMNS", "make_timeline",
    "StepSummary", "summarize", "HardwareProfile", "SimResult", "SimulationError", "load_profile", "simulate",
    "chrome_trace", "gantt", "write_chrome_trace", "StreamedTrainer", "AdamWConfig", "run_training", "load_config",
]

# The executor and the training loop import torch; `megatrain plan` / `simulate` should not wait for it.
_LAZY = {"StreamedTrainer": ".training.trainer", "AdamWConfig": ".exec.optim", "run_training": ".training.loop",
         "load_config": ".training.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
