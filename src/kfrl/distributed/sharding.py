"""Sharding a training copy over the processes of an update, and gathering it back whole.

- ``fsdp2`` (``actor.strategy`` fsdp2 or fsdp): torch's ``fully_shard`` on every decoder layer, then on
  the root. Parameters stay fp32 (the forward pass autocasts, as in one process); gradients are
  reduce-scattered as a SUM (``set_gradient_divide_factor(1.0)`` with sum-only collectives: gloo has no
  pre-multiplied sum), so N processes accumulate one process's gradient. Works on CPU with gloo and on
  CUDA with NCCL.
- ``deepspeed``: a DeepSpeed engine with ZeRO stage ``actor.deepspeed_zero_stage`` (2 or 3) around the
  same model and a torch AdamW; its full optimizer state is read and written per parameter through
  DeepSpeed's ``safe_get/set_full_*`` helpers. Imported only when asked for.

Either way the trainer state is loaded from, and gathered into, the single-process layout: an HF state
dict of fp32 tensors and a torch AdamW ``state_dict()`` keyed by parameter index, so one process can
resume what N processes wrote and the other way round.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kfrl.distributed import DistributedUpdateError


def decoder_layers(model) -> list:
    """The decoder layers of an HF causal LM or value model (``model.model.layers`` for Qwen2/Llama)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None) or getattr(getattr(base, "model", None), "layers", None)
    return list(layers) if layers is not None else []


@dataclass
class Layout:
    """What the single-process layout needs, taken from the plain model before it is sharded."""
    names: list[str]                                   # parameter names in optimizer order
    keys: list[str]                                    # state-dict keys, in order
    aliases: dict[str, str] = field(default_factory=dict)  # tied key -> the key it shares storage with
    param_groups: list = field(default_factory=list)   # the AdamW param groups (hyper-parameters)

    @classmethod
    def of(cls, model, optimizer) -> "Layout":
        from kfrl.models.host_memory import tensor_identity

        first: dict[tuple, str] = {}
        aliases = {}
        state = model.state_dict()
        for key, tensor in state.items():
            identity = tensor_identity(tensor)
            if identity in first:
                aliases[key] = first[identity]
            else:
                first[identity] = key
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.state_dict()["param_groups"]]
        return cls([name for name, _ in model.named_parameters()], list(state), aliases, groups)

    def by_name(self, optimizer_state: dict) -> dict:
        """An index-keyed AdamW state dict → keyed by parameter name (torch.distributed.checkpoint's form)."""
        return {"state": {self.names[i]: value for i, value in optimizer_state["state"].items()},
                "param_groups": [{**group, "params": [self.names[i] for i in group["params"]]}
                                 for group in optimizer_state["param_groups"]]}

    def by_index(self, optimizer_state: dict) -> dict:
        """A name-keyed optimizer state dict → the index-keyed one ``torch.optim.AdamW.load_state_dict`` reads."""
        index = {name: i for i, name in enumerate(self.names)}

        def group_of(n: int, group: dict) -> dict:
            # Hyper-parameters as the optimizer holds them (the gathered copy turns tuples into lists).
            known = self.param_groups[n] if n < len(self.param_groups) else {}
            return {key: tuple(value) if isinstance(known.get(key), tuple) and isinstance(value, list) else value
                    for key, value in group.items()} | {"params": [index[name] for name in group["params"]]}

        return {"state": {index[name]: value for name, value in optimizer_state["state"].items()},
                "param_groups": [group_of(n, group) for n, group in enumerate(optimizer_state["param_groups"])]}

    def relink(self, model_state: dict) -> dict:
        """Tied tensors as one tensor again (the embedding is the LM head), as ``model.state_dict()`` has them,
        so the files written are the single-process files."""
        ordered = {key: model_state[key] for key in self.keys if key in model_state}
        for key, target in self.aliases.items():
            if target in ordered:
                ordered[key] = ordered[target]
        return ordered


# --- FSDP2 ---------------------------------------------------------------------------------------
@functools.cache
def sharded_root_class():
    """The FSDP root module's class (built on first use: importing this module imports no torch)."""
    import torch

    class ShardedRoot(torch.nn.Module):
        """The FSDP root around an HF model. The engines call the model's parts (``get_decoder()``, then
        the LM head on the response positions only), never ``model.forward``, so the root's parameters
        (the embedding, tied to the LM head, the final norm, a value head) are gathered, and their
        gradients reduced, by running the whole micro-step inside this module's forward:
        ``root(micro_step, rows)``."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, function, *args):
            return function(*args)

    return ShardedRoot


def shard_fsdp2(model, device_type: str, world_size: int):
    """``fully_shard`` per decoder layer, then a root around the whole model; gradients summed over the
    ranks. In place (``model`` keeps its class and parameter names); returns the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device_type, (world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    root = fully_shard(sharded_root_class()(model), mesh=mesh)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return root


def load_sharded_optimizer(model, optimizer, layout: Layout, full_state: dict) -> None:
    """Each rank holds the full (index-keyed) state; keep this rank's shard of it. A fresh optimizer (no
    state yet) is left as it is: torch.distributed.checkpoint would initialise its state with a step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not full_state.get("state"):
        return
    set_optimizer_state_dict(model, optimizer, optim_state_dict=layout.by_name(full_state),
                             options=StateDictOptions(full_state_dict=True))


def gather_fsdp2(model, optimizer, layout: Layout) -> tuple[dict, dict] | tuple[None, None]:
    """(model state, index-keyed optimizer state), whole and on the host, on rank 0; (None, None) on the
    others. A collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    if dist.get_rank() != 0:
        return None, None
    return layout.relink(model_state), layout.by_index(optimizer_state)


# --- DeepSpeed -----------------------------------------------------------------------------------
def import_deepspeed():
    try:
        import deepspeed
    except ImportError as err:
        raise DistributedUpdateError(
            f"actor.strategy=deepspeed needs DeepSpeed, which is not installed ({err}): pip install kfrl[gpu], "
            "or use actor.strategy=fsdp2") from None
    return deepspeed


def deepspeed_engine(model, optim_cfg, full_state: dict, step, *, zero_stage: int, grad_clip: float):
    """(engine, its optimizer) for ``model`` under ZeRO ``zero_stage``, its AdamW state set from
    ``full_state`` (index-keyed, as one process writes it; ``step``: its step count, None when fresh).
    ZeRO creates its optimizer state with one step on zero gradients, which counts a step and applies
    AdamW's weight decay once: the fp32 weights and the step count are set again afterwards."""
    import torch

    deepspeed = import_deepspeed()
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    weights = {name: param.detach().to("cpu", copy=True) for name, param in model.named_parameters()}

    optimizer = torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                  weight_decay=optim_cfg.weight_decay)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": grad_clip, "zero_optimization": {"stage": zero_stage},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": False}, "fp16": {"enabled": False}}
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    named = list(engine.module.named_parameters())
    for name, param in named:
        safe_set_full_fp32_param(param, weights.pop(name).to(param.device))
    for index, state in full_state.get("state", {}).items():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                safe_set_full_optimizer_state(named[index][1], state[key].to(named[index][1].device), key)
    inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
    for group in inner.param_groups:
        for param in group["params"]:
            if param in inner.state and "step" in inner.state[param]:
                held = inner.state[param]["step"]
                value = float(step or 0)
                inner.state[param]["step"] = torch.as_tensor(value, dtype=held.dtype, device=held.device) \
                    if isinstance(held, torch.Tensor) else type(held)(value)
    return engine, ds_optimizer


def gather_deepspeed(engine, ds_optimizer, layout: Layout) -> tuple[dict, dict] | tuple[None, None]:
    """As ``gather_fsdp2`` for a DeepSpeed engine (every rank calls it: ZeRO-3 gathers per parameter)."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = engine.module
    rank0 = dist.get_rank() == 0
    params = dict(model.named_parameters())
    model_state: dict = {}
    optimizer_state: dict = {}
    inner = getattr(ds_optimizer, "optimizer", ds_optimizer)
    step = next((state["step"] for state in inner.state.values() if "step" in state), None)
    for index, name in enumerate(layout.names):
        param = params[name]
        full = safe_get_full_fp32_param(param)
        moments = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        if rank0:
            model_state[name] = full.detach().to("cpu")
            if all(value is not None for value in moments.values()):
                optimizer_state[index] = {"step": torch.as_tensor(float(step or 0)),
                                          **{key: value.detach().to("cpu") for key, value in moments.items()}}
    if not rank0:
        return None, None
    for key, value in model.state_dict().items():  # buffers kept in the state dict
        if key not in model_state and key not in layout.aliases and key not in params:
            model_state[key] = value.detach().to("cpu")
    groups = [{**group, "params": list(range(len(layout.names)))} for group in layout.param_groups]
    return layout.relink(model_state), {"state": optimizer_state, "param_groups": groups}
