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

# The training copy (fp32 model + optimizer) each update leaves in this process, per role: a resident
# engine or the inline runner reuses it for the next update when it holds exactly the checkpoint that
# update starts from (same commit), instead of reading the weights and optimizer state back from the
# store. One per role, so memory does not grow; a failed update leaves none (it may be half-updated).
_RESIDENT_TRAINERS: dict[str, tuple[str, object, object]] = {}


def make_optimizer(model, optim_cfg):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                             weight_decay=optim_cfg.weight_decay)


def load_optimizer(ctx: StageContext, optimizer, checkpoint: Path) -> None:
    import torch

    if (checkpoint / OPTIMIZER_FILE).exists():
        optimizer.load_state_dict(torch.load(checkpoint / OPTIMIZER_FILE, map_location=ctx.device, weights_only=True))


def _commit_key(ctx: StageContext, prefix: str, attempt: str) -> str:
    return f"{ctx.store.url(prefix)}#{attempt}"


def trainer(ctx: StageContext, role: str, previous, load_model, optim_cfg, attempt):
    """(model, optimizer) holding checkpoint ``previous``: the resident copy when it is that commit,
    else loaded from the store. The manifest records which (``trainer_from``: memory | store)."""
    held = _RESIDENT_TRAINERS.pop(role, None)
    if held is not None and held[0] == _commit_key(ctx, previous.prefix, previous.attempt):
        attempt.info["trainer_from"] = "memory"
        return held[1], held[2]
    del held  # a stale copy is freed before the new one is loaded
    model = load_model()
    optimizer = make_optimizer(model, optim_cfg)
    load_optimizer(ctx, optimizer, ctx.checkpoint_dir(previous, training_state=True))
    attempt.info["trainer_from"] = "store"
    return model, optimizer


def keep_trainer(ctx: StageContext, role: str, attempt, model, optimizer) -> None:
    """Keep the updated copy for the next update; it is used only if ``attempt`` is what got committed."""
    _RESIDENT_TRAINERS[role] = (_commit_key(ctx, attempt.prefix, attempt.attempt), model, optimizer)


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
    model, optimizer = trainer(ctx, "actor", previous, lambda: ctx.load_model(previous, for_training=True), cfg.actor,
                               attempt)

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
    keep_trainer(ctx, "actor", attempt, model, optimizer)
    return None, metrics


def update_critic(ctx: StageContext, table, attempt) -> tuple[None, dict[str, float]]:
    from kfrl.engines.critic import update_critic as run_update
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    previous = ctx.critic_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(0))
    model, optimizer = trainer(ctx, "critic", previous, lambda: ctx.load_critic(previous, for_training=True),
                               cfg.critic, attempt)

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
    keep_trainer(ctx, "critic", attempt, model, optimizer)
    return None, metrics


def _steps_before(ctx: StageContext, manifest) -> int:
    """Optimizer steps recorded in a committed checkpoint (0 for an initial model)."""
    if TRAINER_STATE_FILE not in manifest.names():
        return 0
    return int(json.loads(ctx.store.read_file(manifest, TRAINER_STATE_FILE)).get("optimizer_steps", 0))
