"""Stages over several processes (``trainer.n_gpus_per_node`` × ``trainer.nnodes``).

- The update (``update_actor``, ``update_critic``) is data parallel and sharded: one worker process per
  device (``python -m kfrl.stages.update_worker``), FSDP2 or DeepSpeed ZeRO (``actor.strategy``),
  each running its share of the micro-batches of the single-process loop; rank 0 commits what one
  process would (``kfrl.stages.update_worker``). On one node ``kfrl.distributed.launch`` starts the
  workers; beyond one node ``kfrl.distributed.multinode`` submits them as a cluster job.

This package is mechanism only (processes, sharding, replicas, jobs): it imports nothing from
``kfrl.stages`` or ``kfrl.driver``. The stages use it; the worker entry points that run stage code
in each process live with the stages (``kfrl.stages.update_worker``, ``kfrl.stages.replica_worker``).
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


__all__ = ["DistributedUpdateError", "strategy_of", "world_size"]
