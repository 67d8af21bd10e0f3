"""Measuring the machine for the simulator: `megatrain profile` (calibrate.py) and its measurements (copies.py,
units.py, rates.py, overhead.py), all timed with the executor's own code, threads and buffers (bench.py)."""
from .calibrate import Calibration, ProfileRequest, build_profile, measure_profile
from .overhead import ready_times, with_spans

__all__ = ["Calibration", "ProfileRequest", "build_profile", "measure_profile", "ready_times", "with_spans"]
