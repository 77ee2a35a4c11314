"""One RL iteration as a KFP pipeline.

    rollout ─► score ─┬─► old_logprob ─┐
                      └─► ref_logprob ─┴─► advantage ─► update_actor

old_logprob and ref_logprob are parallel branches.

``rl_iteration_fused`` runs the same stage functions as two tasks, ``infer`` (rollout, score,
old/ref log-probs) then ``train`` (advantage, update_actor), and ``rl_iteration_single`` as one
task, so weights and imports are loaded once per task (config ``pipeline.fuse``). A stage the algorithm does not need (no KL →
no reference; the on-policy shortcut → no old-logprob pass) still appears as a task and records
why it was skipped, so one compiled pipeline serves every config.
"""
from kfp import dsl

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

PIPELINE_NAME = "kfrl-rl-iteration"
FUSED_PIPELINE_NAME = "kfrl-rl-iteration-fused"
SINGLE_PIPELINE_NAME = "kfrl-rl-iteration-single"
RETRIES = 2


def _task(task, name: str):
    # The store makes every stage idempotent, so KFP's own cache is off and retries are safe.
    task.set_display_name(name)
    task.set_caching_options(False)
    task.set_retry(num_retries=RETRIES, backoff_duration="5s", backoff_factor=2.0)
    return task


@dsl.pipeline(name=PIPELINE_NAME, description="One veRL-style RL iteration: rollout, score, "
              "log-probs, advantage, actor update. Inputs and outputs live in the run's store.")
def rl_iteration(run_uri: str, iteration: int) -> str:
    rollout = _task(rollout_op(run_uri=run_uri, iteration=iteration), "rollout")
    score = _task(score_op(run_uri=run_uri, iteration=iteration, rollout_uri=rollout.outputs["Output"]), "score")
    old = _task(old_logprob_op(run_uri=run_uri, iteration=iteration, rollout_uri=score.outputs["Output"]),
                "old_logprob")
    ref = _task(ref_logprob_op(run_uri=run_uri, iteration=iteration, rollout_uri=score.outputs["Output"]),
                "ref_logprob")
    adv = _task(advantage_op(run_uri=run_uri, iteration=iteration, score_uri=score.outputs["Output"],
                             old_logprob_uri=old.outputs["Output"], ref_logprob_uri=ref.outputs["Output"]),
                "advantage")
    update = _task(update_actor_op(run_uri=run_uri, iteration=iteration, advantage_uri=adv.outputs["Output"]),
                   "update_actor")
    return update.outputs["Output"]


@dsl.pipeline(name=FUSED_PIPELINE_NAME, description="One veRL-style RL iteration in two fused tasks: "
              "infer (rollout, score, old/ref log-probs) and train (advantage, actor update).")
def rl_iteration_fused(run_uri: str, iteration: int) -> str:
    infer = _task(infer_op(run_uri=run_uri, iteration=iteration), "infer")
    train = _task(train_op(run_uri=run_uri, iteration=iteration, infer_uri=infer.outputs["Output"]), "train")
    return train.outputs["Output"]


@dsl.pipeline(name=SINGLE_PIPELINE_NAME, description="One veRL-style RL iteration as a single task "
              "(all stages in one process).")
def rl_iteration_single(run_uri: str, iteration: int) -> str:
    return _task(iteration_op(run_uri=run_uri, iteration=iteration), "iteration").outputs["Output"]


PIPELINES = {"rl_iteration": rl_iteration, "rl_iteration_fused": rl_iteration_fused,
             "rl_iteration_single": rl_iteration_single}
FUSE_TO_PIPELINE = {"none": "rl_iteration", "weights": "rl_iteration_fused", "all": "rl_iteration_single"}


def pipeline_for(fuse: str) -> str:
    return FUSE_TO_PIPELINE[fuse]
