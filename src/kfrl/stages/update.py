"""Stage ``update_actor``: the policy update; commits the next policy checkpoint (HF layout + optimizer state)."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from kfrl.stages.context import StageContext

OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"


def make_optimizer(model, actor_cfg):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=actor_cfg.lr, betas=tuple(actor_cfg.betas),
                             weight_decay=actor_cfg.weight_decay)


def update_actor(ctx: StageContext, attempt) -> dict[str, float]:
    import torch

    from kfrl.engines.actor import UpdateBatch
    from kfrl.engines.actor import update_actor as run_update
    from kfrl.models.hf_io import save_hf

    cfg = ctx.config
    previous = ctx.policy_manifest(ctx.iteration - 1)
    local = ctx.checkpoint_dir(previous)
    tokenizer = ctx.load_tokenizer(previous)
    model = ctx.load_model(previous, for_training=True)
    optimizer = make_optimizer(model, cfg.actor)
    if (local / OPTIMIZER_FILE).exists():
        optimizer.load_state_dict(torch.load(local / OPTIMIZER_FILE, map_location=ctx.device, weights_only=True))

    table = ctx.read_groups("rollout", "advantage", "old_logprob", "ref_logprob")
    names = set(table.column_names)
    data = UpdateBatch(
        prompts=table.column("prompt_ids").to_pylist(),
        responses=table.column("response_ids").to_pylist(),
        response_masks=table.column("response_mask").to_pylist(),
        advantages=table.column("advantages").to_pylist(),
        old_logprobs=table.column("old_logprobs").to_pylist() if "old_logprobs" in names else None,
        ref_logprobs=table.column("ref_logprobs").to_pylist() if "ref_logprobs" in names else None,
    )
    metrics = run_update(model, optimizer, data, cfg.actor, mini_batch_size=cfg.mini_batch_trajectories,
                         temperature=cfg.rollout.temperature, pad_id=tokenizer.pad_token_id or 0,
                         autocast_dtype=ctx.compute_dtype, seed=cfg.trainer.seed + ctx.iteration)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kfrl-ckpt-") as tmp:
        out = Path(tmp)
        save_hf(model, tokenizer, out)
        torch.save(optimizer.state_dict(), out / OPTIMIZER_FILE)
        (out / TRAINER_STATE_FILE).write_text(json.dumps({
            "iteration": ctx.iteration, "policy_version": ctx.iteration,
            "optimizer_steps": cfg.n_mini_batches * cfg.actor.ppo_epochs * ctx.iteration,
        }))
        attempt.upload_dir(out)
    metrics["timing_s/save_checkpoint"] = time.perf_counter() - started
    return metrics
