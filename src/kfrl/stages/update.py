"""Stages ``update_actor`` and ``update_critic``: each loads its weights and optimizer state from the
previous iteration's checkpoint, runs its update, and commits the next checkpoint (HF layout +
optimizer state + trainer state)."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from kfrl.stages.context import StageContext

OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"


def make_optimizer(model, optim_cfg):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                             weight_decay=optim_cfg.weight_decay)


def load_optimizer(ctx: StageContext, optimizer, checkpoint: Path) -> None:
    import torch

    if (checkpoint / OPTIMIZER_FILE).exists():
        optimizer.load_state_dict(torch.load(checkpoint / OPTIMIZER_FILE, map_location=ctx.device, weights_only=True))


def save_checkpoint(ctx: StageContext, attempt, model, tokenizer, optimizer, state: dict) -> float:
    """Writes the checkpoint into the attempt; returns the seconds it took."""
    import torch

    from kfrl.models.hf_io import save_hf

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kfrl-ckpt-") as tmp:
        out = Path(tmp)
        save_hf(model, tokenizer, out)
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
        (out / TRAINER_STATE_FILE).write_text(json.dumps({"iteration": ctx.iteration, **state}))
        attempt.upload_dir(out)
    return time.perf_counter() - started


def update_actor(ctx: StageContext, table, attempt) -> tuple[None, dict[str, float]]:
    from kfrl.engines.actor import update_actor as run_update
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    previous = ctx.policy_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(previous)
    model = ctx.load_model(previous, for_training=True)
    optimizer = make_optimizer(model, cfg.actor)
    load_optimizer(ctx, optimizer, ctx.checkpoint_dir(previous, training_state=True))

    # Without old log-probs (the on-policy shortcut) the update uses its own; the reference only for a KL loss.
    fields = ("advantages", "old_logprobs") + (("ref_logprobs",) if cfg.actor.use_kl_loss else ())
    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0, fields=fields)
    metrics = run_update(model, optimizer, trajectories, cfg.actor, mini_batch_size=cfg.mini_batch_trajectories,
                         temperature=cfg.rollout.temperature, autocast_dtype=ctx.compute_dtype,
                         seed=ctx.seed("update_actor"), sample_ids=table.column("sample_id").to_pylist())
    metrics["timing_s/save_checkpoint"] = save_checkpoint(ctx, attempt, model, tokenizer, optimizer, {
        "policy_version": ctx.iteration,
        "optimizer_steps": _steps_before(ctx, previous) + cfg.n_mini_batches * cfg.actor.ppo_epochs,
    })
    return None, metrics


def update_critic(ctx: StageContext, table, attempt) -> tuple[None, dict[str, float]]:
    from kfrl.engines.critic import update_critic as run_update
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    previous = ctx.critic_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(0))
    model = ctx.load_critic(previous, for_training=True)
    optimizer = make_optimizer(model, cfg.critic)
    load_optimizer(ctx, optimizer, ctx.checkpoint_dir(previous, training_state=True))

    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0, fields=("values", "returns"))
    metrics = run_update(model, optimizer, trajectories, mini_batch_size=cfg.critic_mini_batch_size * cfg.rollout.n,
                         micro_batch_size=cfg.critic.ppo_micro_batch_size_per_gpu, epochs=cfg.critic_ppo_epochs,
                         shuffle=cfg.critic_shuffle, grad_clip=cfg.critic.grad_clip,
                         cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic_loss_agg_mode,
                         autocast_dtype=ctx.compute_dtype,
                         seed=ctx.seed("update_critic"), sample_ids=table.column("sample_id").to_pylist())
    n_steps = (cfg.data.train_batch_size // cfg.critic_mini_batch_size) * cfg.critic_ppo_epochs
    metrics["timing_s/save_checkpoint_critic"] = save_checkpoint(ctx, attempt, model, tokenizer, optimizer, {
        "optimizer_steps": _steps_before(ctx, previous) + n_steps})
    return None, metrics


def _steps_before(ctx: StageContext, manifest) -> int:
    """Optimizer steps recorded in a committed checkpoint (0 for an initial model)."""
    if TRAINER_STATE_FILE not in manifest.names():
        return 0
    return int(json.loads(ctx.store.read_file(manifest, TRAINER_STATE_FILE)).get("optimizer_steps", 0))
