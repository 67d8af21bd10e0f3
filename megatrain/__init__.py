"""megatrain: train LLMs whose parameters and optimizer state live in host memory, streamed layer by layer to
one GPU, with every schedule simulated before it is run.

Schedule (DAG) -> lower() -> Program -> simulator / executor -> Timeline. See docs/design.md.
"""
from .analysis import StepSummary, summarize
from .builders import build_schedule
from .knobs import DEFAULT_SCHEDULE, NAMED_SCHEDULES, ScheduleKnobs, knobs_for
from .presets import PRESETS, get_model
from .program import GpuMemoryPlan, Program, ProgramTask, lower
from .schedule import Schedule, ScheduleError
from .sim import HardwareProfile, SimResult, SimulationError, load_profile, simulate
from .spec import EMBED, HEAD, ModelSpec, SpecError, load_hf_config, spec_from_hf_config
from .tasks import Task, TaskKind
from .timeline import TIMELINE_COLUMNS, make_timeline
from .viz import chrome_trace, gantt, write_chrome_trace

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SCHEDULE", "NAMED_SCHEDULES", "ScheduleKnobs", "build_schedule", "knobs_for", "PRESETS", "get_model",
    "GpuMemoryPlan", "Program", "ProgramTask", "lower", "Schedule", "ScheduleError", "EMBED", "HEAD", "ModelSpec",
    "SpecError", "load_hf_config", "spec_from_hf_config", "Task", "TaskKind", "TIMELINE_COLUMNS", "make_timeline",
    "StepSummary", "summarize", "HardwareProfile", "SimResult", "SimulationError", "load_profile", "simulate",
    "chrome_trace", "gantt", "write_chrome_trace",
]
