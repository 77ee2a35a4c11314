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

from kfrl.heap import settle_after_first_iteration
from kfrl.host_threads import settle_host_threads
from kfrl.results import StageResult
from kfrl.run import stage_prefix
from kfrl.stages.context import StageContext, StageInputError


@dataclass(frozen=True)
class StageSpec:
    """One stage of the iteration: the single place its inputs, output, order and skip rule live.

    ``run(ctx, inputs, attempt)`` gets the join of the ``reads`` column groups (producers that were
    skipped left out; None when it reads none) and returns ``(columns, metrics)``: ``run_stage``
    writes the columns as the ``writes`` group. A stage that commits a checkpoint (``writes`` None)
    uploads it into ``attempt`` itself; any stage may add manifest ``info`` to the attempt.
    """
    name: str
    module: str                    # kfrl.stages.<module>.<name> is the function (imported when run)
    reads: tuple[str, ...]         # column groups joined into the inputs
    writes: str | None             # the column group it commits (None: a checkpoint)
    timing: str                    # veRL's timing_s/<timing> for this stage
    after: tuple[str, ...] = ()    # stages it needs beyond those it reads (a checkpoint, the policy)
    skip: Callable[..., str] = lambda config, iteration: ""
    metric_precedence: int = 0     # on a metric name two stages report, the higher precedence wins

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.reads + self.after))

    def function(self) -> Callable:
        import importlib

        return getattr(importlib.import_module(f"kfrl.stages.{self.module}"), self.name)


def _no_ref(config, iteration) -> str:
    if config.use_ref:
        return ""
    return "no KL term uses a reference policy (actor.use_kl_loss=false, algorithm.use_kl_in_reward=false)"


def _on_policy(config, iteration) -> str:
    # optimal_token_baseline reads the old log-probs and their Σπ² before the update, so the pass runs
    # even on-policy (as for the KL in the reward); the rollout's log-probs come without Σπ².
    if config.recompute_old_logprobs or config.algorithm.needs_sum_pi_squared:
        return ""
    return "on-policy: one mini-batch and one epoch make old log-probs equal to the update's own"


def _no_critic(config, iteration) -> str:
    if config.use_critic:
        return ""
    return f"no critic: algorithm.adv_estimator={config.algorithm.adv_estimator} does not use values"


def _not_remax(config, iteration) -> str:
    if config.algorithm.adv_estimator == "remax":
        return ""
    return "greedy baselines are only for algorithm.adv_estimator=remax"


def _critic_warmup(config, iteration) -> str:
    warmup = config.trainer.critic_warmup
    if iteration is not None and iteration < warmup:
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


# The iteration's graph, in execution order (a topological order; veRL's step order). The KFP
# pipeline's edges, the timing names, the metric order and the fused groups all come from here.
STAGE_TABLE: tuple[StageSpec, ...] = (
    StageSpec("rollout", "rollout", reads=(), writes="rollout", timing="gen"),
    StageSpec("gen_max", "rollout", reads=("rollout",), writes="gen_max", timing="gen_max", skip=_not_remax),
    StageSpec("score", "score", reads=("rollout",), writes="score", timing="reward"),
    StageSpec("old_logprob", "logprob", reads=("rollout",), writes="old_logprob", timing="old_log_prob",
              skip=_on_policy, metric_precedence=1),  # veRL reports actor/entropy from old_log_prob
    StageSpec("ref_logprob", "logprob", reads=("rollout",), writes="ref_logprob", timing="ref", skip=_no_ref),
    StageSpec("values", "logprob", reads=("rollout",), writes="values", timing="values", skip=_no_critic),
    StageSpec("advantage", "advantage",
              reads=("rollout", "score", "old_logprob", "ref_logprob", "values", "gen_max"),
              writes="advantage", timing="adv"),
    StageSpec("update_critic", "update", reads=("rollout", "values", "advantage"), writes=None,
              timing="update_critic", skip=_no_critic),
    StageSpec("update_actor", "update", reads=("rollout", "advantage", "old_logprob", "ref_logprob"), writes=None,
              timing="update_actor", skip=_critic_warmup),
    StageSpec("validate", "validate", reads=(), writes="validate", timing="testing", after=("update_actor",),
              skip=validation_skip_reason),
)
SPECS = {spec.name: spec for spec in STAGE_TABLE}
STAGES = tuple(SPECS)
INFER_STAGES = ("rollout", "gen_max", "score", "old_logprob", "ref_logprob", "values")
TRAIN_STAGES = tuple(s for s in STAGES if s not in INFER_STAGES)
# Fused components: stages that share a process, so weights and imports are loaded once.
FUSED_GROUPS = {"infer": INFER_STAGES, "train": TRAIN_STAGES, "iteration": STAGES}
# veRL's timing_s/<name> for each stage, so kfrl runs compare with veRL runs.
TIMING_NAMES = {spec.name: spec.timing for spec in STAGE_TABLE}
# The order in which an iteration's stage metrics are merged: later entries win on a shared name.
METRIC_ORDER = tuple(spec.name for spec in sorted(STAGE_TABLE, key=lambda spec: spec.metric_precedence))


def pipeline_edges(stages=None) -> dict[str, tuple[str, ...]]:
    """Each stage's direct predecessors in the pipeline: its needs, less those another need implies.
    ``stages``: a subset (the others left out of the pipeline); a stage then follows its nearest
    ancestors in the subset."""
    kept = set(STAGES if stages is None else stages)

    def ancestors(stage: str) -> set[str]:
        found: set[str] = set()
        for need in SPECS[stage].needs:
            found |= {need} | ancestors(need)
        return found

    edges = {}
    for spec in STAGE_TABLE:
        if spec.name not in kept:
            continue
        candidates = [a for a in (*spec.needs, *STAGES) if a in kept and a in ancestors(spec.name)]
        candidates = list(dict.fromkeys(candidates))
        edges[spec.name] = tuple(a for a in candidates
                                 if not any(a in ancestors(other) for other in candidates if other != a))
    return edges


def always_skipped(config) -> tuple[str, ...]:
    """The stages ``config`` skips in every iteration (whatever the iteration: no reference without a
    KL term, no critic without GAE, ...): a pipeline compiled for the run leaves them out, and the
    driver commits their skip records (``run_stage``) instead of starting a task for each."""
    return tuple(stage for stage, reason in plan(config).items() if reason)


GRAPH_START = "<!-- stage-graph:start (generated by `python -m kfrl.stages docs/architecture.md`) -->"
GRAPH_END = "<!-- stage-graph:end -->"


def stage_graph() -> str:
    """The iteration's stage graph as a Mermaid flowchart, generated from the table: an arrow per
    pipeline edge, each node labelled with the group it writes (or "checkpoint") and its timing name."""
    lines = ["```mermaid", "flowchart LR"]
    for spec in STAGE_TABLE:
        output = spec.writes and f"writes {spec.writes}" or "writes a checkpoint"
        lines.append(f'    {spec.name}["{spec.name}<br/><small>{output} · timing_s/{spec.timing}</small>"]')
    for stage, upstream in pipeline_edges().items():
        lines += [f"    {name} --> {stage}" for name in upstream]
    lines.append("```")
    return "\n".join(lines)


def update_graph_in(path) -> bool:
    """Rewrites the generated stage graph in a Markdown file; True when it changed."""
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    start, end = text.index(GRAPH_START), text.index(GRAPH_END)
    new = f"{text[:start]}{GRAPH_START}\n{stage_graph()}\n{text[end:]}"
    if new != text:
        path.write_text(new)
    return new != text


def skip_reason(stage: str, config, iteration: int | None = None) -> str:
    """Why ``stage`` is not needed under ``config`` ("" when it is); ``iteration`` matters only for
    the actor's critic warm-up and validation (None = a steady-state iteration)."""
    return SPECS[stage].skip(config, iteration)


def plan(config) -> dict[str, str]:
    """Stage → "" (runs) or the reason it is skipped, in a steady-state iteration."""
    return {stage: skip_reason(stage, config) for stage in STAGES}


def run_stage(stage: str, run_uri: str, iteration: int) -> StageResult:
    """Run one stage of one iteration, unless it is committed already: read its inputs, call it,
    write its column group, commit. A skipped stage commits its reason."""
    if stage not in SPECS:
        raise ValueError(f"unknown stage '{stage}'; stages are {', '.join(STAGES)}")
    spec = SPECS[stage]
    settle_after_first_iteration(iteration)
    ctx = StageContext.open(run_uri, iteration)
    settle_host_threads(ctx.device)
    prefix = stage_prefix(iteration, stage)
    existing = ctx.store.manifest(prefix)
    if existing is not None:
        return StageResult(stage, ctx.store.url(prefix), dict(existing.metrics), True,
                           existing.info.get("skipped", ""))
    attempt = ctx.store.open_attempt(prefix)
    reason = spec.skip(ctx.config, iteration)
    if reason:
        attempt.commit(info={"skipped": reason})
        return StageResult(stage, ctx.store.url(prefix), {}, False, reason)
    started = time.perf_counter()
    inputs = ctx.read_groups(*spec.reads) if spec.reads else None
    columns, metrics = spec.function()(ctx, inputs, attempt)
    if spec.writes is not None:
        from kfrl import batch

        batch.write_group(attempt, spec.writes, batch.make_table(spec.writes, columns))
    metrics[f"timing_s/{spec.timing}"] = time.perf_counter() - started
    manifest = attempt.commit(metrics=metrics, info={"iteration": iteration})
    return StageResult(stage, ctx.store.url(prefix), dict(manifest.metrics), False, "")


__all__ = ["FUSED_GROUPS", "METRIC_ORDER", "SPECS", "STAGES", "STAGE_TABLE", "StageSpec", "TIMING_NAMES",
           "StageResult", "StageInputError", "always_skipped", "pipeline_edges", "plan", "run_stage", "skip_reason", "stage_graph"]
