"""Engines on a random-init tiny model: rollout bookkeeping, log-prob consistency, update scaling.

Comparisons of two computations that take different kernel paths (micro-batch sizes, chunks of the
vocabulary pass) run the model in float64, where the point is the algorithm: their tolerances come
from the summation bound of tests/numerics.py, not from a float32 run that happened to pass."""
import copy

import pytest
import torch

from kfrl.config import ActorConfig
from kfrl.data.synthetic import make_arith_rows
from kfrl.engines.actor import update_actor
from kfrl.engines.inference import compute_logprobs
from kfrl.engines.rollout import SamplingParams, truncate_at_eos
from kfrl.engines.rollout_hf import HFRollout
from kfrl.models.tiny import arith_corpus, build_tiny_model, build_tokenizer
from kfrl.trajectory import Trajectories
from numerics import float64_sum_tolerance, logprob_tolerance


@pytest.fixture(scope="module")
def tiny():
    rows = make_arith_rows(64, seed=0, split="train")
    tokenizer = build_tokenizer(arith_corpus(rows))
    torch.manual_seed(0)
    model = build_tiny_model(tokenizer, seed=0)
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:6]]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return model.eval(), tokenizer, prompts


def test_truncate_at_eos_includes_first_eos():
    tokens = torch.tensor([[5, 9, 2, 2], [5, 5, 5, 5], [2, 0, 0, 0]])
    lengths, stopped = truncate_at_eos(tokens, {2})
    assert lengths.tolist() == [3, 4, 1]
    assert stopped.tolist() == [True, False, True]


@pytest.mark.numerics
def test_rollout_shapes_order_and_logprobs_match_recompute(tiny):
    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model).to(torch.float64)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12)
    gens = HFRollout(model, tokenizer).generate_responses(prompts, params, seed=123)
    assert len(gens) == len(prompts) * 3
    eos = tokenizer.eos_token_id
    for g in gens:
        assert 1 <= len(g.response_ids) <= 12
        assert len(g.rollout_logprobs) == len(g.response_ids)
        assert (g.finish_reason == "stop") == (g.response_ids[-1] == eos)
        assert eos not in g.response_ids[:-1]
    # The actor's recomputed log-probs at the same temperature describe the same distribution.
    expanded = [p for p in prompts for _ in range(3)]
    responses = [g.response_ids for g in gens]
    trajectories = Trajectories.from_lists(expanded, responses, pad_id=tokenizer.pad_token_id)
    recomputed, entropy = compute_logprobs(model, trajectories, temperature=0.7, micro_batch_size=5,
                                           with_entropy=True)
    # Other micro-batches (5 rows here, the rollout's own pass all of them): float64 logits that agree
    # to ~1e-15, then float32 log-probs of the same scores.
    with torch.no_grad():
        largest = float(model(trajectories.input_ids, attention_mask=trajectories.attention_mask).logits.abs().max())
    tolerance = logprob_tolerance(largest / 0.7, len(tokenizer))
    for g, lp, ent in zip(gens, trajectories.unpad(recomputed), trajectories.unpad(entropy)):
        assert torch.allclose(torch.tensor(lp), torch.tensor(g.rollout_logprobs), atol=tolerance, rtol=0)
        assert all(e >= 0 for e in ent)
    # Same seed → same samples (a retried rollout reproduces its batch).
    again = HFRollout(model, tokenizer).generate_responses(prompts, params, seed=123)
    assert [g.response_ids for g in again] == responses


def _grads_after_update(model, data, micro, mini):
    model = copy.deepcopy(model).to(torch.float64)
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=micro, ppo_mini_batch_size=1, lr=1e-3)
    captured = {}

    class CaptureOptimizer(torch.optim.SGD):
        def step(self, closure=None):
            captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    opt = CaptureOptimizer(model.parameters(), lr=0.0)
    metrics = update_actor(model, opt, data, cfg, mini_batch_size=mini, temperature=1.0)
    return captured, metrics


# float64 gradients of two ways to cut one batch (or one vocabulary pass): each element is a sum over the
# batch's positions and the network's paths, of fewer than N = 10^4 terms here, summed in other orders;
# |difference| <= 2 gamma(N) sum|terms| (tests/numerics.py). The terms of the tiny model's gradient
# elements are at most ~1 in sum: an absolute bound of 2 gamma(10^4, 2^-53) ~ 2.2e-12, and elements
# with larger sums of terms are covered by the same bound relative to their size.
GRAD_ATOL = GRAD_RTOL = float64_sum_tolerance(10**4)


@pytest.mark.numerics
def test_micro_batch_scaling_is_exact_for_equal_lengths(tiny):
    model, tokenizer, prompts = tiny
    responses = [[7, 8, 9, 10]] * 6
    data = Trajectories.from_lists(prompts[:6], responses, [[1] * 4] * 6, pad_id=0, fields={
        "advantages": [[a] * 4 for a in (1.0, -1.0, 0.5, 2.0, -0.5, 0.0)]})
    big, _ = _grads_after_update(model, data, micro=6, mini=6)
    small, _ = _grads_after_update(model, data, micro=2, mini=6)
    assert big.keys() == small.keys() and all(g.dtype == torch.float64 for g in big.values())
    assert max(float(g.abs().max()) for g in big.values()) > 1e-3  # a gradient to compare
    for name in big:
        torch.testing.assert_close(small[name], big[name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


@pytest.mark.numerics
def test_update_changes_weights_in_direction_of_advantage(tiny):
    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model)
    response = [[7, 8, 9]]
    data = Trajectories.from_lists(prompts[:1], response, [[1, 1, 1]], pad_id=0,
                                   fields={"advantages": [[1.0, 1.0, 1.0]]})
    before, _ = compute_logprobs(model, data, temperature=1.0, micro_batch_size=1, with_entropy=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    update_actor(model, opt, data, ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1),
                 mini_batch_size=1, temperature=1.0)
    model.eval()
    after, _ = compute_logprobs(model, data, temperature=1.0, micro_batch_size=1, with_entropy=False)
    assert after[0].sum() > before[0].sum()


@pytest.mark.numerics
def test_chunked_log_probs_and_their_gradients_equal_the_whole_vocabulary_pass(tiny, monkeypatch):
    from kfrl.engines import inference

    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model).to(torch.float64).train()
    torch.manual_seed(1)
    responses = [torch.randint(3, tokenizer.vocab_size, (n,)).tolist() for n in (5, 9, 2, 7, 4, 8)]
    batch = Trajectories.from_lists(prompts, responses, pad_id=tokenizer.pad_token_id)

    def pass_with(chunk_elements):
        monkeypatch.setattr(inference, "LOGIT_CHUNK_ELEMENTS", chunk_elements)
        model.zero_grad(set_to_none=True)
        log_probs, entropy = inference.forward_response(model, batch, 0.7, True)
        (log_probs.sum() + 0.1 * entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return log_probs.detach(), entropy.detach(), grads

    whole = pass_with(2**40)
    vocab = model.get_output_embeddings().weight.shape[0]
    chunked = pass_with(vocab * 7)  # 7 positions per chunk, recomputed in the backward pass
    # Log-probs and entropies: the same float32 routines (the pass casts logits to float32) on float64
    # logits that agree to ~1e-15, so on float32 scores that differ at most by a rounding straddle.
    with torch.no_grad():
        largest = float(inference.response_logits(model, batch).abs().max()) / 0.7
    tolerance = logprob_tolerance(largest, vocab)
    torch.testing.assert_close(chunked[0], whole[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(chunked[1], whole[1], atol=tolerance, rtol=0)
    assert chunked[2].keys() == whole[2].keys()
    for name in whole[2]:
        torch.testing.assert_close(chunked[2][name], whole[2][name], atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


@pytest.mark.numerics
def test_padded_rows_give_each_row_s_own_log_probs_entropies_and_gradients(tiny):
    """The log-prob pass runs right-padded rows without a padding mask: each row's real tokens must see
    what they see alone, in the forward and the backward (float64; bounds of tests/numerics.py)."""
    from kfrl.engines.inference import forward_response, response_logits

    model, tokenizer, prompts = tiny
    model = copy.deepcopy(model).to(torch.float64)
    responses = [[7, 8, 9, 10, 11, 12, 13], [7], [9, 9, 9], [8, 7, 8, 7, 8], [10, 11], [12, 12, 12, 12]]
    batch = Trajectories.from_lists(prompts[:6], responses, pad_id=tokenizer.pad_token_id)
    assert len({len(p) + len(r) for p, r in zip(prompts[:6], responses)}) > 1  # rows of several lengths

    def grads_of(data):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = forward_response(model, data, 1.0, True)
        ((log_probs + entropy) * data.response_mask).sum().backward()
        return log_probs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_lp, padded_h, padded_grads = grads_of(batch)
    alone = [grads_of(batch.select(slice(i, i + 1)).trimmed()) for i in range(len(responses))]
    # The pass casts float64 logits to float32 for its log-softmax: float32 routines on scores that differ
    # at most by a rounding straddle (tests/numerics.py), as in the chunked-vocabulary test.
    with torch.no_grad():
        largest = float(response_logits(model, batch).abs().max())
    tolerance = logprob_tolerance(largest, model.get_output_embeddings().weight.shape[0])
    for i, (lp, h, _) in enumerate(alone):
        n = len(responses[i])
        torch.testing.assert_close(padded_lp[i, :n], lp[0, :n], atol=tolerance, rtol=0)
        torch.testing.assert_close(padded_h[i, :n], h[0, :n], atol=tolerance, rtol=0)
    for name, grad in padded_grads.items():
        summed = sum(g[name] for _, _, g in alone)
        torch.testing.assert_close(grad, summed, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)
