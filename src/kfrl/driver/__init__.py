"""How a run is driven, here and there.

A run is prepared once, then driven one iteration at a time by ``kfrl.driver.controller`` (resume,
metrics, promotion); what executes an iteration is a runner:

- ``kfrl.driver.local``: this machine. ``InlineRunner`` calls the stages in this process;
  ``LocalKfpRunner`` runs the iteration pipeline on KFP's local runner (one subprocess per task).
- ``kfrl.driver.cluster``: a KFP cluster. One pipeline run per iteration, compiled from the run's
  config and committed in its folder; ``kfrl.driver.submit`` submits, schedules and follows the
  ``rl_train`` pipeline whose one task is this driver (``kfrl.driver.kfp_entry``).
- ``kfrl.driver.engine``: the run's resident engine, which keeps models loaded across stages and
  iterations. ``server`` (``kfrl engine serve``), ``client`` (a task hands its stage to it) and
  ``workload`` (the engine as a Pod + Service on Kubernetes, owned by the driver's pod).

``kfrl.driver.dryrun`` checks a config and its inputs before anything runs. The stages themselves
(``kfrl.stages``) know nothing of how they are driven.
"""
from __future__ import annotations


class IterationFailed(RuntimeError):
    """An iteration's pipeline did not commit all its stages; the message says where to look."""


def make_runner(config):
    """The runner ``pipeline.runner`` names: inline, local (KFP's local runner) or kfp (a cluster)."""
    kind = config.pipeline.runner
    if kind == "inline":
        from kfrl.driver.local import InlineRunner

        return InlineRunner()
    if kind == "local":
        from kfrl.driver.local import LocalKfpRunner

        return LocalKfpRunner(config.pipeline.pipeline_root, fuse=config.pipeline.fuse)
    from kfrl.driver.cluster import ClusterKfpRunner

    return ClusterKfpRunner(config)


__all__ = ["IterationFailed", "make_runner"]
