"""LoRA adapters for the actor and the critic: the training copy is the frozen base with ``peft``'s
low-rank adapters; what leaves it is either the adapter alone (a weights commit, a trainer state) or the
merged weights ``W + (alpha / r) * B @ A`` (what the rollout and log-prob models hold).

An adapter commit is a folder in PEFT's own format (``adapter_config.json``, ``adapter_model.safetensors``,
loadable with ``PeftModel.from_pretrained``) plus the base's ``config.json`` and the tokenizer; the
base is always the run's initial model (iteration 0's commit). The merge is done here on plain tensors,
so a process that only runs inference never builds a PEFT model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from kfrl.models.lora_linear import fuse_lora_linears

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The prefix PEFT gives every saved key, and the infixes of the LoRA factors' names in a saved adapter.
_SAVED_PREFIX = "base_model.model."
_FACTORS = (".lora_A.weight", ".lora_B.weight")
# Where a LoRA policy commit keeps the merged model of an iteration that registers a version (an MLflow model).
MERGED_FOLDER = "merged"
# The scalar head of kfrl's value model (AutoModelForTokenClassification): trained whole, never low-rank.
VALUE_HEAD = "score"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: tuple[str, ...] = ()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_spec(section) -> LoraSpec | None:
    """The LoRA settings of a config section with ``lora_rank``/``lora_alpha``/``target_modules``/
    ``exclude_modules`` (``model`` for the actor, ``critic``); None when ``lora_rank`` is 0."""
    if not getattr(section, "lora_rank", 0):
        return None
    targets = section.target_modules
    return LoraSpec(rank=section.lora_rank, alpha=float(section.lora_alpha),
                    target_modules=targets if isinstance(targets, str) else tuple(targets),
                    exclude_modules=tuple(section.exclude_modules or ()))


def is_lora_model(model) -> bool:
    """Whether ``model`` is a PEFT model (a LoRA training copy)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model_of(model):
    """The transformers model inside a PEFT model (its LoRA layers still injected), or ``model`` itself."""
    return model.get_base_model() if is_lora_model(model) else model


def add_adapters(model, spec: LoraSpec, *, seed: int, value_head: bool = False):
    """``model`` (frozen) wrapped with fresh LoRA adapters in fp32 (A drawn under ``seed``, B = 0, so the
    wrapped model computes exactly what the base does). ``value_head``: the value model's head is
    trained whole (PEFT's ``modules_to_save``) and never gets an adapter."""
    from peft import LoraConfig, get_peft_model

    exclude = list(spec.exclude_modules) + ([VALUE_HEAD] if value_head else [])
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                        target_modules=spec.target_modules if isinstance(spec.target_modules, str)
                        else list(spec.target_modules),
                        exclude_modules=exclude or None, modules_to_save=[VALUE_HEAD] if value_head else None)
    with torch.random.fork_rng(devices=[]):  # every process builds the same initial adapter
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # adapters train in fp32 over a base in the compute dtype
    fuse_lora_linears(peft_model)
    return peft_model


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``, and
    the whole value head for a critic): what an adapter commit and a trainer state hold."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_adapter_state(model, state: Mapping[str, torch.Tensor]) -> None:
    """Set a PEFT model's adapter (and value head) to ``state`` (``adapter_state``'s names), exactly."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, dict(state))
    missing = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k or VALUE_HEAD in k]
    if missing:
        raise ValueError(f"the adapter has tensors this model has no place for: {missing[:3]}")


def adapter_config_bytes(model, base_path: str = "") -> bytes:
    """``adapter_config.json`` of a PEFT model, naming ``base_path`` as its base (what a user of
    ``PeftModel.from_pretrained`` passes as the base model)."""
    import tempfile

    config = model.peft_config["default"]
    saved = config.base_model_name_or_path
    config.base_model_name_or_path = base_path or saved
    try:
        with tempfile.TemporaryDirectory(prefix="kfrl-adapter-") as tmp:
            config.save_pretrained(tmp)
            return (Path(tmp) / ADAPTER_CONFIG).read_bytes()
    finally:
        config.base_model_name_or_path = saved


def write_adapter(folder: str | Path, config_bytes: bytes, state: Mapping[str, torch.Tensor]) -> Path:
    """An adapter folder (PEFT's format) from ``adapter_config_bytes`` and an ``adapter_state``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_CONFIG).write_bytes(config_bytes)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(folder / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return folder


def is_adapter_dir(folder: str | Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file() and (Path(folder) / ADAPTER_WEIGHTS).is_file()


def read_adapter(folder: str | Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], float]:
    """(the adapter's tensors, its scaling alpha / r) from an adapter folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not is_adapter_dir(folder):
        raise FileNotFoundError(f"{folder} is no LoRA adapter folder (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if config.get("use_rslora"):
        return load_file(str(folder / ADAPTER_WEIGHTS), device=str(device)), alpha / rank ** 0.5
    return load_file(str(folder / ADAPTER_WEIGHTS), device=str(device)), alpha / rank


# --- the merge, on plain tensors -------------------------------------------------------------------
def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * B @ A``, computed in fp32 (or the base's wider dtype) and returned in ``base``'s dtype."""
    wide = torch.promote_types(base.dtype, torch.float32)
    delta = (lora_b.to(wide) @ lora_a.to(device=lora_b.device, dtype=wide)) * scaling
    return (base.to(wide) + delta.to(base.device)).to(base.dtype)


def weight_updates(adapter: Mapping[str, torch.Tensor]) -> tuple[dict[str, tuple], dict[str, torch.Tensor]]:
    """A saved adapter as ({base weight name: (A, B)}, {base tensor name: replacement}): the low-rank
    factors per adapted weight, and tensors saved whole (a critic's value head)."""
    factors: dict[str, list] = {}
    whole: dict[str, torch.Tensor] = {}
    for key, tensor in adapter.items():
        name = key.removeprefix(_SAVED_PREFIX)
        for index, suffix in enumerate(_FACTORS):
            if name.endswith(suffix):
                factors.setdefault(name[: -len(suffix)] + ".weight", [None, None])[index] = tensor
                break
        else:
            whole[name] = tensor
    broken = [name for name, (a, b) in factors.items() if a is None or b is None]
    if broken:
        raise ValueError(f"the adapter has only one of lora_A/lora_B for {broken[:3]}")
    return {name: (a, b) for name, (a, b) in factors.items()}, whole


def merge_into(model, adapter: Mapping[str, torch.Tensor], scaling: float) -> int:
    """Add a saved adapter's low-rank updates to a plain transformers ``model``'s weights in place (and
    replace the tensors it holds whole). Returns the number of weights changed."""
    factors, whole = weight_updates(adapter)
    params = dict(model.named_parameters())
    unknown = [name for name in list(factors) + list(whole) if name not in params]
    if unknown:
        raise ValueError(f"the adapter names weights this model does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, (lora_a, lora_b) in factors.items():
            params[name].copy_(merged_weight(params[name], lora_a, lora_b, scaling))
        for name, tensor in whole.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return len(factors) + len(whole)


def merged_state(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A PEFT training copy's weights as the plain model's state dict (the base's names) with every
    adapter merged: what an inference copy of the policy or the critic loads (cast to ``dtype``)."""
    state, adapted = _base_state(model)
    with torch.no_grad():
        state.update((name, merged_weight(*factors)) for name, factors in adapted.items())
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return state


def merged_state_on_host(model, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``merged_state`` in host memory, each merged weight copied out as soon as it is computed: the
    accelerator never holds more than one merged weight beside the model, where the whole merged state
    would be another base's worth (13 GiB at 7B, at the iterations that register a model version)."""
    from kfrl.models.host_memory import on_host

    state, adapted = _base_state(model)
    state = on_host({k: v for k, v in state.items() if k not in adapted}, dtype)  # tied tensors stay one
    with torch.no_grad():
        for name, factors in adapted.items():
            state[name] = on_host(merged_weight(*factors), dtype)
    return state


def _base_state(model) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(the base's state dict under the plain model's names, {adapted weight name: (W, A, B, scaling)})."""
    base = base_model_of(model)
    state = {plain: tensor for name, tensor in base.state_dict().items() if (plain := _plain_name(name))}
    return state, _adapted(base)


def _plain_name(name: str) -> str | None:
    """A PEFT-wrapped base's tensor name as the plain model names it; None for PEFT's own tensors."""
    if ".lora_" in name or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")


def _adapted(base) -> dict[str, tuple]:
    """{adapted weight name: (W, A, B, scaling)} of a PEFT-wrapped base."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.weight": (module.get_base_layer().weight, module.lora_A["default"].weight,
                               module.lora_B["default"].weight, module.scaling["default"])
            for name, module in base.named_modules() if isinstance(module, LoraLayer) and "default" in module.lora_A}


# --- the torch decoder over the base ----------------------------------------------------------------
def decoder_over_adapters(model, dtype: torch.dtype):
    """The torch rollout decoder of a PEFT training copy: it shares the frozen base's tensors (where
    they are in ``dtype`` already; the q/k/v and gate/up weights are laid back to back in place once)
    and applies the current adapters as low-rank updates, so it adds no copy of the base."""
    base = base_model_of(model)
    factors = {name: (a.detach(), b.detach(), scaling) for name, (_w, a, b, scaling) in _adapted(base).items()}
    params = {plain: param for name, param in base.named_parameters() if (plain := _plain_name(name))}
    return _decoder_with_factors(base, params, factors, dtype)


def decoder_over_base(base, adapter: Mapping[str, torch.Tensor], scaling: float, dtype: torch.dtype):
    """The torch rollout decoder of a saved adapter (``read_adapter``) over ``base`` (a plain transformers
    model, frozen here), built as ``decoder_over_adapters`` builds it, so both give the same rollouts."""
    factors, whole = weight_updates(adapter)
    params = dict(base.requires_grad_(False).named_parameters())
    params.update(whole)
    return _decoder_with_factors(base, params, {name: (a, b, scaling) for name, (a, b) in factors.items()}, dtype)


def _decoder_with_factors(base, params: dict, factors: dict, dtype: torch.dtype):
    from kfrl.engines.decoder import Decoder, lay_back_to_back

    if "lm_head.weight" not in params and getattr(base.config, "tie_word_embeddings", False):
        params["lm_head.weight"] = base.get_output_embeddings().weight
    device = next(iter(params.values())).device
    with torch.no_grad():
        if all(p.dtype == dtype for p in params.values() if p.is_floating_point()):
            lay_back_to_back(params, base.config.num_hidden_layers)
        return Decoder.from_tensors(base.config, lambda name: params[name].detach() if name in params else None,
                                    device=device, dtype=dtype, low_rank=factors)


def trained_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
