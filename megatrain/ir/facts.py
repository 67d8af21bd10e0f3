"""StepFacts: what a run knows about its steps that changes a step's work but is not in the Program's queues.

A Program fixes every task, stream and wait; a few facts of the run then decide how much some tasks do. The
ranks and hosts are in the Program's placement (`Placement.world`, `.hosts`); the facts below are not known when
a schedule is lowered, so they travel with the Program as this one typed record (the simulator takes it:
`simulate(program, profile, StepFacts(clip_share=0.1))`), never as loose interpreter arguments.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFacts:
    """Facts of the run that change a step of its Program.

    clip_share: the share of steps whose global gradient norm exceeds the clipping max. It matters only with
    speculative clipping (exact clipping with arrival timing): a step that clips undoes and redoes every update
    (CLIP_REDO); a step that does not, runs each update once as its gradients land. 0 (the default) is a run that
    never clips, 1 one that clips every step."""

    clip_share: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.clip_share <= 1.0:
            raise ValueError(f"clip_share={self.clip_share}: the share of steps that clip is between 0 and 1")


NO_CLIP = StepFacts()
