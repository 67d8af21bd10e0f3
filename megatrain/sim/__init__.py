"""The discrete-event simulator: predicts the Timeline of a Program from a HardwareProfile.

    from megatrain import simulate, load_profile
    result = simulate(lower(build_schedule(spec, 8, 2048, "overlap")), "h200")
    result.timeline, result.summary

See docs/simulator.md.
"""
from megatrain.sim.bound import StepBound, step_bound
from megatrain.sim.costs import CostModel
from megatrain.sim.engine import SimResult, SimulationError, simulate
from megatrain.sim.estimates import estimate_line
from megatrain.sim.profile import (
                      ComputeTable,
                      CopyCurve,
                      HardwareProfile,
                      ProfileError,
                      load_profile,
                      model_signature,
                      shipped_profiles,
)

__all__ = ["CostModel", "SimResult", "SimulationError", "simulate", "ComputeTable", "CopyCurve", "HardwareProfile",
           "ProfileError", "load_profile", "model_signature", "shipped_profiles", "StepBound", "step_bound",
           "estimate_line"]
