"""The inference stages over a rollout: ``old_logprob`` (the rollout policy's log-probs and entropy),
``ref_logprob`` (the initial model's log-probs) and ``values`` (the critic's)."""
from __future__ import annotations

import contextlib

from kfrl.run import INIT_ITERATION
from kfrl.stages.context import StageContext


def _logprobs(ctx: StageContext, table, weights_iteration: int, with_entropy: bool,
              with_sum_pi_squared: bool = False):
    """Per-sample lists of log-probs (and entropies, and sums over the vocabulary of the squared
    probabilities; None when not asked for) under the policy after ``weights_iteration``; over
    ``trainer.n_gpus_per_node`` replicas when > 1 (rows split by prompt group, merged in row order)."""
    from kfrl.distributed.replicas import map_rows, replica_count
    from kfrl.engines.inference import compute_token_stats
    from kfrl.trajectory import Trajectories

    if replica_count(ctx.config) > 1:
        parts = map_rows(ctx, "kfrl.stages.logprob:_logprobs", table, what=f"log-prob replicas of iteration "
                         f"{ctx.iteration}", weights_iteration=weights_iteration, with_entropy=with_entropy,
                         with_sum_pi_squared=with_sum_pi_squared)
        return tuple(None if parts[0][k] is None else [row for part in parts for row in part[k]] for k in range(3))

    manifest = ctx.policy_manifest(weights_iteration)
    tokenizer = ctx.load_tokenizer(manifest)
    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0)
    with _model_for(ctx, manifest, weights_iteration) as model:
        logprobs, entropy, sum_pi_squared = compute_token_stats(
            model, trajectories, temperature=ctx.config.rollout.temperature,
            micro_batch_size=ctx.config.rollout.log_prob_micro_batch_size_per_gpu, with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared, autocast_dtype=ctx.compute_dtype,
            token_budget=ctx.config.rollout.log_prob_max_token_len_per_gpu
            if ctx.config.rollout.log_prob_use_dynamic_bsz else 0, share_prompts=ctx.config.model.share_prompt_forward)
    return (trajectories.unpad(logprobs), (trajectories.unpad(entropy) if with_entropy else None),
            (trajectories.unpad(sum_pi_squared) if with_sum_pi_squared else None))


@contextlib.contextmanager
def _model_for(ctx: StageContext, manifest, weights_iteration: int):
    """The model holding ``manifest``'s weights. The initial weights of a LoRA run are its base: where this
    process holds the LoRA training copy on the device, that copy with its adapters disabled is used
    (no second model in memory); else the base is loaded."""
    import torch

    from kfrl.stages.update import resident_training_copy

    held = resident_training_copy("actor") if weights_iteration == INIT_ITERATION and ctx.config.model.lora_rank else None
    if held is not None and next(held.parameters()).device.type == torch.device(ctx.device).type:  # not offloaded
        with held.disable_adapter(), torch.no_grad():
            yield held
        return
    yield ctx.load_model(manifest)


def old_logprob(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    # veRL's actor.calculate_sum_pi_squared, on exactly when the estimator reads it (a vocabulary-sized
    # pass per chunk of positions, like the entropy).
    with_sum_pi_squared = ctx.config.algorithm.needs_sum_pi_squared
    logprobs, entropy, sum_pi_squared = _logprobs(ctx, table, ctx.iteration - 1, with_entropy=True,
                                                  with_sum_pi_squared=with_sum_pi_squared)
    masks = table.column("response_mask").to_pylist()
    # Token-mean over the whole batch, as veRL's actor/entropy.
    total = sum(e * m for row, mask in zip(entropy, masks) for e, m in zip(row, mask))
    count = sum(sum(mask) for mask in masks)
    columns = {"sample_id": table.column("sample_id").to_pylist(), "old_logprobs": logprobs, "entropy": entropy}
    if with_sum_pi_squared:
        columns["sum_pi_squared"] = sum_pi_squared
    return columns, {"actor/entropy": total / max(count, 1)}


def ref_logprob(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    logprobs, _, _ = _logprobs(ctx, table, INIT_ITERATION, with_entropy=False)
    return {"sample_id": table.column("sample_id").to_pylist(), "ref_logprobs": logprobs}, {}


def values(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    """Stage ``values``: the critic's value of every response token (0 at masked positions)."""
    return {"sample_id": table.column("sample_id").to_pylist(), "values": _values(ctx, table)}, {}


def _values(ctx: StageContext, table) -> list[list[float]]:
    """Per-sample lists of the critic's values (over replicas as ``_logprobs``)."""
    from kfrl.distributed.replicas import map_rows, replica_count
    from kfrl.engines.critic import compute_values
    from kfrl.trajectory import Trajectories

    if replica_count(ctx.config) > 1:
        parts = map_rows(ctx, "kfrl.stages.logprob:_values", table, what=f"value replicas of iteration {ctx.iteration}")
        return [row for part in parts for row in part]
    cfg = ctx.config
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION))
    model = ctx.load_critic(ctx.critic_manifest(ctx.iteration - 1))
    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0)
    result = compute_values(
        model, trajectories,
        micro_batch_size=cfg.critic.forward_micro_batch_size_per_gpu or cfg.critic.ppo_micro_batch_size_per_gpu,
        autocast_dtype=ctx.compute_dtype)
    return trajectories.unpad(result)
