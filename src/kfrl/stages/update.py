"""Stages ``update_actor`` and ``update_critic``: one optimisation step of a role, committed as two
checkpoint kinds.

- **Weights** (``iter-N/update_actor``, ``iter-N/update_critic``): an HF directory in the inference
  dtype (bf16 on CUDA) with the tokenizer. It is the lineage, the MLflow model version's source and
  what a rollout or log-prob stage in another process loads. The stage returns once it is committed.
- **Trainer state** (``iter-N/actor_state``, ``iter-N/critic_state``): fp32 master weights (HF
  layout), ``optimizer.pt`` and ``trainer_state.json``. Only the next update (in a process that does
  not hold the training copy) and a resume read it. In a resident engine or the inline runner it is
  written by a background thread while the next iteration proceeds; the next update waits for it
  before touching the training copy. The last ``trainer.keep_trainer_states`` iterations' states and
  those at every ``trainer.save_freq``-th iteration are kept, older ones deleted.

A state that never got committed (the process was killed while writing it) is rebuilt when an update
needs it: that iteration's update is redone from the state before it and the iteration's committed
batch, and only the state is committed (the weights and everything downstream stand). Data order and
sampling come from seeds derived per stage and iteration, so there is no RNG state or data cursor
to keep beyond the optimizer's step count.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kfrl.faults import failpoint
from kfrl.run import (ACTOR_STATE, CRITIC_STAGE, CRITIC_STATE, INIT_ITERATION, POLICY_STAGE, split_stage_prefix,
                      stage_prefix)
from kfrl.stages.context import StageContext

OPTIMIZER_FILE = "optimizer.pt"
TRAINER_STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class Role:
    name: str                     # actor | critic
    stage: str                    # the stage that commits its weights
    state: str                    # the stage-like prefix its trainer state is committed under
    inference_kinds: tuple        # this process's inference copies the new weights are handed to


ROLES = {
    "actor": Role("actor", POLICY_STAGE, ACTOR_STATE, ("policy", "decoder")),
    "critic": Role("critic", CRITIC_STAGE, CRITIC_STATE, ("critic",)),
}

# The training copy (fp32 model + optimizer) each update leaves in this process, per role, filed
# under the weights commit it produced: the next update reuses it when it starts from exactly that
# commit. One per role, so memory does not grow; a failed update leaves none (it may be half-updated).
_RESIDENT_TRAINERS: dict[str, tuple[str, object, object, int]] = {}
# Trainer-state writes still running, per role (background mode only).
_PENDING: dict[str, "_StateWrite"] = {}
_BACKGROUND = {"enabled": False}


def write_states_in_background(enabled: bool = True) -> None:
    """For a process that outlives its stages (the resident engine, the inline runner): trainer
    state is written by a thread, off the critical path. Call ``drain()`` before the process ends."""
    _BACKGROUND["enabled"] = enabled


def drain() -> None:
    """Wait for every trainer-state write still running (a failure is reported, not raised: the state
    is rebuilt by the update that needs it), and for the weights commits written in the background (a
    failure is raised: that update is not committed)."""
    from kfrl.models.hf_io import PACING_OFF
    from kfrl.store import settle_in_flight

    PACING_OFF.set()  # nothing runs beside them any more: full speed
    try:
        for role in list(_PENDING):
            _PENDING.pop(role).wait()
    finally:
        PACING_OFF.clear()
    _DEFERRED.clear()
    settle_in_flight()


def resident_training_copy(role_name: str):
    """The training copy this process holds for ``role_name`` (None when it holds none)."""
    held = _RESIDENT_TRAINERS.get(role_name)
    return None if held is None else held[1]


def make_optimizer(model, optim_cfg):
    """The role's optimizer over the parameters it trains (a LoRA copy: the adapters only):
    ``optim_cfg.optimizer`` AdamW (torch's, fused on CUDA) or AdamW8bit (``kfrl.engines.optim8bit``)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=optim_cfg.lr, betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay)
    if getattr(optim_cfg, "optimizer", "AdamW") == "AdamW8bit":
        from kfrl.engines.optim8bit import AdamW8bit

        return AdamW8bit(params, **kwargs)
    # The fused CUDA kernel updates all parameters in a few launches instead of several per tensor.
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def master_dtype(optim_cfg):
    """The dtype of a role's trained weights: ``master_dtype`` of its config section."""
    import torch

    return torch.bfloat16 if getattr(optim_cfg, "master_dtype", "float32") == "bfloat16" else torch.float32


def role_lora(ctx: StageContext, role: Role):
    """The role's ``LoraSpec`` (None: it trains every weight)."""
    from kfrl.models.lora import lora_spec

    return lora_spec(ctx.config.model if role.name == "actor" else ctx.config.critic)


def training_state(model) -> dict:
    """What a trainer state keeps of a training copy's weights: the adapter of a LoRA copy, else all."""
    from kfrl.models.lora import adapter_state, is_lora_model

    return adapter_state(model) if is_lora_model(model) else model.state_dict()


def _commit_key(ctx: StageContext, prefix: str, attempt: str) -> str:
    return f"{ctx.store.url(prefix)}#{attempt}"


# --- loading the training copy -------------------------------------------------------------------
def trainer(ctx: StageContext, role: Role, optim_cfg, attempt):
    """(model, optimizer, optimizer steps so far) holding the weights after iteration N-1: the resident
    copy when it is that commit, else the committed trainer state (rebuilt if it is missing). The
    manifest records which (``trainer_from``: memory | store | rebuilt)."""
    previous = ctx.checkpoint_manifest(role.stage, ctx.iteration - 1)
    _wait_for_state(role.name)  # the held copy must not change under a snapshot still reading it
    copying = _WEIGHTS_COPIES.pop(role.name, None)
    if copying is not None:  # nor under the copy of its weights the last update left running
        copying.wait()
    held = _RESIDENT_TRAINERS.pop(role.name, None)
    if held is not None and held[0] == _commit_key(ctx, previous.prefix, previous.attempt):
        attempt.info["trainer_from"] = "memory"
        return held[1], held[2], held[3]
    del held  # a stale copy is freed before the new one is loaded
    model, optimizer, steps, source = load_trainer_state(ctx, role, optim_cfg, previous)
    attempt.info["trainer_from"] = source
    return model, optimizer, steps


def load_trainer_state(ctx: StageContext, role: Role, optim_cfg, weights):
    """(model, optimizer, steps, "store" | "rebuilt") for the committed ``weights`` of ``role``."""
    import torch

    written_at = _iteration_of(weights)
    if written_at == INIT_ITERATION:  # the initial weights: a fresh optimizer
        model = _load_training_model(ctx, role, weights)
        return model, make_optimizer(model, optim_cfg), 0, "store"
    if OPTIMIZER_FILE in weights.names():  # a checkpoint written before weights and state were split
        local = ctx.checkpoint_dir(weights, training_state=True)
        model = _load_training_model(ctx, role, weights)
        optimizer = make_optimizer(model, optim_cfg)
        optimizer.load_state_dict(torch.load(local / OPTIMIZER_FILE, map_location=ctx.device, weights_only=True))
        return model, optimizer, _steps_in(local / TRAINER_STATE_FILE), "store"
    state = ctx.run.manifest(role.state, written_at)
    if state is None or state.info.get("weights_attempt") != weights.attempt:
        model, optimizer, steps = rebuild_trainer_state(ctx, role, optim_cfg, written_at)
        return model, optimizer, steps, "rebuilt"
    local = ctx.checkpoint_dir(state, training_state=True)
    model = _load_training_model(ctx, role, state)
    optimizer = make_optimizer(model, optim_cfg)
    optimizer.load_state_dict(torch.load(local / OPTIMIZER_FILE, map_location=ctx.device, weights_only=True))
    return model, optimizer, _steps_in(local / TRAINER_STATE_FILE), "store"


def _load_training_model(ctx: StageContext, role: Role, manifest):
    """The training copy holding ``manifest``'s weights: all of them in the role's master dtype, or with
    LoRA the frozen base (the run's initial commit, in the compute dtype) with the manifest's adapter."""
    section = ctx.config.actor if role.name == "actor" else ctx.config.critic
    load = ctx.load_model if role.name == "actor" else ctx.load_critic
    spec = role_lora(ctx, role)
    if spec is None:
        model = load(manifest, for_training=True, dtype=master_dtype(section))
        if role.name == "actor" and master_dtype(section) == ctx.compute_dtype:
            share_with_decoder(model)
    else:
        from kfrl.models.lora import add_adapters, load_adapter_state, read_adapter

        base = load(ctx.checkpoint_manifest(role.stage, INIT_ITERATION), for_training=True, dtype=ctx.compute_dtype)
        model = add_adapters(base.requires_grad_(False), spec, seed=ctx.config.trainer.seed,
                             value_head=role.name == "critic")
        if master_dtype(section) != model_dtype(model):
            for param in model.parameters():
                if param.requires_grad:
                    param.data = param.data.to(master_dtype(section))
        if manifest.info.get("adapter"):
            adapter, _scaling = read_adapter(ctx.checkpoint_dir(manifest, training_state=True), device=ctx.device)
            load_adapter_state(model, adapter)
    if section.gradient_checkpointing:
        enable_gradient_checkpointing(model, str(ctx.device).split(":")[0])
    if role.name == "actor" and ctx.config.actor.use_liger:
        apply_liger_kernels(model, ctx.device)
    if role.name == "actor" and ctx.config.actor.use_torch_compile and next(model.parameters()).is_cuda:
        compile_layers(model)
    return model


def share_with_decoder(model) -> int:
    """Lay the weights the torch rollout decoder fuses (each layer's q/k/v, gate/up) back to back in
    memory, so the decoder built over this training copy after each update views them instead of
    copying them: 1.6 GiB less at Qwen2.5-1.5B in bf16, 8.5 GB at 7B. Only where the training copy is
    in the decoder's dtype, right after loading (before its optimizer, liger's patches or compiled
    blocks exist); other model families have no such names and are left as they are. Returns the
    groups moved."""
    from kfrl.engines.decoder import lay_back_to_back

    layers = getattr(model.config, "num_hidden_layers", None)
    if not layers:
        return 0
    return lay_back_to_back(dict(model.named_parameters()), layers, trained=True)


def apply_liger_kernels(model, device) -> None:
    """liger-kernel's fused RMSNorm, rotary and SwiGLU (Triton, forward and backward) in ``model`` (a
    training copy, LoRA or not), as veRL's ``model.use_liger`` does; not its LM-head losses, which kfrl's
    fused LM head replaces. Liger patches the model family's transformers module for the whole process
    (rotary is a module-level function there), so models of that family loaded later in the process
    (the log-prob copies) run its kernels too."""
    from kfrl.models.lora import base_model_of

    if torch_device_type(device) != "cuda":
        raise ValueError(f"actor.use_liger needs a CUDA device (liger-kernel's kernels are Triton GPU kernels); "
                         f"this update runs on {device}: set actor.use_liger=false")
    try:
        from liger_kernel.transformers.monkey_patch import (MODEL_TYPE_TO_APPLY_LIGER_FN,
                                                            _apply_liger_kernel_to_instance)
    except ImportError as err:
        raise ValueError("actor.use_liger needs the liger-kernel package: pip install liger-kernel "
                         "(or kfrl[gpu]), or set actor.use_liger=false") from err
    hf_model = base_model_of(model)
    model_type = getattr(hf_model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"actor.use_liger: liger-kernel has no kernels for model_type {model_type!r} "
                         f"(it has {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); set actor.use_liger=false")
    _apply_liger_kernel_to_instance(model=hf_model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)


def torch_device_type(device) -> str:
    return str(device).split(":")[0]


def enable_gradient_checkpointing(model, device_type: str) -> None:
    """Recompute each transformer block in the backward pass instead of keeping its activations
    (transformers' non-reentrant checkpointing: gradients reach LoRA adapters behind frozen embeddings).

    The recompute runs under the same attention-kernel choice as the forward: the backward happens
    outside ``attention_kernels``, and a block recomputed with another SDPA kernel (cuDNN's) saves
    tensors of other shapes, which torch's checkpoint refuses (CheckpointError)."""
    import functools
    import inspect

    from kfrl.engines.inference import attention_kernels

    hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(hf_model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(hf_model).__name__} does not support gradient checkpointing; "
                         "set actor/critic.gradient_checkpointing=false")
    kwargs = {"use_reentrant": False,
              "context_fn": functools.partial(_recompute_contexts, attention_kernels, device_type)}
    enable = getattr(hf_model, "activation_checkpointing_enable", None)  # the newer transformers' name
    if enable is not None and "activation_checkpointing_kwargs" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    hf_model.config.use_cache = False


def _recompute_contexts(attention_kernels, device_type: str):
    """torch checkpoint's context_fn: (the forward's context, the recompute's context)."""
    import contextlib

    return contextlib.nullcontext(), attention_kernels(device_type)


def model_dtype(model):
    """The dtype of the parameters a training copy trains."""
    return next(p for p in model.parameters() if p.requires_grad).dtype


def compile_layers(model, backend: str = "inductor") -> int:
    """Compile each transformer block of ``model`` in place with ``torch.compile`` (names and the state
    dict are unchanged): Inductor fuses the blocks' elementwise work (RMSNorm, rotary, SwiGLU, residual
    adds), forward and backward, which bounds a small model's update. The blocks share one compiled
    graph. Returns the number of blocks compiled. (``backend``: tests trace with ``aot_eager``, which
    checks the graphs' autograd without generating code.)"""
    layers = getattr(model.get_decoder(), "layers", [])
    for layer in layers:
        layer.compile(dynamic=None, backend=backend)
    return len(layers)


def rebuild_trainer_state(ctx: StageContext, role: Role, optim_cfg, iteration: int):
    """Redo the update of ``iteration`` from the trainer state before it and that iteration's committed
    inputs, commit only its trainer state, and return (model, optimizer, steps)."""
    from kfrl.stages import SPECS

    print(f"[kfrl] the trainer state after iteration {iteration} ({role.state}) is not in the store (not written: "
          f"trainer.trainer_state_freq, or the process stopped while writing it): redoing that {role.stage} from "
          f"the state before it", file=sys.stderr, flush=True)
    past = StageContext(run_uri=ctx.run_uri, iteration=iteration, run=ctx.run, config=ctx.config)
    previous = past.checkpoint_manifest(role.stage, iteration - 1)
    model, optimizer, steps, _ = load_trainer_state(past, role, optim_cfg, previous)
    table = past.read_groups(*SPECS[role.stage].reads)
    _metrics, steps = TRAIN_STEP[role.name](past, table, model, optimizer, steps)
    weights = past.checkpoint_manifest(role.stage, iteration)
    _write_state(past, role, weights.attempt, model, optimizer, steps)
    return model, optimizer, steps


# --- one update ----------------------------------------------------------------------------------
def _actor_step(ctx: StageContext, table, model, optimizer, steps: int) -> tuple[dict, int]:
    from kfrl.engines.actor import update_actor as run_update
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION))
    # Without old log-probs (the on-policy shortcut) the update uses its own; the reference only for a KL loss.
    fields = ("advantages", "old_logprobs") + (("ref_logprobs",) if cfg.actor.use_kl_loss else ())
    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0, fields=fields)
    metrics = run_update(model, optimizer, trajectories, cfg.actor, mini_batch_size=cfg.mini_batch_trajectories,
                         temperature=cfg.rollout.temperature, autocast_dtype=ctx.compute_dtype,
                         seed=ctx.seed("update_actor"), sample_ids=table.column("sample_id").to_pylist(),
                         # compiled blocks would recompile for every new packed shape: rows as they are
                         share_prompts=cfg.model.share_prompt_forward and not cfg.actor.use_torch_compile)
    return metrics, steps + cfg.n_mini_batches * cfg.actor.ppo_epochs


def _critic_step(ctx: StageContext, table, model, optimizer, steps: int) -> tuple[dict, int]:
    from kfrl.engines.critic import update_critic as run_update
    from kfrl.trajectory import Trajectories

    cfg = ctx.config
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION))
    trajectories = Trajectories.from_table(table, pad_id=tokenizer.pad_token_id or 0, fields=("values", "returns"))
    metrics = run_update(model, optimizer, trajectories, mini_batch_size=cfg.critic_mini_batch_size * cfg.rollout.n,
                         micro_batch_size=cfg.critic.ppo_micro_batch_size_per_gpu, epochs=cfg.critic_ppo_epochs,
                         shuffle=cfg.critic_shuffle, grad_clip=cfg.critic.grad_clip,
                         cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic_loss_agg_mode,
                         autocast_dtype=ctx.compute_dtype,
                         seed=ctx.seed("update_critic"), sample_ids=table.column("sample_id").to_pylist())
    return metrics, steps + (cfg.data.train_batch_size // cfg.critic_mini_batch_size) * cfg.critic_ppo_epochs


TRAIN_STEP = {"actor": _actor_step, "critic": _critic_step}
_TIMING_SUFFIX = {"actor": "", "critic": "_critic"}


def update(ctx: StageContext, role: Role, optim_cfg, table, attempt) -> dict[str, float]:
    """Load (or reuse) the training copy, step it, commit the weights, hand them to this process's
    inference copies, and write the trainer state (in the background where the process lives on)."""
    from kfrl.distributed import world_size

    if world_size(ctx.config) > 1:  # sharded over worker processes: they commit; run_stage's commit finds theirs
        return distributed_update(ctx, role)
    released = ctx.release_inference_copies(role.inference_kinds, attempt.prefix)
    model, optimizer, steps = trainer(ctx, role, optim_cfg, attempt)
    from kfrl.engines.offload import move_training_copy, offloads

    suffix = _TIMING_SUFFIX[role.name]
    param_offload, optimizer_offload = offloads(optim_cfg) if ctx.device == "cuda" else (False, False)
    if param_offload or optimizer_offload:  # back from host memory, where the previous update left it
        onload = move_training_copy(model, optimizer, ctx.device, params=param_offload,
                                    optimizer_state=optimizer_offload)
    metrics, steps = TRAIN_STEP[role.name](ctx, table, model, optimizer, steps)
    if param_offload or optimizer_offload:
        metrics[f"timing_s/onload{suffix}"] = onload
    started = time.perf_counter()
    tokenizer = ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION))
    if _BACKGROUND["enabled"]:  # a host snapshot now; the files and the commit on a thread
        parts = save_weights_later(ctx, attempt, model, tokenizer, mlflow_model=role.name == "actor",
                                   role_name=role.name)
        metrics.update({f"timing_s/save_checkpoint_{part}{suffix}": seconds for part, seconds in parts.items()})
        from kfrl.models.host_memory import host_buffers

        metrics[f"perf/weights_host_sets{suffix}"] = float(host_buffers(weights_buffers_name(role.name)).sets)
    else:
        metrics[f"timing_s/save_checkpoint_files{suffix}"] = save_weights(ctx, attempt, model, tokenizer,
                                                                          mlflow_model=role.name == "actor")
    attempt.info["optimizer_steps"] = steps
    if role_lora(ctx, role) is not None:
        attempt.info["adapter"] = True  # the commit holds the adapter; its base is iteration 0's commit
    if role.name == "actor":
        attempt.info["policy_version"] = ctx.iteration
    metrics[f"timing_s/save_checkpoint{suffix}"] = time.perf_counter() - started
    started = time.perf_counter()
    ctx.hand_off(role.inference_kinds, attempt.prefix, attempt.attempt, model, released)
    metrics[f"timing_s/hand_off{suffix}"] = time.perf_counter() - started
    if param_offload or optimizer_offload:  # the GPU is left to the stages until the next update
        metrics[f"timing_s/offload{suffix}"] = move_training_copy(model, optimizer, "cpu", params=param_offload,
                                                                  optimizer_state=optimizer_offload)
    _RESIDENT_TRAINERS[role.name] = (_commit_key(ctx, attempt.prefix, attempt.attempt), model, optimizer, steps)
    started = time.perf_counter()
    if not _BACKGROUND["enabled"]:
        _write_state(ctx, role, attempt.attempt, model, optimizer, steps)
    elif state_due(ctx.config.trainer, ctx.iteration) or role.name in _DEFERRED:
        if defer_state_write(ctx.config.trainer, role.name, ctx.iteration):
            metrics[f"perf/trainer_state_deferred{suffix}"] = 1.0
        else:
            _PENDING[role.name] = _StateWrite(ctx, role, attempt.attempt, model, optimizer, steps,
                                              previous=_PENDING.get(role.name)).start()
    else:
        reserve_state_buffers(role, model, optimizer)
    metrics[f"timing_s/save_trainer_state{suffix}"] = time.perf_counter() - started
    return metrics


def distributed_update(ctx: StageContext, role: Role) -> dict[str, float]:
    """``role``'s update over ``trainer.n_gpus_per_node`` × ``trainer.nnodes`` worker processes
    (``kfrl.stages.update_worker``): local ones on one node, a cluster job beyond; returns the metrics
    of the manifest rank 0 committed (the stage's own commit then finds it)."""
    from kfrl.distributed import DistributedUpdateError, world_size

    if ctx.config.trainer.nnodes > 1:
        from kfrl.distributed.multinode import run_multinode_update

        run_multinode_update(ctx, role.name)
    else:
        from kfrl.distributed.launch import run_distributed_update

        run_distributed_update(ctx, role.name, role.stage, world_size(ctx.config))
    manifest = ctx.store.manifest(stage_prefix(ctx.iteration, role.stage))
    if manifest is None:
        raise DistributedUpdateError(f"the distributed {role.stage} of iteration {ctx.iteration} ended without "
                                     f"committing {ctx.store.url(stage_prefix(ctx.iteration, role.stage))}")
    return dict(manifest.metrics)


def update_actor(ctx: StageContext, table, attempt) -> tuple[None, dict[str, float]]:
    return None, update(ctx, ROLES["actor"], ctx.config.actor, table, attempt)


def update_critic(ctx: StageContext, table, attempt) -> tuple[None, dict[str, float]]:
    return None, update(ctx, ROLES["critic"], ctx.config.critic, table, attempt)


# --- writing the two kinds -----------------------------------------------------------------------
def weights_writer(ctx: StageContext, model, tokenizer, *, mlflow_model: bool = False, state: dict | None = None,
                   copy_beside: bool = False, buffers_name: str | None = None, paced: bool = False):
    """(config files, ``write(folder)``, the host copy or None): the weights commit's files, the HF
    directory in the inference dtype (of ``state`` when given, e.g. gathered from shards) plus the
    tokenizer, and for the policy an ``MLmodel`` file (the folder is what MLflow model versions point
    at). ``copy_beside``: the weights are copied to host memory now, beside the stages that follow
    (``on_host_later``: the returned ``HostCopy``, which ``write`` waits for), so ``write`` may run after
    the model has moved on, once the copy is done; with ``buffers_name`` into that ``HostBuffers``
    pool's tensors, which ``write`` gives back once the files are written. ``paced``: the weights files
    go through ``PacedWriter`` (written beside running stages)."""
    from kfrl.models.hf_io import config_files, host_weights, write_hf_dir
    from kfrl.models.host_memory import HostCopy, host_buffers
    from kfrl.models.lora import is_lora_model

    dtype = ctx.compute_dtype
    if is_lora_model(model):
        configs, write = _adapter_writer(ctx, model, tokenizer, registered=mlflow_model and state_required(
            ctx.config.trainer, ctx.iteration), paced=paced)
        return configs, write, None
    # Three sets at most: one being written, one being filled, one spare built ahead for a slow disk.
    pool = host_buffers(buffers_name, spare_up_to=3) if buffers_name else None
    buffers = pool.take() if pool is not None else None
    configs = config_files(model, dtype)
    copying = host_weights(model, dtype, state, buffers=buffers, later=True) if copy_beside else \
        HostCopy(host_weights(model, dtype, state, buffers=buffers))

    def write(folder) -> None:
        try:
            write_hf_dir(folder, configs, copying.result(), tokenizer, paced=paced)
        finally:
            if pool is not None:
                pool.give_back(buffers)
        if mlflow_model:
            from kfrl.models.mlmodel import write_mlmodel

            write_mlmodel(folder, tokenizer, dtype)

    return configs, write, copying if copy_beside else None


def _adapter_writer(ctx: StageContext, model, tokenizer, *, registered: bool, paced: bool = False):
    """``weights_writer`` of a LoRA training copy: the adapter in PEFT's format (copied to host memory now)
    with the base's config and the tokenizer; when the iteration registers a model version, also the
    merged model as an MLflow model in ``merged/`` (what MLflow serves and ``kfrl export`` copies)."""
    from kfrl.models.hf_io import config_files, unique_state, write_hf_dir
    from kfrl.models.host_memory import on_host
    from kfrl.models.lora import (ADAPTER_CONFIG, MERGED_FOLDER, adapter_config_bytes, adapter_state, base_model_of,
                                  merged_state_on_host, write_adapter)

    dtype = ctx.compute_dtype
    base_configs = config_files(base_model_of(model), dtype)
    configs = {**base_configs, ADAPTER_CONFIG: adapter_config_bytes(model, base_path=ctx.config.model.path)}
    adapter = on_host(adapter_state(model))
    merged = unique_state(merged_state_on_host(model, dtype)) if registered else None

    def write(folder) -> None:
        write_hf_dir(folder, {k: v for k, v in configs.items() if k != ADAPTER_CONFIG}, None, tokenizer)
        write_adapter(folder, configs[ADAPTER_CONFIG], adapter)
        if merged is not None:
            from kfrl.models.mlmodel import write_mlmodel

            write_hf_dir(Path(folder) / MERGED_FOLDER, base_configs, merged, tokenizer, paced=paced)
            write_mlmodel(Path(folder) / MERGED_FOLDER, tokenizer, dtype)

    return configs, write


def save_weights(ctx: StageContext, attempt, model, tokenizer, *, mlflow_model: bool = False,
                 state: dict | None = None) -> float:
    """Write the weights commit's files (``weights_writer``) into ``attempt``. Returns the seconds spent
    writing them (the rest of the call is hashing, or the upload to S3)."""
    _configs, write, _ = weights_writer(ctx, model, tokenizer, mlflow_model=mlflow_model, state=state)
    with attempt.staged_dir() as folder:
        started = time.perf_counter()
        write(folder)
        written = time.perf_counter() - started
    return written


def weights_buffers_name(role_name: str) -> str:
    """The host-buffer pool (``kfrl.models.host_memory.host_buffers``) of a role's weights snapshots."""
    return f"weights/{role_name}"


def save_weights_later(ctx: StageContext, attempt, model, tokenizer, *, mlflow_model: bool = False,
                       role_name: str = "actor") -> dict[str, float]:
    """``save_weights`` for a process that lives on (the resident engine, the inline runner): the weights
    are copied to host memory beside the stages that follow (into this process's reused host buffers;
    the next update of ``role_name`` waits for the copy before it changes them, ``trainer``), and the
    files and the stage's commit are written by a thread (``Attempt.write_in_background``) once the
    copy is done. This process sees the commit at once; its next commit with files (the next rollout)
    waits for it, so what is durable stays in order. The files are paced (``PacedWriter``) but at the
    run's last iteration: buffered, a GB-sized write made each small commit of the stages beside it (a
    manifest's fsync) wait 0.1-0.4 s for the journal. Returns the seconds of its two parts on the
    critical path: queueing the host copy and the early files."""
    from kfrl.models.hf_io import write_hf_dir

    started = time.perf_counter()
    configs, write, copying = weights_writer(ctx, model, tokenizer, mlflow_model=mlflow_model, copy_beside=True,
                                             buffers_name=weights_buffers_name(role_name),
                                             paced=ctx.iteration != ctx.config.trainer.total_iterations)
    if copying is not None:
        _WEIGHTS_COPIES[role_name] = copying
    copied = time.perf_counter()
    # Config and tokenizer now, in a local folder: the next rollout reads them without waiting.
    folder = _early_folder(attempt.attempt)
    early = write_hf_dir(folder, configs, None, tokenizer, link_tokenizer_from=folder.parent.with_name("tokenizers"))
    attempt.write_in_background(write, early_dir=early)
    return {"host_copy": copied - started, "early_files": time.perf_counter() - copied}


# Host copies of a resident training copy's weights still running beside the stages after its update
# (``save_weights_later``), by role: the role's next update waits for its copy before it changes them.
_WEIGHTS_COPIES: dict = {}


def _early_folder(attempt_id: str) -> Path:
    """A folder of this machine's cache for a background commit's early files; the two newest are kept
    (a reader may hold the previous one while the next update writes)."""
    import shutil

    from kfrl.models import cache_dir

    root = cache_dir() / "in-flight" / str(os.getpid())
    root.mkdir(parents=True, exist_ok=True)
    for old in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return root / attempt_id


def reserve_state_buffers(role: Role, model, optimizer) -> bool:
    """Build the host buffers of this role's trainer-state snapshots on a thread, now, while iterations
    run, rather than when the first snapshot is due (12 bytes per parameter: 6 GB at 0.5B, whose
    page-locking stalled the stages beside it by seconds). Once per process and role."""
    from kfrl.models.host_memory import host_buffers, snapshot_layout

    pool = host_buffers(f"trainer_state/{role.name}")
    return not pool.sets and pool.reserve(snapshot_layout((training_state(model), optimizer.state_dict())))


def snapshot(model, optimizer, buffers: list | None = None) -> tuple[dict, dict]:
    """(model state, optimizer state) copied off the accelerator (into ``buffers``, a ``HostBuffers``
    set, when given): what a trainer-state write needs, so the training copy may change while the files
    are written. Tied tensors stay one tensor."""
    from kfrl.models.host_memory import on_host

    return on_host((training_state(model), optimizer.state_dict()), buffers=buffers)


def _write_state(ctx: StageContext, role: Role, weights_attempt: str, model, optimizer, steps: int,
                 states: tuple[dict, dict] | None = None, *, paced: bool = False) -> None:
    """Commit the trainer state of this iteration's update (from ``states``, a ``snapshot``, when given),
    then apply retention. ``paced``: written beside running stages, through ``PacedWriter``."""
    from kfrl.models.hf_io import save_hf, torch_save
    from kfrl.models.lora import adapter_config_bytes, is_lora_model, write_adapter
    from kfrl.store import wait_for_in_flight

    model_state, optimizer_state = states or (training_state(model), optimizer.state_dict())
    lora = is_lora_model(model)
    # A trainer state is worth nothing without the weights commit it continues (written on its own
    # thread): a kill during this write then always finds that commit durable, and a resume rebuilds
    # the state from it rather than redoing the update as well.
    wait_for_in_flight()
    state = ctx.store.open_attempt(stage_prefix(ctx.iteration, role.state))
    with state.staged_dir() as folder:
        if lora:  # the adapter only: the base is the run's initial commit
            write_adapter(folder, adapter_config_bytes(model, base_path=ctx.config.model.path), model_state)
        else:
            save_hf(model, None, folder, state=model_state, paced=paced)
        torch_save(optimizer_state, folder / OPTIMIZER_FILE, paced=paced)
        (folder / TRAINER_STATE_FILE).write_text(json.dumps({"iteration": ctx.iteration, "optimizer_steps": steps}))
        failpoint("trainer_state")
    state.commit(info={"iteration": ctx.iteration, "weights_attempt": weights_attempt, "optimizer_steps": steps,
                       **({"adapter": True} if lora else {})})
    apply_retention(ctx, role)


def state_due(trainer_cfg, iteration: int) -> bool:
    """Whether a process that keeps its training copy writes the trainer state after ``iteration``:
    every ``trainer_state_freq``-th, the last, and every ``save_freq``-th."""
    return iteration % trainer_cfg.trainer_state_freq == 0 or state_required(trainer_cfg, iteration)


def state_required(trainer_cfg, iteration: int) -> bool:
    """The states never deferred: the last iteration's and every ``save_freq``-th."""
    save = trainer_cfg.save_freq
    return iteration == trainer_cfg.total_iterations or (save > 0 and iteration % save == 0)


# Roles whose due trainer-state write was put off (the iteration it was first due): the previous write
# was still running. Writing it anyway would make the snapshot, and with it the next update, wait for
# the disk; a state not written is rebuilt exactly if ever needed (see ``rebuild_trainer_state``).
_DEFERRED: dict[str, int] = {}


def defer_state_write(trainer_cfg, role_name: str, iteration: int) -> bool:
    """Whether the trainer-state write due after ``iteration`` waits for a later iteration: only while the
    role's previous write is still running, for at most ``trainer_state_freq`` iterations (so states
    stay at most twice that apart), and never for a required state (``state_required``)."""
    pending = _PENDING.get(role_name)
    first = _DEFERRED.get(role_name, iteration)
    if (pending is not None and pending.thread.is_alive() and not state_required(trainer_cfg, iteration)
            and iteration - first < trainer_cfg.trainer_state_freq):
        _DEFERRED[role_name] = first
        return True
    _DEFERRED.pop(role_name, None)
    return False


def apply_retention(ctx: StageContext, role: Role) -> list[int]:
    """Delete trainer states that fell out of the window: all but the newest ``keep_trainer_states``
    written ones (written every ``trainer_state_freq`` iterations), except those at a ``save_freq``
    multiple. Returns the iterations deleted."""
    trainer_cfg = ctx.config.trainer
    keep, save, every = trainer_cfg.keep_trainer_states, trainer_cfg.save_freq, trainer_cfg.trainer_state_freq
    if keep <= 0:
        return []
    # The iterations that can hold a state of the window or one that just left it (one further back
    # mops up after a process killed mid-delete); a deferred write (defer_state_write) puts states up
    # to twice trainer_state_freq apart.
    lowest = max(INIT_ITERATION, ctx.iteration - (keep + 1) * 2 * every - 1)
    written = [i for i in range(ctx.iteration, lowest, -1) if ctx.store.is_committed(stage_prefix(i, role.state))]
    deleted = []
    for iteration in written[keep:]:
        if save > 0 and iteration % save == 0:
            continue
        ctx.store.remove_commit(stage_prefix(iteration, role.state))
        deleted.append(iteration)
    return deleted


class _StateWrite:
    """A trainer-state write on a thread, in two steps: a snapshot of the training copy into host memory
    (on CUDA on its own stream, after the update's last kernel, so the next stages' kernels are not
    queued behind it), then the files. The next update waits for the snapshot only; the files are
    written while it runs. A write waits for the one before it of the same role (writes never pile up)."""

    def __init__(self, ctx, role, weights_attempt, model, optimizer, steps, previous: "_StateWrite | None"):
        self.args = (ctx, role, weights_attempt, model, optimizer, steps)
        self.previous = previous
        self.error: BaseException | None = None
        self.snapshotted = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"kfrl-{role.state}", daemon=True)
        self.ready = None

    def start(self) -> "_StateWrite":
        import torch

        if self.args[0].device == "cuda":  # the optimizer state may be there while offloaded weights are not
            self.ready = torch.cuda.Event()
            self.ready.record()
        self.thread.start()
        return self

    def _run(self) -> None:
        import contextlib

        import torch

        from kfrl.models.host_memory import copy_stream, host_buffers

        ctx, role, weights_attempt, model, optimizer, steps = self.args
        pool = host_buffers(f"trainer_state/{role.name}")
        buffers = pool.take()
        try:
            if self.previous is not None:
                self.previous.thread.join()
                self.previous = None
            stream = None
            if self.ready is not None:
                stream = copy_stream(torch.cuda.current_device())
                stream.wait_event(self.ready)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                states = snapshot(model, optimizer, buffers)
                if stream is not None:
                    stream.synchronize()
            self.snapshotted.set()
            # Paced while stages run beside it; the last iteration's is written at full speed (nothing
            # runs beside it, and the run ends when it is durable).
            _write_state(ctx, role, weights_attempt, model, optimizer, steps, states=states,
                         paced=ctx.iteration != ctx.config.trainer.total_iterations)
        except BaseException as err:  # noqa: BLE001 - reported by wait/drain; a resume rebuilds the state
            self.error = err
        finally:
            pool.give_back(buffers)
            self.snapshotted.set()

    def wait_for_snapshot(self) -> None:
        self.snapshotted.wait()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            ctx, role = self.args[:2]
            print(f"[kfrl] writing the trainer state of iteration {ctx.iteration} ({role.state}) in the background "
                  f"failed ({type(self.error).__name__}: {self.error}); an update that needs it will redo "
                  f"iteration {ctx.iteration}'s update to rebuild it", file=sys.stderr, flush=True)


def _wait_for_state(role_name: str) -> None:
    """Until the pending write of ``role_name`` no longer reads the training copy."""
    pending = _PENDING.get(role_name)
    if pending is not None:
        pending.wait_for_snapshot()


def _iteration_of(manifest) -> int:
    """The iteration a checkpoint commit belongs to (``iter-000003/update_actor`` → 3)."""
    return split_stage_prefix(manifest.prefix)[0]


def _steps_in(path: Path) -> int:
    return int(json.loads(path.read_text()).get("optimizer_steps", 0)) if path.is_file() else 0
