"""One forward pass per prompt for the rows that share it (GRPO's n samples of a prompt, RLOO's, DAPO's…).

A micro-batch of GRPO rows holds each prompt n times: 32 rows of 133 + 256 tokens are 8 prompts × 4
responses, and the plain forward pushes every prompt token through the model 4 times (a quarter of the
update's tokens at that shape). Here the rows that share a prompt are laid out as one packed sequence,

    [ prompt (right-padded to the micro-batch's longest) | response 1 | response 2 | … | response S ]

each response in a slot as wide as the longest response, so the linear layers, norms and MLPs see every
prompt token once. The attention keeps each response's own view: the prompt attends causally to
itself, and each response to the prompt's real tokens and causally to its own earlier tokens, never to
another response. Positions restart after the prompt in every slot, so rotary embeddings match the
unpacked rows. The result is the unpacked pass's, up to floating-point summation order; the prompt's
activations collect the gradients of all its responses through the shared pass.

The layout reaches the attention as a keyword argument of the HF decoder's forward (which hands such
arguments down to its attention function), and the attention itself is ``kfrl_shared_prompt``,
registered with transformers' attention interface: it runs this layout when handed one and transformers'
SDPA attention otherwise, so the model serves unpacked passes unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kfrl.engines.inference import uncached

ATTENTION_NAME = "kfrl_shared_prompt"
LAYOUT_ARGUMENT = "shared_prompt_layout"
# Decoders whose HF implementation hands its forward's extra keyword arguments down to the attention
# function of transformers' attention interface (checked against transformers 5.x by the tests).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


@dataclass(frozen=True)
class PromptIndex:
    """Host-side facts of a batch's rows (B,): which prompt each row has (rows with identical prompt
    tokens get one id), and its prompt and response lengths. Built once per pass, so that laying out
    a micro-batch reads only its row indices."""
    prompt_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor

    @classmethod
    def of(cls, trajectories) -> "PromptIndex":
        input_ids = trajectories.input_ids.cpu()
        prompt_lengths = trajectories.gather_positions[:, 0].cpu() + 1
        seen: dict[tuple, int] = {}
        ids = [seen.setdefault(tuple(row[:n].tolist()), len(seen)) for row, n in zip(input_ids, prompt_lengths)]
        return cls(torch.tensor(ids, dtype=torch.long), prompt_lengths, trajectories.lengths.cpu())


@dataclass
class SharedPromptLayout:
    """A micro-batch of b rows as G packed sequences of T = prompt_width + slots * slot_width tokens.

    source_rows, source_cols  (G, T) long  where each packed token comes from in the micro-batch's
                                           input_ids (padding repeats a real token: it is never attended)
    position_ids              (G, T) long  rotary positions (each slot restarts after its prompt)
    gather                    (b, L) long  per response token, its predicting position in the flattened
                                           (G * T) packed sequence
    prompt_lengths            (G * slots,) long, or None when every prompt has prompt_width tokens
    """
    source_rows: torch.Tensor
    source_cols: torch.Tensor
    position_ids: torch.Tensor
    gather: torch.Tensor
    prompt_width: int
    slots: int
    slot_width: int
    prompt_lengths: torch.Tensor | None

    def response_mask(self, device) -> torch.Tensor:
        """(G * slots, 1, slot_width, prompt_width + slot_width) bool: a response query sees its
        prompt's real tokens and its own tokens up to itself."""
        if self.prompt_lengths is None:
            from torch.nn.attention.bias import causal_lower_right

            return causal_lower_right(self.slot_width, self.prompt_width + self.slot_width)
        keys = torch.arange(self.prompt_width + self.slot_width, device=device)
        queries = torch.arange(self.slot_width, device=device)
        in_prompt = keys[None, :] < self.prompt_lengths.to(device)[:, None]                     # (GS, K)
        own = (keys[None, :] >= self.prompt_width) & (keys[None, :] - self.prompt_width <= queries[:, None])  # (Q, K)
        return (in_prompt[:, None, :] | own[None, :, :])[:, None]

    def attend(self, query, key, value, scaling: float) -> torch.Tensor:
        """query (G, H, T, D), key/value (G, KV, T, D) → (G, T, H, D), as transformers' attention
        functions return it."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        groups, heads, _, dim = query.shape
        repeat = heads // key.shape[1]
        if repeat > 1:  # grouped-query attention: each KV head serves `repeat` query heads
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        p, s, r = self.prompt_width, self.slots, self.slot_width

        def slots(x):  # (G, H, S * R, D) → (G * S, H, R, D)
            return x[:, :, p:].unflatten(2, (s, r)).transpose(1, 2).reshape(groups * s, heads, r, dim)

        def with_prompt(x):  # each slot's keys: its prompt's, then its own
            prompt = x[:, None, :, :p].expand(groups, s, heads, p, dim).reshape(groups * s, heads, p, dim)
            return torch.cat((prompt, slots(x)), dim=2)

        prompt_out = sdpa(query[:, :, :p], key[:, :, :p], value[:, :, :p], is_causal=True, scale=scaling)
        response_out = sdpa(slots(query), with_prompt(key), with_prompt(value),
                            attn_mask=self.response_mask(query.device), scale=scaling)
        response_out = response_out.reshape(groups, s, heads, r, dim).transpose(1, 2).reshape(groups, heads, s * r, dim)
        return torch.cat((prompt_out, response_out), dim=2).transpose(1, 2).contiguous()


def plan_layout(index: PromptIndex, rows: torch.Tensor, sequence_width: int, response_width: int,
                device) -> SharedPromptLayout | None:
    """The packed layout of the micro-batch ``rows`` (host indices into ``index``'s batch), whose rows are
    ``sequence_width`` tokens wide with responses ``response_width`` wide (its input_ids' and
    gather_positions' widths); None where it would not compute fewer tokens than the rows do (no two rows
    share a prompt, or the empty slots of small groups outweigh what sharing saves)."""
    rows = rows.cpu()
    prompt_ids = index.prompt_ids[rows].tolist()
    prompt_lengths = index.prompt_lengths[rows].tolist()
    response_lengths = index.response_lengths[rows].tolist()
    members: dict[int, list[int]] = {}
    for local, pid in enumerate(prompt_ids):
        members.setdefault(pid, []).append(local)
    groups = list(members.values())
    p = max(prompt_lengths)
    s = max(len(m) for m in groups)
    r = max(1, max(response_lengths))
    width = p + s * r
    if s < 2 or len(groups) * width >= len(rows) * sequence_width:
        return None
    source_rows = torch.empty((len(groups), width), dtype=torch.long)
    source_cols = torch.empty((len(groups), width), dtype=torch.long)
    position_ids = torch.empty((len(groups), width), dtype=torch.long)
    gather = torch.empty((len(rows), response_width), dtype=torch.long)
    group_prompt_lengths = []
    t = torch.arange(response_width)
    for g, locals_ in enumerate(groups):
        first = locals_[0]
        n = prompt_lengths[first]
        group_prompt_lengths.append(n)
        # The prompt's padding repeats its last token, every empty slot the prompt's first: never attended
        # by a real query, they only need to be tokens.
        source_rows[g] = first
        source_cols[g, :p] = torch.arange(p).clamp(max=n - 1)
        source_cols[g, p:] = 0
        position_ids[g, :p] = torch.arange(p)
        for slot in range(s):
            start = p + slot * r
            position_ids[g, start:start + r] = n + torch.arange(r)
            if slot < len(locals_):
                local = locals_[slot]
                length = response_lengths[local]
                source_rows[g, start:start + r] = local
                # the row's own response tokens, then its last one repeated (padding, as in the row)
                source_cols[g, start:start + r] = n + torch.arange(r).clamp(max=max(length - 1, 0))
                # token t is predicted by the prompt's last position (t = 0) or response token t - 1,
                # and a position past the response by its last real one, as in the unpacked rows
                k = t.clamp(max=length)
                gather[local] = torch.where(k == 0, g * width + n - 1, g * width + start + k - 1)
    uneven = len(set(group_prompt_lengths)) > 1
    lengths = torch.tensor(group_prompt_lengths).repeat_interleave(s) if uneven else None
    return SharedPromptLayout(source_rows.to(device), source_cols.to(device), position_ids.to(device),
                              gather.to(device), p, s, r, lengths)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``kfrl_shared_prompt``: the packed layout's attention when the model's forward was handed one
    (``shared_prompt_layout``, passed down to the attention with the forward's other keyword arguments),
    transformers' SDPA attention otherwise."""
    layout = kwargs.pop(LAYOUT_ARGUMENT, None)
    if layout is not None:
        return layout.attend(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def enable(model) -> bool:
    """Makes ``model`` (an HF causal LM, peft-wrapped or not) run ``kfrl_shared_prompt`` where it ran SDPA
    attention; returns whether shared-prompt passes apply to it (a supported decoder on SDPA attention)."""
    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if config._attn_implementation == ATTENTION_NAME:
        return True
    if config._attn_implementation != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    config._attn_implementation = ATTENTION_NAME
    return True


def packed_hidden(decoder, input_ids: torch.Tensor, layout: SharedPromptLayout) -> torch.Tensor:
    """The decoder's final hidden states (b, L, H) at the positions that predict each response token,
    computed over the packed layout."""
    packed = input_ids[layout.source_rows, layout.source_cols]
    hidden = decoder(input_ids=packed, position_ids=layout.position_ids, **{LAYOUT_ARGUMENT: layout},
                     **uncached(decoder)).last_hidden_state
    return hidden.flatten(0, 1)[layout.gather]
