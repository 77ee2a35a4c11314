"""A decoder-only transformer of the Qwen2 / Qwen2.5 / Qwen3 / Llama families in plain PyTorch, read
straight from an HF checkpoint: the model behind the ``torch`` rollout backend.

What differs from the HF modules is only what makes decoding cheap: q/k/v and gate/up projections
fused into one matrix each (two GEMMs per block instead of five), rotary tables precomputed once,
and a decode step that attends over a preallocated KV cache. Over a LoRA model the decoder shares the
frozen base's tensors (the base's q/k/v and gate/up weights are laid back to back in their memory once,
so the fused matrices are views of them) and adds the adapters as low-rank updates, ``x A^T (s B)^T``,
so a rollout holds no second copy of the base. Which optional tensors a checkpoint
carries (q/k/v bias in Qwen2, q/k norms in Qwen3, attention bias in some Llamas) is read from the
checkpoint itself, so no per-family flag can disagree with the weights.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kfrl.engines import kernels

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# Rotary variants whose frequencies do not depend on the sequence length (so one table serves a call).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint is not something the torch decoder implements; the HF backend can still run it."""


@dataclass(frozen=True)
class DecoderSpec:
    architecture: str
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


def _unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{what}; the torch rollout backend runs {', '.join(SUPPORTED_ARCHITECTURES)} "
                                 "checkpoints with full attention and SiLU MLPs: use rollout.name=hf for this model")


def spec_from_config(config) -> DecoderSpec:
    """Checks an HF config (``transformers.PretrainedConfig``) and reads the shapes the decoder needs."""
    architectures = list(getattr(config, "architectures", None) or [])
    architecture = architectures[0] if architectures else f"model_type={getattr(config, 'model_type', '?')}"
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(f"architecture {architecture} is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise _unsupported(f"hidden_act={config.hidden_act} is not supported")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if getattr(config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        raise _unsupported("sliding-window attention is not supported")
    if getattr(config, "mlp_bias", False):
        raise _unsupported("MLP biases (mlp_bias=true) are not supported")
    heads = config.num_attention_heads
    return DecoderSpec(
        architecture=architecture, hidden_size=config.hidden_size, n_layers=config.num_hidden_layers,
        n_heads=heads, n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim/2,) float32, attention scaling), computed as transformers does."""
    params = getattr(config, "rope_parameters", None)
    if not params:  # transformers 4.x keeps them as two attributes
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        raise _unsupported(f"rotary embedding type {rope_type!r} is not supported")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


@dataclass
class LowRank:
    """A low-rank update added to a (fused) projection's output, ``x @ down.T @ up.T``: the LoRA factors
    of the projections it fuses, their A stacked in ``down`` (R, in) and their scaled B, ``(alpha/r) B``,
    on the block diagonal of ``up`` (out, R); a projection without an adapter has zero rows in ``up``."""
    down: torch.Tensor
    up: torch.Tensor


@dataclass
class Block:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor            # (q_size + 2 kv_size, hidden)
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None         # (head_dim,) Qwen3
    k_norm: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor        # (2 intermediate, hidden)
    down_weight: torch.Tensor
    qkv_lora: LowRank | None = None     # the adapters of a LoRA model, per fused projection
    o_lora: LowRank | None = None
    gate_up_lora: LowRank | None = None
    down_lora: LowRank | None = None


@dataclass
class PromptCache:
    """A rollout's prompts in the KV cache once each rather than once per sample: ``cache`` (layers, 2,
    prompts, kv_heads, length, hd) holds the first ``length`` columns of every sequence (its left-padded
    prompt), sequence i's at prompt row ``prompt_of[i]``; the per-sequence cache holds the columns
    after them. A GRPO batch of n samples per prompt keeps (and its decode steps read) each prompt's K/V
    once instead of n times."""
    cache: torch.Tensor
    prompt_of: torch.Tensor  # (sequences,) long
    length: int

    def of_layer(self, layer: int, rows: int) -> tuple:
        """``kernels.rope_attention``'s ``prompt`` for the first ``rows`` sequences."""
        return self.cache[layer, 0], self.cache[layer, 1], self.prompt_of[:rows], self.length


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, low_rank: LowRank | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, plus the low-rank update when there is one (added in place)."""
    y = F.linear(x, weight, bias)
    if low_rank is not None:
        inner = F.linear(x, low_rank.down)
        y.view(-1, y.shape[-1]).addmm_(inner.view(-1, inner.shape[-1]), low_rank.up.t())
    return y


def _back_to_back(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``parts`` (stacked along dim 0) when they already lie back to back in one
    memory block, as a view (nothing copied); None otherwise."""
    first = parts[0]
    offset = first.storage_offset()
    for part in parts:
        if (part.device != first.device or part.dtype != first.dtype or not part.is_contiguous()
                or part.shape[1:] != first.shape[1:] or part.storage_offset() != offset
                or part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += part.numel()
    rows = sum(part.shape[0] for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def fused_groups(n_layers: int) -> list[list[str]]:
    """The HF parameter names the decoder fuses into one matrix, per group (q/k/v weights and biases,
    gate/up weights of every layer)."""
    groups = []
    for i in range(n_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        groups += [[attn + f"{x}_proj.weight" for x in "qkv"], [attn + f"{x}_proj.bias" for x in "qkv"],
                   [mlp + "gate_proj.weight", mlp + "up_proj.weight"]]
    return groups


def lay_back_to_back(params: dict[str, torch.nn.Parameter], n_layers: int, *, trained: bool = False) -> int:
    """Move each fused group's parameters (``fused_groups``) into one memory block, in place (each
    parameter's ``data`` becomes a view of it; values unchanged), so that a decoder built over them
    shares their memory. Groups already so laid out are left alone; returns the groups moved.

    The parameters keep their identity, so an optimizer holding them keeps holding them; but a tensor
    taken from ``p.data`` before the move (a reference to the old memory) would no longer be the
    weight. So by default only frozen weights are moved; ``trained``: the caller knows that nothing
    holds such a tensor (a training copy just loaded, before its optimizer or compiled blocks exist)."""
    moved = 0
    with torch.no_grad():
        for names in fused_groups(n_layers):
            parts = [params.get(name) for name in names]
            if any(p is None for p in parts) or _back_to_back([p.data for p in parts]) is not None:
                continue
            if not trained and any(p.requires_grad for p in parts):
                raise ValueError(f"{names[0]} is trained: only frozen weights may be moved")
            block = torch.cat([p.data.reshape(p.shape[0], -1) for p in parts])
            row = 0
            for p in parts:
                p.data = block[row:row + p.shape[0]].view(p.shape)
                row += p.shape[0]
            moved += 1
    return moved


class Decoder:
    """Weights and forward passes. ``prefill`` runs whole left-padded prompts; ``decode`` runs one
    token per sequence against a KV cache of shape (layers, 2, batch, kv_heads, columns, head_dim)."""

    def __init__(self, spec: DecoderSpec, embed: torch.Tensor, blocks: list[Block], norm: torch.Tensor,
                 lm_head: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float):
        self.spec = spec
        self.embed = embed
        self.blocks = blocks
        self.norm = norm
        self.lm_head = lm_head
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    # --- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, config, get: Callable[[str], torch.Tensor | None], *, device, dtype,
                     low_rank: dict[str, tuple[torch.Tensor, torch.Tensor, float]] | None = None) -> "Decoder":
        """Builds the decoder from HF parameter names (``model.layers.0.self_attn.q_proj.weight``, ...);
        ``get`` returns a tensor or None when the checkpoint has no such tensor. Tensors already in
        ``device`` and ``dtype`` are used as they are (and a fused group laid back to back as a view).
        ``low_rank``: LoRA adapters, {weight name: (A, B, scaling)}, added to the projections as low-rank
        updates (and merged into a copy of any other weight they name)."""
        spec = spec_from_config(config)
        adapters = dict(low_rank or {})

        def tensor(name: str, required: bool = True) -> torch.Tensor | None:
            value = get(name)
            if value is None:
                if required:
                    raise _unsupported(f"the checkpoint has no tensor {name!r}")
                return None
            if name in adapters:  # an adapted weight outside the fused projections (e.g. an LM head)
                a, b, scaling = adapters.pop(name)
                wide = torch.promote_types(value.dtype, torch.float32)
                value = value.to(wide) + ((b.to(wide) @ a.to(wide)) * scaling).to(value.device)
            return value.to(device=device, dtype=dtype)

        def cat(*parts):
            present = [p for p in parts if p is not None]
            if not present:
                return None
            if len(present) != len(parts):
                raise _unsupported("the checkpoint has biases on some but not all of q/k/v")
            fused = _back_to_back(present)
            return fused if fused is not None else torch.cat(present)

        def adapters_of(*names: str) -> LowRank | None:
            found = [adapters.pop(name, None) for name in names]
            if all(f is None for f in found):
                return None
            sizes = [get(name).shape[0] for name in names]
            down = torch.cat([a for a, _b, _s in filter(None, found)]).to(device=device, dtype=dtype)
            up = torch.zeros(sum(sizes), down.shape[0], device=device, dtype=dtype)
            row = column = 0
            for factors, size in zip(found, sizes):
                if factors is not None:
                    a, b, scaling = factors
                    wide = torch.promote_types(b.dtype, torch.float32)
                    up[row:row + size, column:column + a.shape[0]] = b.to(wide) * scaling
                    column += a.shape[0]
                row += size
            return LowRank(down, up)

        blocks = []
        for i in range(spec.n_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            if get(p + "mlp.gate_proj.bias") is not None:
                raise _unsupported("MLP biases are not supported")
            # The projections' adapters first, so that ``tensor`` merges none of them into a copy.
            low_ranks = dict(qkv_lora=adapters_of(*(attn + f"{x}_proj.weight" for x in "qkv")),
                             o_lora=adapters_of(attn + "o_proj.weight"),
                             gate_up_lora=adapters_of(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                             down_lora=adapters_of(p + "mlp.down_proj.weight"))
            blocks.append(Block(
                input_norm=tensor(p + "input_layernorm.weight"),
                qkv_weight=cat(*(tensor(attn + f"{x}_proj.weight") for x in "qkv")),
                qkv_bias=cat(*(tensor(attn + f"{x}_proj.bias", required=False) for x in "qkv")),
                q_norm=tensor(attn + "q_norm.weight", required=False),
                k_norm=tensor(attn + "k_norm.weight", required=False),
                o_weight=tensor(attn + "o_proj.weight"),
                o_bias=tensor(attn + "o_proj.bias", required=False),
                post_norm=tensor(p + "post_attention_layernorm.weight"),
                gate_up_weight=cat(tensor(p + "mlp.gate_proj.weight"), tensor(p + "mlp.up_proj.weight")),
                down_weight=tensor(p + "mlp.down_proj.weight"), **low_ranks))
        embed = tensor("model.embed_tokens.weight")
        # Tied: one tensor, as in HF (whatever the source holds under lm_head.weight).
        lm_head = embed if spec.tie_word_embeddings else tensor("lm_head.weight", required=False)
        if lm_head is None:
            raise _unsupported("the checkpoint has no lm_head.weight and does not tie word embeddings")
        norm = tensor("model.norm.weight")
        if adapters:
            raise ValueError(f"the adapter names weights the torch decoder has no place for: {sorted(adapters)[:3]}")
        inv_freq, scaling = rope_frequencies(config, spec.head_dim)
        return cls(spec, embed, blocks, norm, lm_head, inv_freq.to(device), scaling)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device="cpu", dtype=torch.bfloat16) -> "Decoder":
        """Reads config.json and the safetensors shards of an HF model directory (no conversion)."""
        from safetensors import safe_open
        from transformers import AutoConfig

        from kfrl.models.hf_io import check_safetensors, safetensors_files

        path = Path(path)
        config = AutoConfig.from_pretrained(path)
        spec_from_config(config)  # refuse unsupported models before reading any weights
        check_safetensors(path)
        handles = [safe_open(str(f), framework="pt", device=str(device)) for f in safetensors_files(path)]
        where = {name: h for h in handles for name in h.keys()}
        return cls.from_tensors(config, lambda name: where[name].get_tensor(name) if name in where else None,
                                device=device, dtype=dtype)

    @classmethod
    def from_hf_model(cls, model, dtype: torch.dtype | None = None, state: dict | None = None) -> "Decoder":
        """Shares nothing with ``model`` but its values: weights are copied into the fused layout (cast to
        ``dtype``, the model's own when None). ``state``: the weights to take instead of the model's own
        (under its names, e.g. a LoRA copy's merged weights); ``model`` then gives config and device."""
        params = dict(state) if state is not None else dict(model.named_parameters())
        params.update({k: v for k, v in model.named_buffers() if k not in params})
        first = next(iter(params.values())) if state is not None else next(model.parameters())
        if "lm_head.weight" not in params and getattr(model.config, "tie_word_embeddings", False):
            params["lm_head.weight"] = model.get_output_embeddings().weight
        with torch.no_grad():
            return cls.from_tensors(model.config, lambda name: params[name].detach() if name in params else None,
                                    device=first.device, dtype=dtype or first.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """Every weight tensor, in a fixed order (a tied lm_head appears once, as the embedding; a low-rank
        update as its two factors)."""
        found = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for block in self.blocks:
            for field in dataclasses.fields(block):
                value = getattr(block, field.name)
                found += [value.down, value.up] if isinstance(value, LowRank) else [] if value is None else [value]
        return found

    # --- shared pieces ----------------------------------------------------------------------------
    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (length, head_dim) in the model dtype, grown on demand and kept."""
        if self._rope is None or self._rope[0].shape[0] < length:
            size = max(length, 4096)
            positions = torch.arange(size, device=self.device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)
            self._rope = ((angles.cos() * self.attention_scaling).to(self.dtype),
                          (angles.sin() * self.attention_scaling).to(self.dtype))
        return self._rope

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm_ref(x, weight, self.spec.rms_norm_eps)

    def _mlp(self, block: Block, x: torch.Tensor) -> torch.Tensor:
        gate_up = project(self._norm(x, block.post_norm), block.gate_up_weight, None, block.gate_up_lora)
        return x + project(kernels.silu_mul_ref(gate_up), block.down_weight, None, block.down_lora)

    # --- passes -----------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, key_valid: torch.Tensor, positions: torch.Tensor,
                kv_out: torch.Tensor) -> torch.Tensor:
        """Left-padded prompts (P, S): writes K/V of every position into ``kv_out`` (layers, 2, P,
        kv_heads, S, head_dim) and returns the logits of the last position (P, V)."""
        s = self.spec
        cos_table, sin_table = self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions].unsqueeze(-2), sin_table[positions].unsqueeze(-2)
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        # Padding queries attend to themselves only, so no row of the mask is empty (an empty row is NaN).
        mask = (causal & key_valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=input_ids.device)
        mask = mask.unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        for layer, block in enumerate(self.blocks):
            qkv = project(self._norm(x, block.input_norm), block.qkv_weight, block.qkv_bias, block.qkv_lora)
            q, k, v = kernels.split_rotated_qkv(qkv, cos, sin, block.q_norm, block.k_norm, s.rms_norm_eps,
                                                s.n_heads, s.n_kv_heads, s.head_dim)
            k, v = k.transpose(1, 2), v.transpose(1, 2)          # (P, kv_heads, S, hd)
            kv_out[layer, 0].copy_(k)
            kv_out[layer, 1].copy_(v)
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                                  enable_gqa=s.n_kv_heads != s.n_heads)
            x = x + project(attn.transpose(1, 2).flatten(-2), block.o_weight, block.o_bias, block.o_lora)
            x = self._mlp(block, x)
        return F.linear(self._norm(x[:, -1], self.norm), self.lm_head)

    def extend(self, input_ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
               start: int, attn_bias: torch.Tensor) -> torch.Tensor:
        """Appends T tokens per sequence to a filled cache (a multi-turn rollout's tool answer): input_ids,
        valid, positions (b, T), left-padded within the T columns ``start..start+T`` of ``cache`` (layers,
        2, >=b, kv_heads, >=start+T, hd), which receive their K/V. They attend to the columns before
        ``start`` that ``attn_bias`` (b, >=start; 0 visible, -inf not) shows, and causally to each other.
        Returns the logits of the last position (b, V)."""
        s = self.spec
        b, length = input_ids.shape
        device = input_ids.device
        cos_table, sin_table = self.rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions].unsqueeze(-2), sin_table[positions].unsqueeze(-2)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        new = (causal & valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device)
        old = (attn_bias[:b, :start] == 0)[:, None, :].expand(b, length, start) & valid[:, :, None]
        mask = torch.cat([old, new], dim=-1).unsqueeze(1)
        x = F.embedding(input_ids, self.embed)
        for layer, block in enumerate(self.blocks):
            qkv = project(self._norm(x, block.input_norm), block.qkv_weight, block.qkv_bias, block.qkv_lora)
            q, k, v = kernels.split_rotated_qkv(qkv, cos, sin, block.q_norm, block.k_norm, s.rms_norm_eps,
                                                s.n_heads, s.n_kv_heads, s.head_dim)
            cache[layer, 0, :b, :, start:start + length] = k.transpose(1, 2)
            cache[layer, 1, :b, :, start:start + length] = v.transpose(1, 2)
            keys, values = cache[layer, 0, :b, :, :start + length], cache[layer, 1, :b, :, :start + length]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                  enable_gqa=s.n_kv_heads != s.n_heads)
            x = x + project(attn.transpose(1, 2).flatten(-2), block.o_weight, block.o_bias, block.o_lora)
            x = self._mlp(block, x)
        return F.linear(self._norm(x[:, -1], self.norm), self.lm_head)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, column: torch.Tensor,
               attn_bias: torch.Tensor, prompts: "PromptCache | None" = None) -> torch.Tensor:
        """One token per sequence. tokens, positions (b,); cache (layers, 2, >=b, kv_heads, >=L, hd) whose
        first b rows are these sequences; column (1,) where this token's K/V go; attn_bias (b, L) additive
        (0 = visible, -inf = not). The columns up to and including ``column`` are attended (read on the
        device: one captured step serves every column). With ``prompts`` the first ``prompts.length``
        columns are the prompts' (held once per prompt) and ``cache`` holds the columns after them.
        Returns logits (b, V)."""
        s = self.spec
        b = attn_bias.shape[0]
        eps = s.rms_norm_eps
        cos_table, sin_table = self.rope_tables(1)  # grown before the call, never inside a captured step
        x = F.embedding(tokens, self.embed)
        delta = None
        for layer, block in enumerate(self.blocks):
            x, h = kernels.add_rms_norm(x, delta, block.input_norm, eps)
            qkv = project(h, block.qkv_weight, block.qkv_bias, block.qkv_lora)
            attn = kernels.rope_attention(qkv, positions, cos_table, sin_table, block.q_norm, block.k_norm, eps,
                                          cache[layer, 0, :b], cache[layer, 1, :b], column, attn_bias,
                                          s.n_heads, s.n_kv_heads, s.head_dim,
                                          None if prompts is None else prompts.of_layer(layer, b))
            delta = project(attn, block.o_weight, block.o_bias, block.o_lora)
            x, h = kernels.add_rms_norm(x, delta, block.post_norm, eps)
            act = kernels.silu_mul(project(h, block.gate_up_weight, None, block.gate_up_lora))
            delta = project(act, block.down_weight, None, block.down_lora)
        _, h = kernels.add_rms_norm(x, delta, self.norm, eps)
        return F.linear(h, self.lm_head)
