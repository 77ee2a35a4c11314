"""Thin helpers to load and save Hugging Face model directories (local paths only)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def _require_hf_dir(path: str | Path) -> Path:
    """Fail early with a clear message: from_pretrained would treat a bad path as a hub id."""
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(
            f"model path {str(path)!r} {what}; expected a Hugging Face model directory "
            f"containing config.json (plus weights and tokenizer files)"
        )
    return path


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors shards of an HF model directory (from its index when sharded)."""
    import json

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {path}; kfrl's torch and vllm rollout backends read "
                                "safetensors checkpoints")
    return [path / n for n in names]


class CorruptWeightsError(ValueError):
    """A weights file of a model directory cannot be read; the message names the file."""


def check_safetensors(path: str | Path, key: str = "") -> None:
    """Open every safetensors file's header and check that its tensors fit in the file, naming the first
    file that does not (no tensor data is read: cheap even for a 7B model)."""
    import json
    import struct

    path = Path(path)
    where = f" ({key})" if key else ""
    for file in sorted(path.rglob("*.safetensors")):
        size = file.stat().st_size
        try:
            with open(file, "rb") as fh:
                (header_len,) = struct.unpack("<Q", fh.read(8))
                if header_len > size - 8:
                    raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
                header = json.loads(fh.read(header_len))
            end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
            if 8 + header_len + end > size:
                raise ValueError(f"tensors end at byte {8 + header_len + end} but the file has {size}")
        except (ValueError, KeyError, TypeError, struct.error) as err:
            raise CorruptWeightsError(f"{file}{where} is not a readable safetensors file ({err}): it is corrupt or "
                                      "truncated; copy or save the model again") from None


def _loading(path: Path, load):
    """Run a from_pretrained call; a failure caused by an unreadable weights file names the file."""
    try:
        return load()
    except Exception as err:
        try:
            check_safetensors(path)
        except CorruptWeightsError as corrupt:
            raise corrupt from err
        raise


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(_require_hf_dir(path))


def load_causal_lm(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
    """Load a causal LM from a local HF directory onto `device` (dtype as saved when None)."""
    path = _require_hf_dir(path)
    model = _loading(path, lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto"))
    return model.to(device)


def tensor_identity(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are views of the same memory with the same layout (tied weights:
    ``state_dict()`` returns a new tensor object per name, so ``id`` cannot tell)."""
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def save_hf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
            dtype: torch.dtype | None = None) -> Path:
    """Save model (safetensors, cast to ``dtype`` when given: the model itself is left as it is), its
    generation config and the tokenizer (when given) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if dtype is None or dtype == next(model.parameters()).dtype:
        model.save_pretrained(out_dir, safe_serialization=True)
    else:
        cast: dict[tuple, torch.Tensor] = {}
        state = {}
        for name, t in model.state_dict().items():
            key = tensor_identity(t)  # tied weights (embedding = LM head) stay one tensor, saved once
            if key not in cast:
                cast[key] = t.detach().to(dtype) if t.is_floating_point() else t
            state[name] = cast[key]
        saved_dtype = model.config.dtype
        model.config.dtype = dtype  # config.json says what the file holds
        try:
            model.save_pretrained(out_dir, safe_serialization=True, state_dict=state)
        finally:
            model.config.dtype = saved_dtype
    if tokenizer is not None:
        # The chat template goes into tokenizer_config.json (not only chat_template.jinja)
        # so that older transformers releases, as used by some inference images, find it too.
        tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return out_dir


def load_value_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
                     head_seed: int = 0) -> PreTrainedModel:
    """A value model (the LM body + a scalar token-classification head, as veRL's critic).

    From a causal-LM directory the head is new: it is initialised under ``head_seed`` so every
    stage that builds it from the same directory gets the same head. Dropout on the head is off
    (veRL sets classifier_dropout=0 too), so training values are deterministic.
    """
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = _require_hf_dir(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(head_seed)
        model = _loading(path, lambda: AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=dtype or "auto"))
    return model.to(device)


def load_reward_model(path: str | Path, dtype: torch.dtype | None = None, device: str = "cpu") -> PreTrainedModel:
    """A sequence-classification reward model (one logit per sequence) from a local HF directory."""
    from transformers import AutoModelForSequenceClassification

    path = _require_hf_dir(path)
    model = _loading(path, lambda: AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype or "auto"))
    return model.to(device)
