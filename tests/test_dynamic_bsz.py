"""actor.use_dynamic_bsz (veRL's dynamic batch size): micro-batches by token budget, each cut to its own
longest sequence. Per-sequence aggregation modes give the update the row-count micro-batches give."""
from __future__ import annotations

import copy

import pytest
import torch

from kfrl.config import load_config
from kfrl.engines.actor import update_actor
from kfrl.engines.minibatch import budget_micro_batches
from kfrl.stages.update import make_optimizer
from kfrl.trajectory import Trajectories
from numerics import float64_sum_tolerance, logprob_tolerance


def test_micro_batches_fit_the_budget_cover_every_row_once_and_go_longest_first():
    lengths = torch.tensor([5, 40, 12, 33, 7, 90, 20, 3])
    rows = torch.tensor([6, 0, 3, 1, 5, 7])  # a mini-batch: a subset, in shuffled order
    batches = budget_micro_batches(rows, lengths, budget=80)
    assert sorted(r for b in batches for r in b.tolist()) == sorted(rows.tolist())
    assert batches[0].tolist() == [5]  # 90 tokens: over the budget, alone
    for batch in batches:
        longest = max(int(lengths[r]) for r in batch)
        assert len(batch) == 1 or len(batch) * longest <= 80
    assert [b.tolist() for b in batches[1:]] == [[1, 3], [6, 0, 7]]  # 2 x 40; 20 + 5 + 3 -> 3 x 20


@pytest.fixture(scope="module")
def tiny():
    from kfrl.models.hf_io import load_causal_lm
    from kfrl.models.tiny import materialize_builtin

    return load_causal_lm(materialize_builtin("builtin:tiny-qwen2-arith"), dtype=torch.float64)


def batch_of_varied_lengths(vocab: int) -> Trajectories:
    g = torch.Generator().manual_seed(0)
    prompt_lengths, response_lengths = [3, 9, 5, 12, 4, 7, 6, 10], [14, 2, 9, 5, 16, 1, 11, 7]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in response_lengths]
    advantages = torch.randn(len(prompts), generator=g)
    fields = {"advantages": [[float(a)] * len(r) for a, r in zip(advantages, responses)],
              "old_logprobs": [[-2.0 - 0.1 * t for t in range(len(r))] for r in responses]}
    return Trajectories.from_lists(prompts, responses, pad_id=0, fields=fields)


# float64 (the builtin model loaded as such): the two ways of cutting the batch sum each gradient element's
# terms (fewer than 10^4 of them, summing to ~1 at most) in other orders; tests/numerics.py's bound.
GRAD_TOL = float64_sum_tolerance(10**4)


@pytest.mark.numerics
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_token_budget_gives_the_update_of_row_micro_batches_for_per_sequence_aggregation(tiny, agg):
    trajectories = batch_of_varied_lengths(tiny.config.vocab_size)
    updated = []
    for extra in (["actor.ppo_micro_batch_size_per_gpu=2"],
                  ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40"]):
        cfg = load_config(None, ["actor.lr=1e-2", f"actor.loss_agg_mode={agg}", "actor.entropy_coeff=0.01",
                                 "actor.grad_clip=1e9", *extra]).actor
        model = copy.deepcopy(tiny)
        optimizer = make_optimizer(model, cfg)
        grads = {}
        step = optimizer.step

        def capture_then_step(*args, model=model, grads=grads, step=step, **kwargs):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return step(*args, **kwargs)

        optimizer.step = capture_then_step
        metrics = update_actor(model, optimizer, trajectories, cfg, mini_batch_size=8, temperature=1.0, seed=0)
        updated.append(({n: p.detach() for n, p in model.named_parameters()}, metrics, grads))
    (count_state, count_metrics, count_grads), (budget_state, budget_metrics, budget_grads) = updated
    assert count_grads.keys() == budget_grads.keys() and count_grads
    for name, grad in count_grads.items():  # the gradient the micro-batching must preserve
        torch.testing.assert_close(budget_grads[name], grad, atol=GRAD_TOL, rtol=GRAD_TOL, msg=name)
    assert abs(count_metrics["actor/grad_norm"] - budget_metrics["actor/grad_norm"]) <= \
        GRAD_TOL * (1 + count_metrics["actor/grad_norm"])
    changed = max(float((count_state[k] - tiny.state_dict()[k]).abs().max()) for k in count_state)
    assert changed > 1e-4  # the step did something
    # One AdamW step (the first: m/sqrt(v) = g/|g|) moves a weight by lr g / (|g| + eps), whose change
    # with g is at most lr / (|g| + eps) times the change of g: the gradient bound carried through.
    lr, eps = cfg.lr, 1e-8
    assert optimizer.defaults["eps"] == eps
    assert count_state.keys() == count_grads.keys()  # every parameter had a gradient (tied ones once)
    for name, value in count_state.items():
        grad = count_grads[name]
        bound = lr * (GRAD_TOL * (1 + grad.abs())) / (grad.abs() + eps) + float64_sum_tolerance(4) * value.abs()
        assert bool(((value - budget_state[name]).abs() <= bound).all()), name


def test_trimming_keeps_every_real_token_and_only_drops_shared_padding():
    trajectories = batch_of_varied_lengths(300).select(torch.tensor([1, 5]))  # responses of 2 and 1 tokens
    trimmed = trajectories.trimmed()
    assert trimmed.input_ids.shape[1] == int(trajectories.attention_mask.sum(-1).max()) == 11
    assert trimmed.response_mask.shape[1] == 2 and trimmed.get("advantages").shape[1] == 2
    assert torch.equal(trimmed.input_ids, trajectories.input_ids[:, :11])
    assert int(trimmed.gather_positions.max()) < trimmed.input_ids.shape[1]


@pytest.mark.numerics
def test_log_probs_by_token_budget_equal_those_by_row_count(tiny):
    from kfrl.engines.inference import compute_token_stats

    trajectories = batch_of_varied_lengths(tiny.config.vocab_size)
    by_rows = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=True)
    by_tokens = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=True,
                                    token_budget=30)
    mask = trajectories.response_mask.bool()
    # float32 log-probs and entropies of float64 logits that agree to ~1e-15 (other micro-batches and
    # widths): equal but for a rounding straddle of the float32 cast (tests/numerics.py).
    with torch.no_grad():
        largest = float(tiny(trajectories.input_ids, attention_mask=trajectories.attention_mask).logits.abs().max())
    tolerance = logprob_tolerance(largest / 0.8, tiny.config.vocab_size)
    for a, b in zip(by_rows[:2], by_tokens[:2]):
        assert torch.allclose(a[mask].double(), b[mask].double(), atol=tolerance, rtol=0)
    assert by_tokens[2] is None
    # A budget below the longest sequence still computes it (alone).
    alone = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=False,
                                token_budget=1)
    assert torch.allclose(alone[0][mask].double(), by_rows[0][mask].double(), atol=tolerance, rtol=0)
