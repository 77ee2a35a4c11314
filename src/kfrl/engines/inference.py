"""Log-probs and entropy of response tokens under a causal LM (old/ref log-prob, and the update's forward).

Sequences are prompt + response, right-padded. The LM head is applied only at the positions that
predict response tokens, so (batch, response_length, vocab) is the largest tensor, never
(batch, prompt + response, vocab): with a 150k vocabulary that is the difference between fitting
and not.
"""
from __future__ import annotations

import functools
import inspect

import torch

from kfrl.engines import autocast
from kfrl.trajectory import Trajectories


# Positions whose logits are computed at once: the fp32 logits of one chunk (elements = positions x
# vocabulary) are the largest tensor of the pass, about 1 GiB, whatever the batch. In training each
# chunk's logits are recomputed in the backward pass instead of being kept.
LOGIT_CHUNK_ELEMENTS = 2**28


@functools.lru_cache(maxsize=None)
def _forward_takes_use_cache(cls) -> bool:
    try:
        return "use_cache" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def uncached(model) -> dict[str, bool]:
    """``use_cache=False`` for a forward pass of ``model`` (or of the model a PEFT wrapper holds), where
    its forward takes the argument. transformers builds a KV cache whenever ``config.use_cache`` is on
    and gradient checkpointing is not: every layer's keys and values copied into it (one ``torch.cat``
    each) and, in a pass without gradients, all of them held until the pass returns, where otherwise
    each layer's are freed after its attention. No pass over whole sequences reads that cache."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"use_cache": False} if _forward_takes_use_cache(type(base)) else {}


def response_hidden(model, batch: Trajectories, layout=None) -> torch.Tensor:
    """Final hidden states (B, L, H) at the positions that predict each response token; with a
    ``SharedPromptLayout`` of the batch (``kfrl.engines.shared_prompt``), from one pass per prompt."""
    decoder = model.get_decoder()
    if layout is not None:
        from kfrl.engines.shared_prompt import packed_hidden

        return packed_hidden(decoder, batch.input_ids, layout)
    # No padding mask: the rows are right-padded, so a real token's causal window holds real tokens only
    # and the mask would change nothing that is read. Without one, SDPA runs causal (flash on CUDA) and no
    # (B, 1, T, T) mask is built; rows with padding would otherwise take the masked kernel. Even an
    # all-ones mask cost a 0.5B micro-batch's body 0.118 s against 0.105 (H200, profile_update.json).
    hidden = decoder(input_ids=batch.input_ids, **uncached(decoder)).last_hidden_state
    index = batch.gather_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def causal_attention(model) -> bool:
    """Whether every attention of ``model`` is causal (transformers marks each attention module's
    ``is_causal``): then right-padded rows need no padding mask. A bidirectional encoder (a BERT value
    model) is not, and keeps it."""
    flags = {module.is_causal for module in model.modules() if isinstance(getattr(module, "is_causal", None), bool)}
    return flags == {True}


def response_logits(model, batch: Trajectories) -> torch.Tensor:
    """Logits (B, L, V) that predict each response token."""
    return model.get_output_embeddings()(response_hidden(model, batch))


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_v softmax(logits)_v ** 2 over the last axis, as exp(logsumexp(2z) - 2 logsumexp(z)): no
    probability tensor is formed and nothing underflows to a spurious 0 before the sum."""
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def _token_stats(hidden, targets, head, temperature: float, with_entropy: bool, autocast_dtype,
                 with_sum_pi_squared: bool = False):
    """Log-probs of ``targets``, entropies (or None) and the sum over the vocabulary of the squared
    probabilities (or None) for a (N, H) chunk of hidden states, all under softmax(logits / T)."""
    from kfrl.algos import entropy_from_logits

    with autocast(hidden.device.type, autocast_dtype):
        logits = head(hidden)
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_probs, entropy_from_logits(logits) if with_entropy else None,
            sum_pi_squared_from_logits(logits) if with_sum_pi_squared else None)


def fused_applies(hidden: torch.Tensor, head, autocast_dtype, with_sum_pi_squared: bool) -> bool:
    """Whether the fused LM-head kernels (``kfrl.engines.token_stats``) take this pass: on CUDA, with a
    16-bit compute dtype and a head without bias; Σπ² (optimal_token_baseline) keeps the unfused pass."""
    from kfrl.engines.kernels import triton_enabled

    return (triton_enabled(hidden) and autocast_dtype in (torch.bfloat16, torch.float16)
            and getattr(head, "bias", None) is None and not with_sum_pi_squared)


# cuDNN's attention builds an execution plan for every new shape it meets; the update's micro-batches
# (cut to their longest sequence, masked when a row is padded) keep meeting new ones.
AVOID_CUDNN_ATTENTION = True


def attention_kernels(device_type: str):
    """The SDPA backends a log-prob or update pass may use: on CUDA all but cuDNN's attention when
    ``AVOID_CUDNN_ATTENTION`` (flash for causal passes, memory-efficient where a mask is needed)."""
    import contextlib

    if device_type != "cuda" or not AVOID_CUDNN_ATTENTION:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def forward_token_stats(model, batch: Trajectories, temperature: float, with_entropy: bool,
                        autocast_dtype: torch.dtype | None = None, with_sum_pi_squared: bool = False,
                        layout=None):
    """(log_probs (B, L), entropy (B, L) or None, sum_pi_squared (B, L) or None); differentiable when
    grad is enabled. The LM head, softmax, entropy and sum of squared probabilities run over chunks of
    positions (``LOGIT_CHUNK_ELEMENTS``), so the full (B, L, V) fp32 logits never exist. ``layout``: the
    batch's shared-prompt layout, or None for one sequence per row."""
    from torch.utils.checkpoint import checkpoint

    with autocast(batch.input_ids.device.type, autocast_dtype), attention_kernels(batch.input_ids.device.type):
        hidden = response_hidden(model, batch, layout)
    head = model.get_output_embeddings()
    rows, length, width = hidden.shape
    flat, targets = hidden.reshape(rows * length, width), batch.response_ids.reshape(-1)
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
    if fused_applies(flat, head, autocast_dtype, with_sum_pi_squared):
        from kfrl.engines.token_stats import linear_token_stats

        log_probs, entropy = linear_token_stats(flat, head.weight, targets, temperature, autocast_dtype, chunk)
        return log_probs.view(rows, length), entropy.view(rows, length) if with_entropy else None, None
    recompute = torch.is_grad_enabled() and len(flat) > chunk
    parts = []
    for start in range(0, len(flat), chunk):
        args = (flat[start:start + chunk], targets[start:start + chunk], head, temperature, with_entropy,
                autocast_dtype, with_sum_pi_squared)
        parts.append(checkpoint(_token_stats, *args, use_reentrant=False) if recompute else _token_stats(*args))

    def joined(k: int, wanted: bool):
        return torch.cat([part[k] for part in parts]).view(rows, length) if wanted else None

    return joined(0, True), joined(1, with_entropy), joined(2, with_sum_pi_squared)


def forward_response(model, batch: Trajectories, temperature: float, with_entropy: bool,
                     autocast_dtype: torch.dtype | None = None, layout=None):
    """(log_probs (B, L), entropy (B, L) or None): ``forward_token_stats`` without the sum of squared
    probabilities."""
    log_probs, entropy, _ = forward_token_stats(model, batch, temperature, with_entropy, autocast_dtype,
                                                layout=layout)
    return log_probs, entropy


def prompt_sharing(model, trajectories: Trajectories, wanted: bool):
    """A function of a micro-batch's row indices and its (selected, possibly trimmed) batch that returns
    the batch's shared-prompt layout, or None where sharing would not save tokens; None itself when
    sharing is not ``wanted`` or the model does not support it (``kfrl.engines.shared_prompt``)."""
    if not wanted:
        return None
    from kfrl.engines import shared_prompt

    if not shared_prompt.enable(model):
        return None
    index = shared_prompt.PromptIndex.of(trajectories)

    def layout(rows: torch.Tensor, batch: Trajectories):
        return shared_prompt.plan_layout(index, rows, batch.input_ids.shape[1], batch.gather_positions.shape[1],
                                         batch.input_ids.device)

    return layout


@torch.no_grad()
def compute_token_stats(model, trajectories: Trajectories, *, temperature: float, micro_batch_size: int,
                        with_entropy: bool, with_sum_pi_squared: bool = False, autocast_dtype=None,
                        token_budget: int = 0, share_prompts: bool = False):
    """(log-probs (B, L), entropies or None, sums over the vocabulary of the squared probabilities or
    None) of the response tokens, micro-batched (by ``micro_batch_size`` rows, or with ``token_budget``
    > 0 by tokens, each micro-batch cut to its longest sequence: ``budget_micro_batches``); positions
    past a response's length hold no meaning (``Trajectories.unpad`` drops them). ``share_prompts``: the
    rows of a micro-batch that share a prompt share its pass (``kfrl.engines.shared_prompt``)."""
    from kfrl.engines.minibatch import budget_micro_batches

    device = next(model.parameters()).device
    layout_of = prompt_sharing(model, trajectories, share_prompts)
    trajectories = trajectories.to(device)
    rows = len(trajectories)
    if token_budget > 0:
        batches = budget_micro_batches(torch.arange(rows), trajectories.attention_mask.sum(-1).cpu(), token_budget)
    else:
        batches = [torch.arange(start, min(start + micro_batch_size, rows)) for start in range(0, rows, micro_batch_size)]
    width = trajectories.response_mask.shape[1]
    wanted = (True, with_entropy, with_sum_pi_squared)
    out = [torch.zeros(rows, width, device=device) if want else None for want in wanted]
    for batch in batches:
        part = trajectories.select(batch.to(device))
        part = part.trimmed() if token_budget > 0 else part
        stats = forward_token_stats(model, part, temperature, with_entropy, autocast_dtype, with_sum_pi_squared,
                                    layout=layout_of(batch, part) if layout_of else None)
        for k, value in enumerate(stats):
            if value is not None:
                out[k][batch.to(device), :value.shape[1]] = value.float()
    return tuple(out)


def compute_logprobs(model, trajectories: Trajectories, *, temperature: float, micro_batch_size: int,
                     with_entropy: bool, autocast_dtype=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (B, L) of the response tokens (and entropies, or None), micro-batched; positions past
    a response's length hold no meaning (``Trajectories.unpad`` drops them)."""
    logprobs, entropies, _ = compute_token_stats(model, trajectories, temperature=temperature,
                                                 micro_batch_size=micro_batch_size, with_entropy=with_entropy,
                                                 autocast_dtype=autocast_dtype)
    return logprobs, entropies
