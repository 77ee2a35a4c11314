"""The ``hf`` rollout backend: transformers ``generate``, the reference every other backend is
checked against (any causal LM transformers can load)."""
from __future__ import annotations

import torch

from kfrl.engines.rollout import (Generation, SamplingParams, eos_token_ids, left_pad, pad_token_id,
                                  truncate_at_eos)


class HFRollout:
    """``model.generate`` on left-padded prompts, then one teacher-forced pass for the log-probs.

    Asking ``generate`` for per-step logits would keep (sequences, steps, vocab) in memory: 37 GiB
    for 256 x 256 tokens of a 152k vocabulary. The extra forward pass costs ~1 s for that batch on
    an H200 and gives log-probs computed exactly as the old-logprob stage computes them.
    """
    name = "hf"

    def __init__(self, model, tokenizer, *, micro_batch_size: int = 0, logprob_micro_batch_size: int = 64,
                 cache_implementation: str = "dynamic", eos_ids: set[int] | None = None):
        self.model = model
        self.eos_ids = eos_ids or eos_token_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        self.micro_batch_size = micro_batch_size
        self.logprob_micro_batch_size = logprob_micro_batch_size
        self.cache_implementation = cache_implementation

    @torch.no_grad()
    def generate_responses(self, prompts: list[list[int]], params: SamplingParams, *,
                           seed: int | None = None) -> list[Generation]:
        from kfrl.engines.inference import compute_logprobs
        from kfrl.trajectory import Trajectories

        model = self.model
        device = next(model.parameters()).device
        expanded = [p for p in prompts for _ in range(params.n)]
        step = self.micro_batch_size * params.n if self.micro_batch_size > 0 else len(expanded)
        responses: list[list[int]] = []
        stopped_flags: list[bool] = []
        for start in range(0, len(expanded), step):
            chunk = expanded[start:start + step]
            if seed is not None:
                torch.manual_seed(seed + start)
            input_ids, attention_mask = left_pad(chunk, self.pad_id, device)
            gen_kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=params.do_sample,
                              pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
            if self.cache_implementation != "dynamic":
                gen_kwargs["cache_implementation"] = self.cache_implementation
            if params.do_sample:
                # top_k=0, not None: transformers fills an unset top_k with 50.
                gen_kwargs.update(temperature=params.temperature, top_p=params.top_p,
                                  top_k=max(params.top_k, 0))
            sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen_kwargs)
            new_tokens = sequences[:, input_ids.shape[1]:]
            lengths, stopped = truncate_at_eos(new_tokens, self.eos_ids)
            for row in range(new_tokens.shape[0]):
                responses.append(new_tokens[row, :int(lengths[row])].tolist())
                stopped_flags.append(bool(stopped[row]))
        trajectories = Trajectories.from_lists(expanded, responses, pad_id=self.pad_id)
        logprobs, _ = compute_logprobs(model, trajectories, temperature=params.temperature if params.do_sample else 1.0,
                                       micro_batch_size=self.logprob_micro_batch_size, with_entropy=False)
        return [Generation(response_ids=r, rollout_logprobs=lp, finish_reason="stop" if stop else "length")
                for r, lp, stop in zip(responses, trajectories.unpad(logprobs), stopped_flags)]
