"""One RL iteration as a KFP pipeline.

    rollout ─► score ─┬─► old_logprob ─┐
                      └─► ref_logprob ─┴─► advantage ─► update_actor

old_logprob and ref_logprob are parallel branches. A stage the algorithm does not need (no KL →
no reference; the on-policy shortcut → no old-logprob pass) still appears as a task and records
why it was skipped, so one compiled pipeline serves every config.
"""
from kfp import dsl

from kfrl.components.stages import (
    advantage_op,
    old_logprob_op,
    ref_logprob_op,
    rollout_op,
    score_op,
    update_actor_op,
)

PIPELINE_NAME = "kfrl-rl-iteration"
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
