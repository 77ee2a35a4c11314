"""Stages over several processes (``trainer.n_gpus_per_node`` × ``trainer.nnodes``).

- The update (``update_actor``, ``update_critic``) is data parallel and sharded: one worker process per
  device (``python -m kfrl.distributed.update_worker``), FSDP2 or DeepSpeed ZeRO (``actor.strategy``),
  each running its share of the micro-batches of the single-process loop; rank 0 commits what one
  process would (``kfrl.distributed.update_worker``). On one node ``kfrl.distributed.launch`` starts the
  workers; beyond one node ``kfrl.distributed.multinode`` submits them as a cluster job.
- Rollout and log-prob stages run data-parallel replicas (``kfrl.distributed.replicas``): prompts (or
  rows) split by prompt group, one replica process per device, merged back in prompt-major order.
"""
from __future__ import annotations


class DistributedUpdateError(RuntimeError):
    """A distributed stage cannot run as configured, or one of its processes failed."""


def world_size(config) -> int:
    """Processes of a distributed update: ``trainer.n_gpus_per_node`` × ``trainer.nnodes``."""
    return config.trainer.n_gpus_per_node * config.trainer.nnodes


def strategy_of(config) -> str:
    """``actor.strategy`` (the critic follows it): fsdp2 (``fsdp`` means the same) or deepspeed."""
    return "deepspeed" if config.actor.strategy == "deepspeed" else "fsdp2"


def distributed_update(ctx, role_name: str) -> dict[str, float]:
    """Run ``update_<role_name>`` of ``ctx``'s iteration over ``world_size`` processes and return the
    committed manifest's metrics (the stage's own commit then finds the workers' manifest)."""
    from kfrl.run import stage_prefix
    from kfrl.stages.update import ROLES

    role = ROLES[role_name]
    if ctx.config.trainer.nnodes > 1:
        from kfrl.distributed.multinode import run_multinode_update

        run_multinode_update(ctx, role_name)
    else:
        from kfrl.distributed.launch import run_distributed_update

        run_distributed_update(ctx, role_name, world_size(ctx.config))
    manifest = ctx.store.manifest(stage_prefix(ctx.iteration, role.stage))
    if manifest is None:
        raise DistributedUpdateError(f"the distributed {role.stage} of iteration {ctx.iteration} ended without "
                                     f"committing {ctx.store.url(stage_prefix(ctx.iteration, role.stage))}")
    return dict(manifest.metrics)


__all__ = ["DistributedUpdateError", "distributed_update", "strategy_of", "world_size"]
