"""The vllm backend's glue, against the fake ``vllm`` in tests/fake_vllm (vLLM itself cannot be
installed on CI or on the benchmark GPU): the request kfrl builds, the order and log-probs of what it
returns, and the weight swap that reuses one engine across iterations."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kfrl.engines import rollout_vllm
from kfrl.engines.rollout import SamplingParams

FAKE = Path(__file__).resolve().parent / "fake_vllm"


@pytest.fixture
def vllm(monkeypatch):
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.setattr(rollout_vllm, "_ENGINE", None)
    import vllm as fake

    fake.INSTANCES.clear()
    yield fake
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def checkpoint(path: Path, names: list[str]) -> Path:
    path.mkdir(parents=True)
    save_file({n: torch.ones(2) for n in names}, str(path / "model.safetensors"))
    return path


def expected_tokens(prompt: list[int], k: int, max_tokens: int, seed: int, eos: set[int]) -> list[int]:
    """What the fake generates for sample k of a prompt (its formula), cut after the first EOS."""
    out = []
    for t in range(max_tokens):
        out.append((sum(prompt) + 7 * k + 3 * t + seed) % 40 + 3)
        if out[-1] in eos:
            break
    return out


def test_request_shape_order_and_logprob_mapping(vllm, tmp_path):
    model = checkpoint(tmp_path / "policy", ["w"])
    engine = rollout_vllm.VllmRollout(model, {5, 9}, gpu_memory_utilization=0.4, max_model_len=1024, seed=3)
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=-1, max_new_tokens=6)
    gens = engine.generate_responses(prompts, params, seed=11)

    llm = vllm.INSTANCES[0]
    assert llm.model == str(model)
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["enable_prefix_caching"] is True and llm.kwargs["skip_tokenizer_init"] is True
    assert llm.kwargs["gpu_memory_utilization"] == 0.4 and llm.kwargs["max_model_len"] == 1024
    sent_prompts, sent = llm.requests[0]
    assert sent_prompts == [{"prompt_token_ids": p} for p in prompts]
    assert (sent.n, sent.temperature, sent.top_p, sent.top_k, sent.max_tokens) == (3, 0.7, 0.9, -1, 6)
    assert (sent.logprobs, sent.seed, sent.stop_token_ids, sent.detokenize) == (0, 11, [5, 9], False)

    # Prompt-major, sample k at p * n + k, whatever order vLLM returns the samples in.
    assert len(gens) == 9
    for p, prompt in enumerate(prompts):
        for k in range(3):
            g = gens[p * 3 + k]
            assert g.response_ids == expected_tokens(prompt, k, 6, 11, {5, 9})
            assert g.rollout_logprobs == pytest.approx([-0.01 * (t + 1) - 0.1 * k for t in range(len(g.response_ids))])
            assert g.finish_reason == ("stop" if g.response_ids[-1] in (5, 9) else "length")
    assert {"stop", "length"} == {g.finish_reason for g in gens}


def test_greedy_and_top_k_requests(vllm, tmp_path):
    engine = rollout_vllm.VllmRollout(checkpoint(tmp_path / "policy", ["w"]), {2})
    engine.generate_responses([[1]], SamplingParams(n=1, do_sample=False, temperature=0.7, top_k=5, max_new_tokens=3))
    engine.generate_responses([[1]], SamplingParams(n=2, top_k=5, max_new_tokens=3))
    greedy, sampled = (r[1] for r in vllm.INSTANCES[0].requests)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0.0, -1, 1.0)
    assert (sampled.temperature, sampled.top_k) == (1.0, 5)


def test_one_engine_per_process_with_weights_swapped_in_place(vllm, tmp_path):
    first = checkpoint(tmp_path / "iter-0", ["model.embed_tokens.weight"])
    second = checkpoint(tmp_path / "iter-1", ["model.embed_tokens.weight", "model.norm.weight"])
    engine = rollout_vllm.vllm_engine(first, {2})
    assert rollout_vllm.vllm_engine(second, {2}) is engine
    assert len(vllm.INSTANCES) == 1
    llm = vllm.INSTANCES[0]
    assert sorted(llm.worker_model.loaded) == ["model.embed_tokens.weight", "model.norm.weight"]
    # KV computed with the old weights must not be reused.
    assert llm.prefix_cache_resets == 1
    rollout_vllm.vllm_engine(second, {2})
    assert llm.prefix_cache_resets == 1 and len(llm.worker_model.loaded) == 2


def test_missing_logprob_is_an_error(vllm, tmp_path):
    engine = rollout_vllm.VllmRollout(checkpoint(tmp_path / "policy", ["w"]), {2})
    llm = vllm.INSTANCES[0]
    real = llm.generate

    def without_logprobs(prompts, params, use_tqdm=True, **kwargs):
        outputs = real(prompts, params, use_tqdm, **kwargs)
        outputs[0].outputs[0].logprobs = [{}] * len(outputs[0].outputs[0].token_ids)
        return outputs

    llm.generate = without_logprobs
    with pytest.raises(RuntimeError, match="no log-prob for sampled token"):
        engine.generate_responses([[1, 2]], SamplingParams(n=1, max_new_tokens=2))


def test_rollout_stage_runs_on_the_vllm_backend(vllm, tmp_path):
    from kfrl import batch
    from kfrl.config import load_config
    from kfrl.stages import run_stage
    from kfrl.stages.context import StageContext
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    config = load_config(None, ["model.path=builtin:tiny-qwen2-arith", "rollout.name=vllm", "rollout.n=2",
                                "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                "data.max_response_length=8", "trainer.device=cpu"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, config)
    run_stage("rollout", store.uri, 1)
    ctx = StageContext.open(store.uri, 1)
    manifest = ctx.manifest("rollout")
    assert manifest.info["rollout_backend"] == "vllm"
    table = batch.read_group(ctx.store, manifest, "rollout")
    llm = vllm.INSTANCES[0]
    prompts, params = llm.requests[0]
    assert params.n == 2 and params.max_tokens == 8 and len(prompts) == 4
    responses = table.column("response_ids").to_pylist()
    for p, prompt in enumerate(prompts):
        for k in range(2):
            assert responses[p * 2 + k] == expected_tokens(prompt["prompt_token_ids"], k, 8, params.seed,
                                                            set(params.stop_token_ids))
    assert table.column("prompt_ids").to_pylist()[::2] == [p["prompt_token_ids"] for p in prompts]


def test_a_lora_run_serves_each_adapter_commit_on_the_base_through_vllms_lora_support(vllm, tmp_path):
    from kfrl.driver.controller import train
    from kfrl.run import Run
    from run_tables import demo_config, forget_process_state

    forget_process_state()
    config = demo_config(tmp_path, "model.lora_rank=4", "model.lora_alpha=8", "rollout.name=vllm",
                         "trainer.device=cpu", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                         "data.max_response_length=8", "trainer.log_generations=0", "trainer.val_before_train=false",
                         "pipeline.runner=inline", "trainer.test_freq=-1")
    run = Run.at(train(config, run_id="v", iterations=3).run_uri)
    assert len(vllm.INSTANCES) == 1  # one engine, built once from the base and never given other weights
    llm = vllm.INSTANCES[0]
    base = run.store.committed_dir(run.manifest("update_actor", 0))
    assert Path(llm.model) == base and llm.worker_model.loaded == []
    assert (llm.kwargs["enable_lora"], llm.kwargs["max_lora_rank"]) == (True, 4)
    first, *later = llm.lora_requests
    assert first is None  # iteration 1 samples the initial weights: the base alone
    for iteration, request in enumerate(later, start=1):
        adapter = run.store.committed_dir(run.manifest("update_actor", iteration))
        assert Path(request.lora_path) == adapter and (adapter / "adapter_config.json").is_file()
        assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    assert [request.lora_int_id for request in later] == [1, 2]  # a new id per adapter: vLLM caches by id
    assert len({request.lora_name for request in later}) == 2
