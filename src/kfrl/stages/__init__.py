"""Pipeline stages: plain functions over URIs. ``run_stage(name, run_uri, iteration)`` is the one
entry point that KFP components, the inline runner and tests call.

A stage reads its inputs from committed manifests of the run's store, writes only its own
outputs under a fresh attempt prefix, and publishes them with one manifest. Running a committed
stage again is a no-op that returns the committed result, so retries and resumed runs never
redo or damage finished work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kfrl.run import stage_prefix
from kfrl.stages.context import StageContext, StageInputError

# Execution order within one iteration (a valid topological order of the DAG; veRL's step order).
INFER_STAGES = ("rollout", "gen_max", "score", "old_logprob", "ref_logprob", "values")
TRAIN_STAGES = ("advantage", "update_critic", "update_actor", "validate")
STAGES = INFER_STAGES + TRAIN_STAGES

# Fused components: stages that share a process, so weights and imports are loaded once.
FUSED_GROUPS = {"infer": INFER_STAGES, "train": TRAIN_STAGES, "iteration": STAGES}

# veRL's timing_s/<name> for each stage, so kfrl runs compare with veRL runs.
TIMING_NAMES = {"rollout": "gen", "gen_max": "gen_max", "score": "reward", "old_logprob": "old_log_prob",
                "ref_logprob": "ref", "values": "values", "advantage": "adv", "update_critic": "update_critic",
                "update_actor": "update_actor", "validate": "testing"}


@dataclass
class StageResult:
    stage: str
    uri: str
    metrics: dict
    cached: bool     # already committed before this call
    skipped: str     # why the algorithm does not need it ("" when it ran)


def _functions() -> dict[str, Callable]:
    from kfrl.stages.advantage import advantage
    from kfrl.stages.logprob import old_logprob, ref_logprob, values
    from kfrl.stages.rollout import gen_max, rollout
    from kfrl.stages.score import score
    from kfrl.stages.update import update_actor, update_critic
    from kfrl.stages.validate import validate

    return {"rollout": rollout, "gen_max": gen_max, "score": score, "old_logprob": old_logprob,
            "ref_logprob": ref_logprob, "values": values, "advantage": advantage, "update_critic": update_critic,
            "update_actor": update_actor, "validate": validate}


def skip_reason(stage: str, config, iteration: int | None = None) -> str:
    """Why ``stage`` is not needed under ``config`` ("" when it is); ``iteration`` matters only for
    the actor's critic warm-up (None = a steady-state iteration)."""
    if stage == "ref_logprob" and not config.use_ref:
        return "no KL term uses a reference policy (actor.use_kl_loss=false, algorithm.use_kl_in_reward=false)"
    if stage == "old_logprob" and not config.recompute_old_logprobs:
        return "on-policy: one mini-batch and one epoch make old log-probs equal to the update's own"
    if stage in ("values", "update_critic") and not config.use_critic:
        return f"no critic: algorithm.adv_estimator={config.algorithm.adv_estimator} does not use values"
    if stage == "gen_max" and config.algorithm.adv_estimator != "remax":
        return "greedy baselines are only for algorithm.adv_estimator=remax"
    if stage == "validate":
        return validation_skip_reason(config, iteration)
    warmup = config.trainer.critic_warmup
    if stage == "update_actor" and iteration is not None and iteration < warmup:
        return f"critic warm-up: the actor is updated from iteration {warmup} (trainer.critic_warmup)"
    return ""


def validation_skip_reason(config, iteration: int | None) -> str:
    """veRL's schedule: before training when val_before_train; every test_freq iterations and at the last."""
    trainer = config.trainer
    if not config.data.val_files:
        return "no validation data (data.val_files)"
    if iteration == 0:
        return "" if trainer.val_before_train else "trainer.val_before_train=false"
    if trainer.test_freq <= 0:
        return "trainer.test_freq <= 0"
    if iteration is None:
        return ""
    if iteration % trainer.test_freq == 0 or iteration == trainer.total_iterations:
        return ""
    return f"not a validation iteration (every {trainer.test_freq}, trainer.test_freq, and the last)"


def plan(config) -> dict[str, str]:
    """Stage → "" (runs) or the reason it is skipped, in a steady-state iteration."""
    return {stage: skip_reason(stage, config) for stage in STAGES}


def run_stage(stage: str, run_uri: str, iteration: int) -> StageResult:
    if stage not in STAGES:
        raise ValueError(f"unknown stage '{stage}'; stages are {', '.join(STAGES)}")
    ctx = StageContext.open(run_uri, iteration)
    prefix = stage_prefix(iteration, stage)
    existing = ctx.store.manifest(prefix)
    if existing is not None:
        return StageResult(stage, ctx.store.url(prefix), dict(existing.metrics), True,
                           existing.info.get("skipped", ""))
    attempt = ctx.store.open_attempt(prefix)
    reason = skip_reason(stage, ctx.config, iteration)
    if reason:
        attempt.commit(info={"skipped": reason})
        return StageResult(stage, ctx.store.url(prefix), {}, False, reason)
    started = time.perf_counter()
    metrics = _functions()[stage](ctx, attempt)
    metrics[f"timing_s/{TIMING_NAMES[stage]}"] = time.perf_counter() - started
    manifest = attempt.commit(metrics=metrics, info={"iteration": iteration})
    return StageResult(stage, ctx.store.url(prefix), dict(manifest.metrics), False, "")


__all__ = ["FUSED_GROUPS", "STAGES", "TIMING_NAMES", "StageResult", "StageInputError", "plan", "run_stage", "skip_reason"]
