"""A reward model: a sequence-classification LM that scores a whole conversation (veRL's RM worker).

The conversation is rebuilt from the prompt's chat messages and the decoded response and
tokenized with the reward model's own chat template, so the policy and the reward model may use
different tokenizers. The score is the logit at the last token.
"""
from __future__ import annotations

import torch

from kfrl.engines import autocast
from kfrl.engines.inference import uncached


@torch.no_grad()
def reward_model_scores(model, tokenizer, conversations: list[list[dict]], *, micro_batch_size: int,
                        autocast_dtype=None) -> list[float]:
    device = next(model.parameters()).device
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    texts = [tokenizer.apply_chat_template(conv, tokenize=False) for conv in conversations]
    scores: list[float] = []
    for start in range(0, len(texts), micro_batch_size):
        encoded = tokenizer(texts[start:start + micro_batch_size], return_tensors="pt", padding=True,
                            padding_side="right", add_special_tokens=False).to(device)
        with autocast(device.type, autocast_dtype):
            logits = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"],
                           **uncached(model)).logits
        scores.extend(logits[:, 0].float().tolist())
    return scores
