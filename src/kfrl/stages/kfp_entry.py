"""What a KFP component body calls: run the stage (on the run's resident engine when one answers,
else in this task), mirror its metrics into the KFP Metrics artifact."""
from __future__ import annotations

import math


def run_for_kfp(stage: str, run_uri: str, iteration: int, metrics_artifact) -> str:
    from kfrl.engine_client import dispatch

    return _report(dispatch(stage, run_uri, int(iteration)), iteration, metrics_artifact)


def run_group_for_kfp(group: str, run_uri: str, iteration: int, metrics_artifact) -> str:
    """A fused component: the group's stages in one process; returns the last stage's URI."""
    from kfrl.engine_client import dispatch
    from kfrl.stages import FUSED_GROUPS

    uri = ""
    for stage in FUSED_GROUPS[group]:
        uri = _report(dispatch(stage, run_uri, int(iteration)), iteration, metrics_artifact)
    metrics_artifact.metadata["stage"] = group
    return uri


def _report(result, iteration: int, metrics_artifact) -> str:
    stage = result.stage
    for key, value in result.metrics.items():
        if isinstance(value, (int, float)) and math.isfinite(value):
            # KFP metric names may not contain "/" in every UI version; keep veRL's name readable.
            metrics_artifact.log_metric(key.replace("/", "."), float(value))
    metrics_artifact.metadata["stage"] = stage
    metrics_artifact.metadata["cached"] = result.cached
    if result.skipped:
        metrics_artifact.metadata["skipped"] = result.skipped
    status = "skipped: " + result.skipped if result.skipped else ("already committed" if result.cached else "done")
    print(f"[kfrl] iteration {iteration} {stage}: {status} -> {result.uri}")
    return result.uri
