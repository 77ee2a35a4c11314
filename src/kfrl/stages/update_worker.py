"""One process of a distributed update: ``python -m kfrl.stages.update_worker --run-uri URI
--iteration N --role actor|critic``, under a torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). The same entry point serves one node (``kfrl.distributed.launch``) and a
multi-node job (one pod per node running torchrun).

Every rank loads the trainer state the single-process update would start from, shards it
(``actor.strategy``: FSDP2, or DeepSpeed ZeRO-2/3), runs its share of the update (its micro-batches,
``kfrl.distributed.parallel``), and takes part in gathering the full state. A LoRA copy is not
sharded: every rank holds the frozen base and the adapters, and the adapters' gradients are summed
over the ranks before each step (DDP), so rank 0's copy is the whole result. Rank 0 then commits what
the single-process stage commits: the weights (``iter-N/update_actor`` or ``update_critic``: HF layout
in the inference dtype, tokenizer, MLmodel for the policy) with the same manifest info and metrics, and
the trainer state (fp32 weights, a full ``optimizer.pt``, ``trainer_state.json``). The other ranks wait
at a barrier. A stage already committed makes every rank exit 0 at once.

``KFRL_KILL_AT`` (``kfrl.faults``) applies to every rank, or only to rank ``KFRL_KILL_RANK`` when set.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

KILL_RANK_ENV = "KFRL_KILL_RANK"
# A generous limit for one collective: rank 0 writes a large trainer state while the others wait.
COLLECTIVE_TIMEOUT = timedelta(minutes=60)


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[kfrl] {message}", file=sys.stderr, flush=True)


def _state_ready(ctx, role, previous) -> bool:
    """Whether ``load_trainer_state`` finds ``previous``'s trainer state committed (else it rebuilds it,
    which only rank 0 may do: the others load what it committed)."""
    from kfrl.run import INIT_ITERATION, split_stage_prefix
    from kfrl.stages.update import OPTIMIZER_FILE

    written_at = split_stage_prefix(previous.prefix)[0]
    if written_at == INIT_ITERATION or OPTIMIZER_FILE in previous.names():
        return True
    state = ctx.run.manifest(role.state, written_at)
    return state is not None and state.info.get("weights_attempt") == previous.attempt


def _load_on_host(ctx, role, optim_cfg, previous):
    """``load_trainer_state`` into host memory (sharding then moves each rank's shard to its device)."""
    from kfrl.stages.update import load_trainer_state

    ctx.compute_dtype  # noqa: B018 - fixed by the real device before the load borrows "cpu"
    device = ctx.device
    ctx.__dict__["device"] = "cpu"
    try:
        return load_trainer_state(ctx, role, optim_cfg, previous)
    finally:
        ctx.__dict__["device"] = device


def run_worker(run_uri: str, iteration: int, role_name: str, rank: int, world_size: int, local_rank: int) -> int:
    import torch
    import torch.distributed as dist

    from kfrl.distributed import strategy_of
    from kfrl.distributed import DistributedUpdateError
    from kfrl.run import stage_prefix
    from kfrl.stages import SPECS
    from kfrl.stages.context import StageContext
    from kfrl.stages.update import ROLES, role_lora

    started = time.perf_counter()
    if role_name not in ROLES:
        raise DistributedUpdateError(f"--role {role_name!r}: expected one of {', '.join(ROLES)}")
    role = ROLES[role_name]
    spec = SPECS[role.stage]
    ctx = StageContext.open(run_uri, iteration)
    prefix = stage_prefix(iteration, role.stage)
    if ctx.store.is_committed(prefix):
        _log(rank, f"{role.stage} of iteration {iteration} is committed already: nothing to do")
        return 0
    reason = spec.skip(ctx.config, iteration)
    if reason:
        if rank == 0:
            ctx.store.open_attempt(prefix).commit(info={"skipped": reason})
        return 0
    device = ctx.device
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        strategy = "ddp" if role_lora(ctx, role) is not None else strategy_of(ctx.config)
        _log(rank, f"{role.stage} of iteration {iteration} on {world_size} processes ({strategy}, {backend})")
        if strategy == "ddp":
            _run_replicated(ctx, role, spec, rank, world_size, started)
        else:
            _run(ctx, role, spec, strategy, device, rank, world_size, started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _run(ctx, role, spec, strategy: str, device: str, rank: int, world_size: int, started: float) -> None:
    from kfrl.distributed.parallel import DataParallel, DeepSpeedParallel
    from kfrl.distributed.sharding import (Layout, deepspeed_engine, gather_deepspeed, gather_fsdp2,
                                           import_deepspeed, load_sharded_optimizer, shard_fsdp2)
    from kfrl.engines.minibatch import data_parallel
    from kfrl.stages.update import TRAIN_STEP, make_optimizer

    cfg = ctx.config
    optim_cfg = cfg.actor if role.name == "actor" else cfg.critic
    if strategy == "deepspeed":
        import_deepspeed()  # fail before loading anything when it is missing
    previous = ctx.checkpoint_manifest(role.stage, ctx.iteration - 1)
    model, optimizer, steps, source = _load_trainer_state(ctx, role, optim_cfg, previous, rank, on_host=True)
    layout = Layout.of(model, optimizer)
    full_optimizer_state = optimizer.state_dict()
    del optimizer
    _log(rank, f"loaded the trainer state ({source}, {steps} optimizer steps so far); sharding it")
    if strategy == "deepspeed":
        first = next(iter(full_optimizer_state["state"].values()), {})
        engine, optimizer = deepspeed_engine(
            model.to(device), optim_cfg, full_optimizer_state, first.get("step"),
            zero_stage=cfg.actor.deepspeed_zero_stage, grad_clip=optim_cfg.grad_clip)
        model, plan = engine.module, DeepSpeedParallel(rank, world_size, engine)
    else:
        root = shard_fsdp2(model, device, world_size)
        optimizer = make_optimizer(model, optim_cfg)
        load_sharded_optimizer(model, optimizer, layout, full_optimizer_state)
        plan = DataParallel(rank, world_size, root)
    del full_optimizer_state
    table = ctx.read_groups(*spec.reads)
    with data_parallel(plan):
        metrics, steps = TRAIN_STEP[role.name](ctx, table, model, optimizer, steps)
    _log(rank, f"{role.stage}: update done ({steps} optimizer steps); gathering the full state on rank 0")
    if strategy == "deepspeed":
        model_state, optimizer_state = gather_deepspeed(engine, optimizer, layout)
    else:
        model_state, optimizer_state = gather_fsdp2(model, optimizer, layout)
    if rank == 0:
        _commit(ctx, role, spec, model, steps, metrics, started,
                {"trainer_from": source, "world_size": world_size, "strategy": strategy},
                states=(model_state, optimizer_state))


def _load_trainer_state(ctx, role, optim_cfg, previous, rank: int, *, on_host: bool):
    """Every rank's ``load_trainer_state``. A trainer state lost to a kill is rebuilt (and committed) by
    rank 0 alone; the others read it after. Rank 0 decides for all (a rank looking later could already
    see the state rank 0 committed)."""
    import torch.distributed as dist

    from kfrl.stages.update import load_trainer_state

    decision = [not _state_ready(ctx, role, previous) if rank == 0 else None]
    dist.broadcast_object_list(decision, src=0)
    serial = bool(decision[0])
    if serial and rank != 0:
        dist.barrier()
    loaded = _load_on_host(ctx, role, optim_cfg, previous) if on_host else \
        load_trainer_state(ctx, role, optim_cfg, previous)
    if serial and rank == 0:
        dist.barrier()
    return loaded


def _run_replicated(ctx, role, spec, rank: int, world_size: int, started: float) -> None:
    """A LoRA update: the whole copy on every rank, the adapters' gradients summed (``ReplicatedParallel``);
    rank 0 commits from its own copy, as one process does."""
    from kfrl.distributed.parallel import ReplicatedParallel
    from kfrl.engines.minibatch import data_parallel
    from kfrl.stages.update import TRAIN_STEP

    optim_cfg = ctx.config.actor if role.name == "actor" else ctx.config.critic
    previous = ctx.checkpoint_manifest(role.stage, ctx.iteration - 1)
    model, optimizer, steps, source = _load_trainer_state(ctx, role, optim_cfg, previous, rank, on_host=False)
    _log(rank, f"loaded the trainer state ({source}, {steps} optimizer steps so far) on every rank")
    table = ctx.read_groups(*spec.reads)
    with data_parallel(ReplicatedParallel(rank, world_size)):
        metrics, steps = TRAIN_STEP[role.name](ctx, table, model, optimizer, steps)
    if rank == 0:
        _commit(ctx, role, spec, model, steps, metrics, started,
                {"trainer_from": source, "world_size": world_size, "strategy": "ddp"}, optimizer=optimizer)


def _commit(ctx, role, spec, model, steps: int, metrics: dict, started: float, info: dict, *,
            states: tuple[dict, dict] | None = None, optimizer=None) -> None:
    """Rank 0: the weights commit and the trainer state, as the single-process ``update`` writes them,
    from ``states`` (gathered from shards) or from the whole ``model`` and ``optimizer``."""
    from kfrl.run import INIT_ITERATION, stage_prefix
    from kfrl.stages.update import _TIMING_SUFFIX, _write_state, save_weights

    suffix = _TIMING_SUFFIX[role.name]
    saving = time.perf_counter()
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION))
    attempt = ctx.store.open_attempt(stage_prefix(ctx.iteration, role.stage))
    attempt.info.update(info)
    metrics[f"timing_s/save_checkpoint_files{suffix}"] = save_weights(
        ctx, attempt, model, tokenizer, mlflow_model=role.name == "actor", state=states[0] if states else None)
    attempt.info["optimizer_steps"] = steps
    if role.name == "actor":
        attempt.info["policy_version"] = ctx.iteration
    metrics[f"timing_s/save_checkpoint{suffix}"] = time.perf_counter() - saving
    metrics[f"timing_s/hand_off{suffix}"] = 0.0  # no inference copy lives in a worker
    # As the single-process update without a background writer: the state, then the weights' manifest.
    saving = time.perf_counter()
    _write_state(ctx, role, attempt.attempt, model, optimizer, steps, states=states)
    metrics[f"timing_s/save_trainer_state{suffix}"] = time.perf_counter() - saving
    metrics[f"timing_s/{spec.timing}"] = time.perf_counter() - started
    manifest = attempt.commit(metrics=metrics, info={"iteration": ctx.iteration})
    if manifest.attempt != attempt.attempt:
        _log(0, f"{role.stage} of iteration {ctx.iteration} was committed by another attempt first ({manifest.attempt})")
    else:
        _log(0, f"{role.stage} of iteration {ctx.iteration} committed ({attempt.attempt})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kfrl.stages.update_worker",
                                     description="One process of a distributed update_actor / update_critic.")
    parser.add_argument("--run-uri", required=True)
    parser.add_argument("--iteration", required=True, type=int)
    parser.add_argument("--role", required=True, choices=("actor", "critic"))
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kill_rank = os.environ.get(KILL_RANK_ENV)
    if kill_rank is not None and kill_rank != str(rank):
        os.environ.pop("KFRL_KILL_AT", None)
    from kfrl.faults import failpoint

    failpoint("startup")
    try:
        return run_worker(args.run_uri, args.iteration, args.role, rank, world_size, local_rank)
    except Exception as err:  # the traceback, then one line the launcher shows last
        import traceback

        traceback.print_exc()
        print(f"[kfrl] error: rank {rank}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
