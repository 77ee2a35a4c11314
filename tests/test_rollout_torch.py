"""The ``torch`` rollout backend against the HF reference, on CPU in fp32 (and on CUDA when present).

Greedy responses must equal HF ``generate`` token for token; sampled-token log-probs must equal a
teacher-forced pass; sampling must follow softmax(logits / T) with top-k/top-p applied; the same seed
must give the same samples. Models: the builtin tiny Qwen2 (trained, so it ends answers with EOS) and
random-init Qwen2, Qwen3 and Llama (llama3 rotary scaling, attention biases) checkpoints.
"""
from __future__ import annotations

import json

import pytest
import torch

from kfrl.engines.decoder import Decoder, UnsupportedModelError
from kfrl.engines.inference import compute_logprobs
from kfrl.engines.rollout import SamplingParams, checkpoint_eos_ids, pad_token_id
from kfrl.engines.rollout_hf import HFRollout
from kfrl.engines.rollout_torch import TorchRollout, batch_buckets
from kfrl.engines.sampling import filtered_distribution, sample_tokens
from kfrl.trajectory import Trajectories


@pytest.fixture(scope="module")
def tiny_dir():
    from kfrl.models.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-qwen2-arith")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from kfrl.data.synthetic import make_arith_rows
    from kfrl.models.hf_io import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir, torch.float32).eval()
    rows = make_arith_rows(24, seed=3, split="test")
    prompts = [list(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for r in rows]
    # Ragged lengths: cut every third prompt short.
    prompts = [p[:8 + (i % 5) * 3] if i % 3 == 0 else p for i, p in enumerate(prompts)]
    return model, tokenizer, prompts


def torch_engine(model_dir, tokenizer, device="cpu", dtype=torch.float32, **kwargs) -> TorchRollout:
    eos = checkpoint_eos_ids(model_dir, tokenizer)
    return TorchRollout(Decoder.from_pretrained(model_dir, device=device, dtype=dtype), eos,
                        pad_token_id(tokenizer, eos), **kwargs)


def test_greedy_equals_hf_generate_with_ragged_prompts_eos_and_length(tiny, tiny_dir):
    model, tokenizer, prompts = tiny
    params = SamplingParams(n=2, max_new_tokens=12, do_sample=False)
    reference = HFRollout(model, tokenizer).generate_responses(prompts, params)
    engine = torch_engine(tiny_dir, tokenizer)
    ours = engine.generate_responses(prompts, params)
    assert [g.response_ids for g in ours] == [g.response_ids for g in reference]
    assert [g.finish_reason for g in ours] == [g.finish_reason for g in reference]
    # Both endings occur: answers that stop at EOS mid-batch, and prompts cut short that run to the limit.
    assert {"stop", "length"} <= {g.finish_reason for g in ours}
    for a, b in zip(ours, reference):
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-4
    # Finished sequences were compacted away rather than decoded to the end.
    assert engine.stats["compactions"] >= 1


def test_sampled_logprobs_equal_a_teacher_forced_pass(tiny, tiny_dir):
    model, tokenizer, prompts = tiny
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9)
    gens = torch_engine(tiny_dir, tokenizer).generate_responses(prompts, params, seed=11)
    expanded = [p for p in prompts for _ in range(3)]
    responses = [g.response_ids for g in gens]
    trajectories = Trajectories.from_lists(expanded, responses, pad_id=tokenizer.pad_token_id)
    recomputed = trajectories.unpad(compute_logprobs(model, trajectories, temperature=0.7, micro_batch_size=32,
                                                     with_entropy=False)[0])
    diff = max(max(abs(x - y) for x, y in zip(lp, g.rollout_logprobs)) for lp, g in zip(recomputed, gens))
    assert diff <= 1e-4
    eos = tokenizer.eos_token_id
    for g in gens:
        assert (g.finish_reason == "stop") == (g.response_ids[-1] == eos)
        assert eos not in g.response_ids[:-1]


def test_same_seed_same_samples_and_micro_batches_keep_order(tiny, tiny_dir):
    _, tokenizer, prompts = tiny
    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0)
    engine = torch_engine(tiny_dir, tokenizer)
    first = [g.response_ids for g in engine.generate_responses(prompts, params, seed=5)]
    assert first == [g.response_ids for g in engine.generate_responses(prompts, params, seed=5)]
    assert first != [g.response_ids for g in engine.generate_responses(prompts, params, seed=6)]
    # Prompt-major order holds across micro-batches (greedy, so the chunking cannot change tokens).
    greedy = SamplingParams(n=2, max_new_tokens=8, do_sample=False)
    whole = engine.generate_responses(prompts, greedy)
    chunked = torch_engine(tiny_dir, tokenizer, micro_batch_size=5).generate_responses(prompts, greedy)
    assert [g.response_ids for g in chunked] == [g.response_ids for g in whole]


def test_bucketed_compaction_with_filler_slots_matches_exact_compaction(tiny, tiny_dir):
    """The GPU path compacts into batch buckets and fills the rest with finished slots; on CPU it
    compacts exactly. Both must give the same greedy tokens."""
    _, tokenizer, prompts = tiny
    params = SamplingParams(n=3, max_new_tokens=12, do_sample=False)
    exact = torch_engine(tiny_dir, tokenizer).generate_responses(prompts, params)
    bucketed_engine = torch_engine(tiny_dir, tokenizer, bucketed=True)
    bucketed = bucketed_engine.generate_responses(prompts, params)
    assert [g.response_ids for g in bucketed] == [g.response_ids for g in exact]
    flat = [x for g in bucketed for x in g.rollout_logprobs]
    assert flat == pytest.approx([x for g in exact for x in g.rollout_logprobs], abs=1e-5)
    assert bucketed_engine.stats["compactions"] >= 1
    assert batch_buckets(72) == [72, 64, 48, 32, 24, 16, 8]


def _empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.6, top_k=12),
                                   dict(temperature=1.3, top_p=0.8), dict(temperature=0.9, top_k=30, top_p=0.7)])
def test_sampling_follows_the_filtered_distribution(knobs):
    torch.manual_seed(0)
    logits = torch.randn(64) * 2.0
    draws = 200_000
    tokens, logprobs = sample_tokens(logits.expand(draws, -1), **knobs)
    expected = filtered_distribution(logits[None], **knobs)[0]
    observed = _empirical(tokens, 64)
    # Chi-square over the kept tokens; nothing outside the kept set is ever drawn.
    assert observed[expected == 0].sum() == 0
    kept = expected > 0
    chi2 = float((draws * (observed[kept] - expected[kept]) ** 2 / expected[kept]).sum())
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5 + 10, (chi2, dof)
    # The reported log-prob is log_softmax(logits / T) of the drawn token, before truncation.
    scaled = torch.log_softmax(logits / knobs["temperature"], dim=-1)
    assert torch.allclose(logprobs, scaled[tokens], atol=1e-5)


@pytest.mark.parametrize("device, knobs", [
    ("cpu", dict(temperature=1.5, top_k=8, top_p=0.9)),
    pytest.param("cuda", dict(temperature=1.5), marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA device")),
    pytest.param("cuda", dict(temperature=1.5, top_k=8, top_p=0.9),
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_engine_samples_two_steps_from_the_models_distribution(tiny, tiny_dir, device, knobs):
    """Joint distribution of the first two sampled tokens for one prompt (prefill and one decode
    step) against the model's filtered next-token distributions; a TV distance, with a control
    that the test notices the wrong temperature. On CUDA plain temperature sampling runs the fused
    Triton sampler (top-k/top-p the PyTorch one)."""
    model, tokenizer, prompts = tiny
    prompt = prompts[1][:10]  # "<|im_start|>user\nWhat is 96 + ": the next two tokens are digits, uncertain
    n = 6000
    gens = torch_engine(tiny_dir, tokenizer, device=device).generate_responses(
        [prompt], SamplingParams(n=n, max_new_tokens=2, **knobs), seed=3)
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = filtered_distribution(model(torch.tensor([prompt])).logits[0, -1][None], **knobs)[0]
        support = torch.nonzero(first).squeeze(1)
        following = model(torch.tensor([prompt + [int(t)] for t in support])).logits[:, -1]
        second = filtered_distribution(following, **knobs)

    def joint(first_dist, second_dist):
        out = torch.zeros(vocab, vocab, dtype=torch.float64)
        out[support] = first_dist[support, None] * second_dist
        return out

    expected = joint(first, second)
    observed = torch.zeros(vocab, vocab, dtype=torch.float64)
    for g in gens:
        if len(g.response_ids) == 2:
            observed[g.response_ids[0], g.response_ids[1]] += 1
        else:  # the first token was EOS: the sequence ended there
            observed[g.response_ids[0], tokenizer.eos_token_id] += 1
    eos_rows = support == tokenizer.eos_token_id
    expected[support[eos_rows]] = 0
    expected[support[eos_rows], tokenizer.eos_token_id] = first[support[eos_rows]]
    observed /= n
    tv = 0.5 * float((observed - expected).abs().sum())
    assert tv < 0.05, tv
    with torch.no_grad():
        wrong_t = dict(knobs, temperature=1.0)
        wrong = joint(filtered_distribution(model(torch.tensor([prompt])).logits[0, -1][None], **wrong_t)[0],
                      filtered_distribution(following, **wrong_t))
    assert 0.5 * float((observed - wrong).abs().sum()) > tv + 0.03


def _random_checkpoint(tmp_path, family: str, tokenizer):
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    if family == "qwen3":
        config, cls = Qwen3Config(**common, head_dim=24, tie_word_embeddings=True), Qwen3ForCausalLM
    elif family == "llama":
        config = LlamaConfig(**common, attention_bias=True, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    else:
        config, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():  # larger than default init, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            else:
                p.normal_(1.0 if p.shape[0] in (64, 24) else 0.0, 0.1)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    path = tmp_path / family
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model.eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_other_families_greedy_equal_hf(tmp_path, tiny, family):
    _, tokenizer, prompts = tiny
    path, model = _random_checkpoint(tmp_path, family, tokenizer)
    params = SamplingParams(n=1, max_new_tokens=10, do_sample=False)
    reference = HFRollout(model, tokenizer).generate_responses(prompts, params)
    ours = torch_engine(path, tokenizer).generate_responses(prompts, params)
    assert [g.response_ids for g in ours] == [g.response_ids for g in reference]
    for a, b in zip(ours, reference):
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-4
    # The decoder built from the live model's parameters is the same model.
    live = TorchRollout(Decoder.from_hf_model(model), {tokenizer.eos_token_id}, tokenizer.pad_token_id)
    assert [g.response_ids for g in live.generate_responses(prompts, params)] == [g.response_ids for g in ours]


def test_unsupported_architecture_is_refused_with_the_way_out(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2,
        "vocab_size": 50}))
    with pytest.raises(UnsupportedModelError, match=r"GPT2LMHeadModel.*rollout\.name=hf"):
        Decoder.from_pretrained(tmp_path)


# --- CUDA: the graph-captured path ------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_graphs_give_the_eager_result(tmp_path, tiny, tiny_dir):
    _, tokenizer, prompts = tiny
    # The trained tiny model ends its answers early (compaction); a random one runs on (length buckets).
    random_dir, _ = _random_checkpoint(tmp_path, "qwen2", tokenizer)
    for model_dir, max_new in ((tiny_dir, 40), (random_dir, 140)):
        params = SamplingParams(n=4, max_new_tokens=max_new, do_sample=False)
        graphed = torch_engine(model_dir, tokenizer, device="cuda", dtype=torch.bfloat16)
        eager = torch_engine(model_dir, tokenizer, device="cuda", dtype=torch.bfloat16, use_cuda_graphs=False)
        a = graphed.generate_responses(prompts, params)
        assert [g.response_ids for g in a] == [g.response_ids for g in eager.generate_responses(prompts, params)]
        assert graphed.stats["graphs_captured"] >= 1
        sampled = SamplingParams(n=4, max_new_tokens=max_new, temperature=0.8)
        first = [g.response_ids for g in graphed.generate_responses(prompts, sampled, seed=1)]
        assert first == [g.response_ids for g in graphed.generate_responses(prompts, sampled, seed=1)]
    assert graphed.stats["graphs_captured"] >= 3  # 140 tokens: three 64-column length buckets


@pytest.mark.gpu
@cuda
def test_cuda_bf16_logprobs_match_teacher_forced(tiny, tiny_dir):
    from kfrl.models.hf_io import load_causal_lm

    _, tokenizer, prompts = tiny
    model = load_causal_lm(tiny_dir, torch.bfloat16, device="cuda").eval()
    params = SamplingParams(n=4, max_new_tokens=16, temperature=1.0)
    gens = torch_engine(tiny_dir, tokenizer, device="cuda", dtype=torch.bfloat16).generate_responses(
        prompts, params, seed=2)
    expanded = [p for p in prompts for _ in range(4)]
    responses = [g.response_ids for g in gens]
    trajectories = Trajectories.from_lists(expanded, responses, pad_id=tokenizer.pad_token_id)
    recomputed = trajectories.unpad(compute_logprobs(model, trajectories, temperature=1.0, micro_batch_size=64,
                                                     with_entropy=False)[0])
    diffs = torch.tensor([abs(x - y) for lp, g in zip(recomputed, gens) for x, y in zip(lp, g.rollout_logprobs)])
    assert float(diffs.mean()) < 0.02 and float(diffs.max()) < 0.2


def test_demo_config_trains_with_the_torch_backend(tmp_path):
    """configs/demo.yaml with rollout.name=torch: rollout, validation and the rest of two iterations."""
    from pathlib import Path

    from kfrl.config import load_config
    from kfrl.stages import STAGES, run_stage
    from kfrl.stages.context import StageContext
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    demo = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    config = load_config(demo, ["rollout.name=torch", "trainer.total_iterations=2", "data.train_batch_size=8",
                                "actor.ppo_mini_batch_size=4"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, config)
    results = {}
    for iteration in (1, 2):
        for stage in STAGES:
            results[(iteration, stage)] = run_stage(stage, store.uri, iteration)
    ctx = StageContext.open(store.uri, 2)
    assert ctx.manifest("rollout").info["rollout_backend"] == "torch"
    rollout_metrics = results[(2, "rollout")].metrics
    assert 1 <= rollout_metrics["response_length/mean"] <= 16
    assert 0 < rollout_metrics["timing_s/generate_sequences"] < rollout_metrics["timing_s/gen"]
    assert 0.0 <= results[(2, "score")].metrics["critic/score/mean"] <= 1.0
    assert "val-core/kfrl/arith/acc/mean@1" in results[(2, "validate")].metrics
    assert results[(2, "update_actor")].metrics["actor/pg_loss"] == results[(2, "update_actor")].metrics["actor/pg_loss"]


def test_auto_backend_is_torch_on_cuda_for_supported_checkpoints(tmp_path, tiny_dir):
    from kfrl.engines.rollout import resolve_backend

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert resolve_backend("auto", "cuda", tiny_dir) == "torch"
    assert resolve_backend("auto", "cpu", tiny_dir) == "hf"
    assert resolve_backend("auto", "cuda", gpt2) == "hf"
    assert resolve_backend("torch", "cpu", tiny_dir) == "torch"
