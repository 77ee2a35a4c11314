"""A stand-in for the parts of vLLM's offline API that kfrl's vllm backend calls (``LLM``,
``SamplingParams``, ``inputs.TokensPrompt``, ``lora.request.LoRARequest``), recording every call so
tests can check the request kfrl builds and how it maps the answers. Generation is a deterministic
function of the prompt and the sample index; completions come back in reverse sample order, as
nothing in vLLM promises an order within a request."""
from __future__ import annotations

from dataclasses import dataclass

INSTANCES: list["LLM"] = []


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    logprobs: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    detokenize: bool = True


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class FakeModel:
    def __init__(self):
        self.loaded: list[str] = []

    def load_weights(self, weights):
        names = [name for name, _ in weights]
        self.loaded.extend(names)
        return set(names)


class LLM:
    def __init__(self, model: str, **kwargs):
        self.model = model
        self.kwargs = kwargs
        self.requests: list[tuple[list, SamplingParams]] = []
        self.lora_requests: list = []  # the LoRARequest (or None) of each generate call
        self.worker_model = FakeModel()
        self.prefix_cache_resets = 0
        INSTANCES.append(self)

    def generate(self, prompts, sampling_params: SamplingParams, use_tqdm: bool = True, lora_request=None):
        self.requests.append((prompts, sampling_params))
        self.lora_requests.append(lora_request)
        outputs = []
        for request, prompt in enumerate(prompts):
            ids = prompt["prompt_token_ids"]
            completions = []
            for k in range(sampling_params.n):
                tokens, logprobs = [], []
                for t in range(sampling_params.max_tokens):
                    token = (sum(ids) + 7 * k + 3 * t + (sampling_params.seed or 0)) % 40 + 3
                    tokens.append(token)
                    # The sampled token's entry, plus a neighbour's (as logprobs=0 may still return the top-1).
                    logprobs.append({token: Logprob(-0.01 * (t + 1) - 0.1 * k, rank=1), token + 100: Logprob(-9.0)})
                    if token in (sampling_params.stop_token_ids or []):
                        break
                finish = "stop" if tokens[-1] in (sampling_params.stop_token_ids or []) else "length"
                completions.append(CompletionOutput(k, "", tokens, None, logprobs, finish))
            outputs.append(RequestOutput(str(request), ids, list(reversed(completions))))
        return outputs

    def apply_model(self, func):
        return [func(self.worker_model)]

    def reset_prefix_cache(self):
        self.prefix_cache_resets += 1
        return True
