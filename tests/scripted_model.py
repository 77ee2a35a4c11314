"""A random-init Qwen2 checkpoint with a few next-token distributions set by construction.

Tests that need a condition (sequences that end early at known steps, others that run to the length
limit, a next-token distribution of known shape) build it here instead of hoping that a random or a
trained model provides it on every machine.

How: some hidden dimensions are reserved, one per *trigger* token. Only the trigger's embedding has a
component there (a large one, M), and every block's output projections (attention ``o_proj``, MLP
``down_proj``) have zero rows there, so the residual stream carries exactly M in that dimension at a
position whose input is the trigger, and exactly 0 everywhere else. After the final RMSNorm the
trigger's dimension is ~sqrt(hidden) and every other one ~sqrt(hidden) * |x| / M (small), so the LM
head's column for that dimension sets the next-token logits at the trigger's positions: the *script*.
Tokens that only scripts should produce have LM-head rows on the reserved dimensions alone, so their
logit is exactly 0 at every other position, below the best of the ~100 random logits there. Attention
and the MLPs stay random and dense: KV caches, masks and padding are exercised as usual.

The chain here: a prompt ending in ``STOP_AFTER[k]`` generates k more tokens, the last of them EOS
(k = 0: EOS first); a prompt ending in ``DIST_TRIGGER`` is followed by one of the ``FIRST`` tokens with
logits ``FIRST_LOGITS``, and each FIRST token by one of the ``SECOND`` tokens with logits that depend
on which FIRST token it was; every other position continues freely (random, greedy margins ordinary).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

HIDDEN = 64
M = 1000.0           # the trigger's component: |other components| ~ 1..10, so the others shrink ~100x
SCRIPT_LOGIT = 30.0  # a scripted certain next token beats the rest by ~30 nats

# Trigger characters (single tokens of the arithmetic tokenizer, never in its prompts).
STOP_AFTER = ["!", "$", "%", "&"]          # ending in STOP_AFTER[k]: k tokens then EOS
DIST_TRIGGER = "@"
FIRST = list("ABCDEFGH")                  # the first sampled token after DIST_TRIGGER
SECOND = list("KLMNOPQR")                 # the second, depending on the first
# Logits at DIST_TRIGGER: a geometric spread wide enough that temperature 1.5 and 1.0 give clearly
# different distributions (tests assert how far apart, in float64, from the model itself).
FIRST_LOGITS = [20.0 - 0.9 * j for j in range(len(FIRST))]


def _ids(tokenizer, chars):
    ids = tokenizer.convert_tokens_to_ids(list(chars))
    assert all(isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id for i in ids), chars
    return ids


def build(tokenizer, path: Path, *, seed: int = 0, layers: int = 2) -> tuple[Path, object]:
    """Saves the checkpoint (and tokenizer) under ``path``; returns (path, the float32 model)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=pad,
                         eos_token_id=eos, bos_token_id=pad)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    stop = _ids(tokenizer, STOP_AFTER)
    dist, first, second = _ids(tokenizer, DIST_TRIGGER)[0], _ids(tokenizer, FIRST), _ids(tokenizer, SECOND)
    # Reserved dimensions: one per chain link, one for DIST_TRIGGER, three for the FIRST tokens (a plane
    # for their angle, one for a common offset).
    d_stop = list(range(len(stop)))
    d_dist = len(stop)
    d_first = [d_dist + 1, d_dist + 2, d_dist + 3]
    reserved = d_stop + [d_dist] + d_first
    scripted_only = stop + [dist, eos] + first + second
    root_h = math.sqrt(HIDDEN)
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger than default init: logits spread over a few nats
            if p.dim() > 1:
                p.normal_(0, 0.15)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[reserved] = 0.0
            layer.mlp.down_proj.weight[reserved] = 0.0
        model.model.norm.weight[reserved] = 1.0
        embed[:, reserved] = 0.0
        head[:, reserved] = 0.0
        head[scripted_only] = 0.0
        # The stop chain: STOP_AFTER[k] -> STOP_AFTER[k-1] -> ... -> STOP_AFTER[0] -> EOS.
        for k, token in enumerate(stop):
            embed[token, d_stop[k]] = M
            head[eos if k == 0 else stop[k - 1], d_stop[k]] = SCRIPT_LOGIT / root_h
        # DIST_TRIGGER -> FIRST with FIRST_LOGITS.
        embed[dist, d_dist] = M
        for token, logit in zip(first, FIRST_LOGITS):
            head[token, d_dist] = logit / root_h
        # FIRST[j] sits at angle theta_j in a plane (plus an equal offset component, so the normalised
        # hidden state there is ~sqrt(hidden / 2) (cos theta_j, sin theta_j, 1)). SECOND[k]'s logit there
        # is 14 + 8 cos(phi_k - theta_j): each FIRST token is followed by its own mixture of SECOND tokens,
        # all far above the other tokens (~0).
        scale = math.sqrt(HIDDEN / 2)
        for j, token in enumerate(first):
            theta = math.pi / 2 * j / (len(first) - 1)
            embed[token, d_first] = torch.tensor([M * math.cos(theta), M * math.sin(theta), M])
        for k, token in enumerate(second):
            phi = math.pi / 2 * k / (len(second) - 1)
            head[token, d_first] = torch.tensor([8.0 * math.cos(phi), 8.0 * math.sin(phi), 14.0]) / scale
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=pad)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


def stop_prompt(prompt: list[int], tokenizer, k: int) -> list[int]:
    """``prompt`` made to end after exactly k generated tokens + EOS (greedy or sampled alike)."""
    return prompt + _ids(tokenizer, STOP_AFTER[k])


def dist_prompt(prompt: list[int], tokenizer) -> list[int]:
    return prompt + _ids(tokenizer, DIST_TRIGGER)
