"""Measuring the machine for the simulator: `megatrain profile` (calibrate.py) and its measurements (copies.py,
units.py, rates.py, host.py, overhead.py), all timed with the executor's own code, threads and buffers (bench.py);
the collectives between the ranks of a torchrun launch (collectives.py); the machine a profile measured
(machine.py, no torch); and live calibration of a profile to a run's own steps (live.py).

The names below are imported on first use, so that `megatrain.profiling.machine` can be read without torch (the
`simulate` command imports no torch)."""
from importlib import import_module

_WHERE = {"Calibration": "calibrate", "ProfileRequest": "calibrate", "build_profile": "calibrate",
          "measure_profile": "calibrate", "LiveCalibration": "live", "calibrate_run": "live",
          "ready_times": "overhead", "with_spans": "overhead"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
