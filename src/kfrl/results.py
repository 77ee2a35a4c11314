"""What one stage of an iteration returns (``kfrl.stages.run_stage``, or the run's engine for a task).

A module of its own, importing nothing: a KFP task that only hands its stage to the engine builds
these from the engine's answer without importing the stage table, the config models or the store
(together ~0.1 s per task on 2 cores)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StageResult:
    stage: str
    uri: str
    metrics: dict
    cached: bool     # already committed before this call
    skipped: str     # why the algorithm does not need it ("" when it ran)
