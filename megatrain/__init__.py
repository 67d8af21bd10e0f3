"""megatrain: train LLMs whose parameters and optimizer state live in host memory, streamed layer by layer to
one GPU, with every schedule simulated before it is run.

Schedule (DAG) -> lower() -> Program -> simulator / executor -> Timeline. See docs/design.md.

Every public name below is imported on first use (PEP 562 `__getattr__`): `import megatrain` and the CLI's
`--help` / `--version` do not pay for pandas, networkx, simpy or torch until something needs them.
"""
from __future__ import annotations
import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    **dict.fromkeys(("StepSummary", "summarize"), ".analysis.summary"),
    **dict.fromkeys(("TIMELINE_COLUMNS", "make_timeline"), ".analysis.timeline"),
    **dict.fromkeys(("chrome_trace", "gantt", "write_chrome_trace"), ".analysis.viz"),
    "build_schedule": ".compile.builders",
    **dict.fromkeys(("Schedule", "ScheduleError"), ".ir.dag"),
    **dict.fromkeys(("DEFAULT_SCHEDULE", "NAMED_SCHEDULES", "ScheduleKnobs", "knobs_for"), ".compile.knobs"),
    **dict.fromkeys(("GpuMemoryPlan", "Program", "ProgramTask"), ".ir.program"),
    "lower": ".compile.lower",
    **dict.fromkeys(("Task", "TaskKind"), ".ir.tasks"),
    "Placement": ".ir.placement",
    "resolve": ".compile.resolve",
    "build_from_placement": ".compile.builders",
    **dict.fromkeys(("PRESETS", "get_model"), ".model.presets"),
    **dict.fromkeys(("HardwareProfile", "SimResult", "SimulationError", "load_profile", "simulate"), ".sim"),
    **dict.fromkeys(("EMBED", "HEAD", "ModelSpec", "SpecError", "load_hf_config", "spec_from_hf_config"), ".model.spec"),
    "StreamedTrainer": ".engine.trainer",
    "AdamWConfig": ".exec.optim",
    "run_training": ".train.loop",
    "load_config": ".train.config",
    "export_checkpoint": ".train.export",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module 'megatrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
