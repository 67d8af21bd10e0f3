"""Measuring the machine for the simulator: `megatrain profile` (calibrate.py) and its measurements (copies.py,
units.py, rates.py, overhead.py), all timed with the executor's own code, threads and buffers (bench.py); and
live calibration of a profile to a run's own steps (live.py)."""
from .calibrate import Calibration, ProfileRequest, build_profile, measure_profile
from .live import LiveCalibration, calibrate_run
from .overhead import ready_times, with_spans

__all__ = ["Calibration", "LiveCalibration", "ProfileRequest", "build_profile", "calibrate_run", "measure_profile",
           "ready_times", "with_spans"]
