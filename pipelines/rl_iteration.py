"""One RL iteration as a KFP pipeline.

              ┌─► score ───────┐
              ├─► gen_max ─────┤                 ┌─► update_critic
    rollout ──┼─► old_logprob ─┼─► advantage ────┤
              ├─► ref_logprob ─┤                 └─► update_actor ─► validate
              └─► values ──────┘

Everything that reads only the rollout (scoring, ReMax's greedy baseline, the old/reference
log-probs, the critic's values) is a parallel branch; the critic and actor updates are too.

The edges are derived from ``kfrl.stages.STAGE_TABLE`` (what each stage reads or needs), not
written here. ``rl_iteration_fused`` runs the same stage functions as two tasks, ``infer`` (rollout to values)
then ``train`` (advantage and both updates), and ``rl_iteration_single`` as one task, so weights
and imports are loaded once per task (config ``pipeline.fuse``). A stage the algorithm does not
need (no KL → no reference; no GAE → no critic; not ReMax → no greedy baseline; the on-policy
shortcut → no old-logprob pass; validation only every trainer.test_freq iterations) still appears
as a task and records why it was skipped, so one compiled pipeline serves every algorithm.
``rl_validate`` validates one policy on its own (the initial one, for trainer.val_before_train).
"""
from kfp import dsl

from kfrl.components.stages import (
    advantage_op,
    gen_max_op,
    infer_op,
    iteration_op,
    old_logprob_op,
    ref_logprob_op,
    rollout_op,
    score_op,
    train_op,
    update_actor_op,
    update_critic_op,
    validate_op,
    values_op,
)
from kfrl.stages import pipeline_edges

PIPELINE_NAME = "kfrl-rl-iteration"
FUSED_PIPELINE_NAME = "kfrl-rl-iteration-fused"
SINGLE_PIPELINE_NAME = "kfrl-rl-iteration-single"
VALIDATE_PIPELINE_NAME = "kfrl-validate"
RETRIES = 2


def _task(task, name: str):
    # The store makes every stage idempotent, so KFP's own cache is off and retries are safe.
    task.set_display_name(name)
    task.set_caching_options(False)
    task.set_retry(num_retries=RETRIES, backoff_duration="5s", backoff_factor=2.0)
    return task


STAGE_OPS = {"rollout": rollout_op, "gen_max": gen_max_op, "score": score_op, "old_logprob": old_logprob_op,
             "ref_logprob": ref_logprob_op, "values": values_op, "advantage": advantage_op,
             "update_critic": update_critic_op, "update_actor": update_actor_op, "validate": validate_op}


@dsl.pipeline(name=PIPELINE_NAME, description="One veRL-style RL iteration: rollout, then score, "
              "greedy baseline, old/ref log-probs and critic values in parallel, advantage, then the critic "
              "and actor updates. Inputs and outputs live in the run's store.")
def rl_iteration(run_uri: str, iteration: int) -> str:
    # Every edge comes from kfrl.stages.STAGE_TABLE: a stage runs after the stages it reads or needs.
    tasks = {}
    for stage, upstream in pipeline_edges().items():
        tasks[stage] = _task(STAGE_OPS[stage](run_uri=run_uri, iteration=iteration), stage)
        for name in upstream:
            tasks[stage].after(tasks[name])
    return tasks["update_actor"].outputs["Output"]


@dsl.pipeline(name=FUSED_PIPELINE_NAME, description="One veRL-style RL iteration in two fused tasks: "
              "infer (rollout, score, greedy baseline, old/ref log-probs, values) and train (advantage, "
              "critic and actor updates).")
def rl_iteration_fused(run_uri: str, iteration: int) -> str:
    infer = _task(infer_op(run_uri=run_uri, iteration=iteration), "infer")
    train = _task(train_op(run_uri=run_uri, iteration=iteration), "train").after(infer)
    return train.outputs["Output"]


@dsl.pipeline(name=SINGLE_PIPELINE_NAME, description="One veRL-style RL iteration as a single task "
              "(all stages in one process).")
def rl_iteration_single(run_uri: str, iteration: int) -> str:
    return _task(iteration_op(run_uri=run_uri, iteration=iteration), "iteration").outputs["Output"]


@dsl.pipeline(name=VALIDATE_PIPELINE_NAME, description="Validate the policy after an iteration (0 = the "
              "initial policy) on the run's validation data; metrics val-core/<data_source>/...")
def rl_validate(run_uri: str, iteration: int) -> str:
    return _task(validate_op(run_uri=run_uri, iteration=iteration), "validate").outputs["Output"]


PIPELINES = {"rl_iteration": rl_iteration, "rl_iteration_fused": rl_iteration_fused,
             "rl_iteration_single": rl_iteration_single, "rl_validate": rl_validate}
FUSE_TO_PIPELINE = {"none": "rl_iteration", "weights": "rl_iteration_fused", "all": "rl_iteration_single"}


def pipeline_for(fuse: str, pipeline: str = "iteration") -> str:
    """The compiled pipeline that runs ``pipeline`` ("iteration" or "validate") under ``pipeline.fuse``."""
    return "rl_validate" if pipeline == "validate" else FUSE_TO_PIPELINE[fuse]
