"""What a prediction rests on that was not measured: compute tasks priced from FLOPs, said in one line.

A compute task (F, R, B) whose model signature, kind, unit class and dtype have no measured table in the profile
is priced analytically (sim/costs.py: FLOPs at the matmul rate x the fitted efficiency; the embedding by its bytes).
The simulator counts those tasks (`SimResult.estimated`, `estimated_s`), and every command that prints a prediction
(simulate, compare, `--schedule auto`) prints `estimate_line` when there are any: such a prediction is not one of
the profile's measurements, and the repository has recorded how far it can be off.
"""
from __future__ import annotations

from megatrain.sim.profile import model_signature

# How far FLOP-priced predictions have missed, as the repository records them (not a model of the error):
# docs/benchmarks.md run E4: eager `arrival` with compiled-only tables, 18,626 predicted vs 17,002 measured tokens/s
# (+9.5%); docs/benchmarks.md run 17: llama-13b `lean` with the shipped profile, 5,513 predicted vs 7,126 measured
# (median of 3) tokens/s (-22.6%); docs/calibration.md run 4, finding 4: llama3-8b forward and head predicted 20-28%
# slow.
MISSED_BY = ("-23% to +9.5% in tokens/s (docs/benchmarks.md runs 17 and E4) and 20-28% per task "
             "(docs/calibration.md run 4, llama3-8b)")


def estimate_line(result, model: str | None = None) -> str | None:
    """The one line saying which compute tasks of a simulated step (a SimResult) were priced from FLOPs, their share
    of the predicted step, how far such estimates have missed, and the command that measures them; None when every
    compute task had a measured table. `model`: the name to give `megatrain profile --model` (default the
    Program's model name)."""
    n = sum(result.estimated.values())
    if not n:
        return None
    program, profile = result.program, result.profile
    sig = model_signature(program.model)
    share = 100 * result.estimated_s / result.step_s if result.step_s > 0 else 0.0
    if n == result.compute_tasks:
        missing = f"the model {sig} has no measured timings in profile {profile.name}"
    else:
        kinds = ", ".join(f"{k} x{c}" for k, c in sorted(result.estimated.items()))
        missing = f"profile {profile.name} has no measured timings of these tasks ({kinds}) for the model {sig}"
    compiled = " --set compile_layers=true" if program.placement.compiled_layers else ""
    return (f"{n} of {result.compute_tasks} compute tasks ({share:.0f}% of the predicted step) estimated from FLOPs: "
            f"{missing}; such estimates have missed by {MISSED_BY}; run `megatrain profile --model "
            f"{model or program.model.name} --batch {program.batch} --seq {program.seq}{compiled}` to measure them")
