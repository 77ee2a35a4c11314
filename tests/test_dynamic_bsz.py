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


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_a_token_budget_gives_the_update_of_row_micro_batches_for_per_sequence_aggregation(tiny, agg):
    trajectories = batch_of_varied_lengths(tiny.config.vocab_size)
    updated = []
    for extra in (["actor.ppo_micro_batch_size_per_gpu=2"],
                  ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40"]):
        cfg = load_config(None, ["actor.lr=1e-2", f"actor.loss_agg_mode={agg}", "actor.entropy_coeff=0.01",
                                 "actor.grad_clip=1e9", *extra]).actor
        model = copy.deepcopy(tiny)
        metrics = update_actor(model, make_optimizer(model, cfg), trajectories, cfg, mini_batch_size=8,
                               temperature=1.0, seed=0)
        updated.append((model.state_dict(), metrics))
    (count_state, count_metrics), (budget_state, budget_metrics) = updated
    assert abs(count_metrics["actor/grad_norm"] - budget_metrics["actor/grad_norm"]) < 1e-9
    changed = max(float((count_state[k] - tiny.state_dict()[k]).abs().max()) for k in count_state)
    assert changed > 1e-4  # the step did something
    for name, value in count_state.items():
        assert torch.allclose(value, budget_state[name], atol=1e-10), name


def test_trimming_keeps_every_real_token_and_only_drops_shared_padding():
    trajectories = batch_of_varied_lengths(300).select(torch.tensor([1, 5]))  # responses of 2 and 1 tokens
    trimmed = trajectories.trimmed()
    assert trimmed.input_ids.shape[1] == int(trajectories.attention_mask.sum(-1).max()) == 11
    assert trimmed.response_mask.shape[1] == 2 and trimmed.get("advantages").shape[1] == 2
    assert torch.equal(trimmed.input_ids, trajectories.input_ids[:, :11])
    assert int(trimmed.gather_positions.max()) < trimmed.input_ids.shape[1]


def test_log_probs_by_token_budget_equal_those_by_row_count(tiny):
    from kfrl.engines.inference import compute_token_stats

    trajectories = batch_of_varied_lengths(tiny.config.vocab_size)
    by_rows = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=True)
    by_tokens = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=True,
                                    token_budget=30)
    mask = trajectories.response_mask.bool()
    for a, b in zip(by_rows[:2], by_tokens[:2]):
        assert torch.allclose(a[mask].double(), b[mask].double(), atol=1e-6)
    assert by_tokens[2] is None
    # A budget below the longest sequence still computes it (alone).
    alone = compute_token_stats(tiny, trajectories, temperature=0.8, micro_batch_size=3, with_entropy=False,
                                token_budget=1)
    assert torch.allclose(alone[0][mask].double(), by_rows[0][mask].double(), atol=1e-6)
