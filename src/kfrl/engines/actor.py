"""The actor update: a PPO-family policy loss (veRL's dp_actor ``update_policy``), optionally with
an entropy bonus and a KL loss towards the reference policy, run by the shared mini-batch loop."""
from __future__ import annotations

from collections import defaultdict

import torch

from kfrl.engines.inference import forward_response, prompt_sharing
from kfrl.engines.minibatch import mean_metrics, optimize
from kfrl.trajectory import Trajectories

# Added to the stage seed for the policy loss's generator (a stream apart from the shuffle's).
LOSS_GENERATOR_SEED_OFFSET = 0x10557


def update_actor(model, optimizer, trajectories: Trajectories, actor_cfg, *, mini_batch_size: int,
                 temperature: float, autocast_dtype=None, seed: int = 0, progress=None,
                 sample_ids=None, share_prompts: bool = False) -> dict[str, float]:
    """Runs the update in place on ``model``/``optimizer`` over trajectories with ``advantages`` and,
    optionally, ``old_logprobs`` (absent: the on-policy shortcut, old = new.detach()) and
    ``ref_logprobs`` (absent: no KL loss); returns veRL-named metrics (means over micro-batches).
    ``share_prompts``: the rows of a micro-batch that share a prompt share its pass
    (``kfrl.engines.shared_prompt``)."""
    from kfrl.algos import actor_loss

    layout_of = prompt_sharing(model, trajectories, share_prompts)
    full = trajectories.to(next(model.parameters()).device)
    on_policy = full.get("old_logprobs") is None
    # Random choices inside the loss (clip_cov's pick among candidate tokens) come from a generator
    # seeded by the stage's seed (run seed and iteration), so a retried update computes the same
    # loss. Its stream is kept apart from the mini-batch shuffle, which is seeded with `seed` itself.
    loss_generator = torch.Generator().manual_seed((seed + LOSS_GENERATOR_SEED_OFFSET) % 2**63)
    metrics: dict[str, list[float]] = defaultdict(list)
    # veRL's use_dynamic_bsz: micro-batches by token budget, each cut to its own longest sequence. The
    # seq-mean-token-sum-norm constant stays the batch's padded response length.
    dynamic = actor_cfg.use_dynamic_bsz
    full_length = full.response_mask.shape[-1]

    def micro_step(rows: torch.Tensor) -> torch.Tensor:
        batch = full.select(rows).trimmed() if dynamic else full.select(rows)
        mask = batch.response_mask
        # Entropy costs a softmax over the vocabulary: only when it is in the loss, or when no
        # old-logprob pass reported actor/entropy for this batch.
        want_entropy = actor_cfg.entropy_coeff != 0 or on_policy
        log_prob, entropy = forward_response(model, batch, temperature, want_entropy, autocast_dtype,
                                             layout=layout_of(rows, batch) if layout_of else None)
        old_lp = log_prob.detach() if on_policy else batch.get("old_logprobs")
        loss, stats = actor_loss(
            log_prob, old_lp, batch.get("advantages"), mask, loss_mode=actor_cfg.loss_mode,
            loss_agg_mode=actor_cfg.loss_agg_mode, clip_ratio=actor_cfg.clip_ratio,
            clip_ratio_low=actor_cfg.clip_ratio_low, clip_ratio_high=actor_cfg.clip_ratio_high,
            clip_ratio_c=actor_cfg.clip_ratio_c, entropy=entropy, entropy_coeff=actor_cfg.entropy_coeff,
            ref_log_prob=batch.get("ref_logprobs"), kl_loss_type=actor_cfg.kl_loss_type,
            kl_loss_coef=actor_cfg.kl_loss_coef, tau_pos=actor_cfg.tau_pos, tau_neg=actor_cfg.tau_neg,
            clip_cov_ratio=actor_cfg.clip_cov_ratio, clip_cov_lb=actor_cfg.clip_cov_lb,
            clip_cov_ub=actor_cfg.clip_cov_ub, kl_cov_ratio=actor_cfg.kl_cov_ratio,
            ppo_kl_coef=actor_cfg.ppo_kl_coef, dro_beta=actor_cfg.dro_beta, generator=loss_generator,
            loss_scale_factor=full_length if dynamic else None)
        for key, value in stats.items():
            metrics[key].append(value)
        return loss

    loop_metrics = optimize(model, optimizer, len(full), micro_step, mini_batch_size=mini_batch_size,
                            micro_batch_size=actor_cfg.ppo_micro_batch_size_per_gpu, epochs=actor_cfg.ppo_epochs,
                            shuffle=actor_cfg.shuffle, seed=seed, grad_clip=actor_cfg.grad_clip, prefix="actor",
                            progress=progress, sample_ids=sample_ids,
                            token_budget=actor_cfg.ppo_max_token_len_per_gpu if dynamic else 0,
                            sequence_lengths=full.attention_mask.sum(-1).cpu() if dynamic else None, step_metrics=metrics)
    metrics.update(loop_metrics)
    return mean_metrics(metrics)
