"""KFP components: one thin wrapper per stage. All logic lives in ``kfrl.stages``.

Each component takes the run's URI and the iteration, plus the URIs of the stages it depends on
(which gives the DAG its edges), and returns its own stage URI. Metrics also go into a KFP
``Metrics`` artifact so they show in the KFP UI. ``install_kfp_package=False``: the image (on a
cluster) or the project venv (locally) provides kfp and kfrl.
"""
from kfrl.components.stages import (
    advantage_op,
    infer_op,
    iteration_op,
    old_logprob_op,
    ref_logprob_op,
    rollout_op,
    score_op,
    train_op,
    update_actor_op,
)

__all__ = ["rollout_op", "score_op", "old_logprob_op", "ref_logprob_op", "advantage_op", "update_actor_op",
           "infer_op", "train_op",
           "iteration_op"]
