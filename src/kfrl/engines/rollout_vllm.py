"""The ``vllm`` rollout backend: ``vllm.LLM`` with n-sampling, sampled-token log-probs and prefix
caching, for the cluster GPU image (the ``gpu`` extra).

One engine per process: the first call builds it from the policy checkpoint; later calls with a new
checkpoint load its safetensors into the running engine (``LLM.apply_model`` → the model's
``load_weights``) and reset the prefix cache, whose KV was computed with the old weights, instead
of building a new engine.

A LoRA run uses vLLM's own LoRA support, as veRL does: the engine holds the base (the run's initial
weights, never swapped) with ``enable_lora``, and each iteration's adapter commit (a PEFT folder) is
served through a ``LoRARequest``, so no merged model is written or loaded per iteration. Each new
adapter gets a new id: vLLM caches adapters by id, and a retried iteration's adapter differs from
the first attempt's.

vLLM cannot be installed on CI or on the benchmark GPU here, so this module is tested against a
small fake ``vllm`` (tests/fake_vllm); the GPU path is untested here.
"""
from __future__ import annotations

import functools
from pathlib import Path

from kfrl.engines.rollout import Generation, SamplingParams

_ENGINE: "VllmRollout | None" = None


def _load_checkpoint_into(model, files: list[str]) -> int:
    """Runs inside each vLLM worker: streams a checkpoint's tensors into the live model."""
    from safetensors.torch import load_file

    count = 0
    for file in files:
        tensors = load_file(file)
        count += len(tensors)
        model.load_weights(weights=tensors.items())
    return count


class VllmRollout:
    name = "vllm"

    def __init__(self, model_dir: str | Path, eos_ids: set[int], *, dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, seed: int = 0,
                 enforce_eager: bool = False, enable_prefix_caching: bool = True, max_lora_rank: int = 0):
        try:
            import vllm
        except ImportError as err:
            raise RuntimeError("rollout.name=vllm needs the vllm package (pip install 'kfrl[gpu]', or the kfrl GPU "
                               "image); use rollout.name=torch or hf where vLLM is not installed") from err
        self.model_dir = Path(model_dir)
        self.eos_ids = set(eos_ids)
        self.lora_request = None
        self._adapters_served = 0
        lora = {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1} if max_lora_rank else {}
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager,
                            enable_prefix_caching=enable_prefix_caching, skip_tokenizer_init=True,
                            # The log-prob of the sampled token after temperature (before top-k/top-p
                            # with their defaults), as the old-logprob stage recomputes it.
                            logprobs_mode="processed_logprobs", **lora)

    def load_weights(self, model_dir: str | Path) -> None:
        """Swaps the engine's weights for another checkpoint of the same architecture, in place."""
        model_dir = Path(model_dir)
        if model_dir == self.model_dir:
            return
        from kfrl.models.hf_io import safetensors_files

        files = [str(f) for f in safetensors_files(model_dir)]
        self.llm.apply_model(functools.partial(_load_checkpoint_into, files=files))
        self.llm.reset_prefix_cache()
        self.model_dir = model_dir

    def use_adapter(self, adapter_dir: str | Path | None) -> None:
        """Serve the PEFT adapter folder ``adapter_dir`` on the base from now on (None: the base alone)."""
        if adapter_dir is None:
            self.lora_request = None
            return
        if self.lora_request is not None and self.lora_request.lora_path == str(adapter_dir):
            return
        from vllm.lora.request import LoRARequest

        self._adapters_served += 1
        self.lora_request = LoRARequest(f"kfrl-adapter-{self._adapters_served}", self._adapters_served,
                                        str(adapter_dir))

    def generate_responses(self, prompts: list[list[int]], params: SamplingParams, *,
                           seed: int | None = None) -> list[Generation]:
        import vllm
        from vllm.inputs import TokensPrompt

        greedy = not params.do_sample
        sampling = vllm.SamplingParams(
            n=params.n, temperature=0.0 if greedy else params.temperature,
            top_p=1.0 if greedy else params.top_p, top_k=-1 if greedy or params.top_k <= 0 else params.top_k,
            max_tokens=params.max_new_tokens, logprobs=0, seed=seed, stop_token_ids=sorted(self.eos_ids),
            detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling,
                                    use_tqdm=False, lora_request=self.lora_request)
        by_request = {int(o.request_id) if str(o.request_id).isdigit() else i: o for i, o in enumerate(outputs)}
        generations: list[Generation] = []
        for index in range(len(prompts)):
            samples = sorted(by_request[index].outputs, key=lambda c: c.index)
            if len(samples) != params.n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {index}, expected {params.n}")
            for sample in samples:
                generations.append(_generation(sample, self.eos_ids))
        return generations


def _generation(sample, eos_ids: set[int]) -> Generation:
    tokens = list(sample.token_ids)
    logprobs = []
    for position, (token, entry) in enumerate(zip(tokens, sample.logprobs or [])):
        if token not in entry:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {token} at position {position}")
        logprobs.append(float(entry[token].logprob))
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens (logprobs=0 not honoured)")
    stopped = bool(tokens) and tokens[-1] in eos_ids
    return Generation(response_ids=tokens, rollout_logprobs=logprobs, finish_reason="stop" if stopped else "length")


def vllm_engine(model_dir: str | Path, eos_ids: set[int], *, adapter_dir: str | Path | None = None,
                **kwargs) -> VllmRollout:
    """The process's engine, built on first use and given ``model_dir``'s weights, serving the adapter
    in ``adapter_dir`` when one is given (the engine built with ``max_lora_rank``)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = VllmRollout(model_dir, eos_ids, **kwargs)
    else:
        _ENGINE.load_weights(model_dir)
        _ENGINE.eos_ids = set(eos_ids)
    _ENGINE.use_adapter(adapter_dir)
    return _ENGINE
