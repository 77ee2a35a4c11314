"""veRL 0.9.1's gdpo and optimal_token_baseline: hand-derived numbers on small tensors, the Σπ² column
of the chunked inference pass, config validation, and both estimators end to end through the stages."""
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from kfrl.algos import advantage
from kfrl.config import ConfigError, load_config
from numerics import logprob_tolerance

# ---------------------------------------------------------------------------------------------
# numpy references, written from the formulas (not from veRL's code)
# ---------------------------------------------------------------------------------------------


def gdpo_reference(dims: np.ndarray, mask: np.ndarray, index: list, weights, eps: float = 1e-6) -> np.ndarray:
    """dims (bs, K). Per dimension: (x - group mean) / (unbiased group std + eps), a one-sample group
    has mean 0, std 1; weighted sum; on the valid tokens; whitened over them (unbiased var, +1e-8)."""
    bs, k_dims = dims.shape
    combined = np.zeros(bs)
    for k in range(k_dims):
        for i in range(bs):
            members = [j for j in range(bs) if index[j] == index[i]]
            values = dims[members, k]
            mean, std = (0.0, 1.0) if len(members) == 1 else (values.mean(), values.std(ddof=1))
            combined[i] += weights[k] * (dims[i, k] - mean) / (std + eps)
    per_token = combined[:, None] * mask
    valid = per_token[mask > 0]
    mean, var = valid.mean(), valid.var(ddof=1)
    return (per_token - mean) / np.sqrt(var + 1e-8) * mask


def otb_reference(rewards, mask, index, old_logprobs, sum_pi_squared, eps=1e-8, zero_tail=True):
    bs, length = rewards.shape
    returns = np.zeros_like(rewards)
    for i in range(bs):
        running = 0.0
        for t in reversed(range(length)):
            running += rewards[i, t] * mask[i, t]
            returns[i, t] = running
    w = 1 - 2 * np.exp(old_logprobs) + sum_pi_squared
    big_w = np.cumsum(w * mask, axis=1)
    baselines = np.zeros_like(rewards)
    for i in range(bs):
        members = [j for j in range(bs) if index[j] == index[i]]
        if len(members) == 1:
            continue
        for t in range(length):
            num = sum(returns[j, t] * big_w[j, t] * mask[j, t] for j in members)
            den = sum(big_w[j, t] * mask[j, t] for j in members) + eps
            baselines[i, t] = num / den
        if zero_tail:
            lengths = {j: mask[j].sum() for j in members}
            longest = max(lengths.values())
            if list(lengths.values()).count(longest) == 1 and lengths[i] == longest:
                second = max(v for j, v in lengths.items() if j != i)
                baselines[i, int(second):] = 0.0
    return (returns - baselines) * mask, returns


def outcome(scores, mask):
    """Token-level rewards: each score on the last valid token."""
    rewards = np.zeros_like(mask, dtype=np.float64)
    for i, s in enumerate(scores):
        rewards[i, np.nonzero(mask[i])[0][-1]] = s
    return rewards


T = lambda a: torch.tensor(np.asarray(a), dtype=torch.float32)  # noqa: E731

# float32 results against float64 references (atol/rtol 1e-5: inputs of <= 30 elements, gamma(30) ~ 1.8e-6 of
# their sums of |terms|), a float64 chunked pass, and end-to-end runs of the builtin model: also run under
# make test-portability.
pytestmark = pytest.mark.numerics

# Groups of 3, 2 and 1; sample 1 has a hole at position 1; lengths 4, 3, 2, 4, 1, 3.
MASK = np.array([[1, 1, 1, 1, 0],
                 [1, 0, 1, 1, 0],
                 [1, 1, 0, 0, 0],
                 [1, 1, 1, 1, 0],
                 [1, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0]], dtype=np.float64)
INDEX = ["a", "a", "a", "b", "b", "c"]


# ---------------------------------------------------------------------------------------------
# gdpo
# ---------------------------------------------------------------------------------------------


def test_gdpo_two_dimensions_groups_of_3_2_1_with_a_hole():
    dims = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 4.0], [3.0, 1.0], [3.0, 5.0], [2.0, 7.0]])
    weights = [1.0, 0.5]
    rewards = outcome(dims.sum(1), MASK)
    adv, ret = advantage("gdpo", T(rewards), T(MASK), index=INDEX, reward_dimensions=T(dims),
                         reward_weights=weights)
    expected = gdpo_reference(dims, MASK, INDEX, weights)
    torch.testing.assert_close(adv, T(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, adv)
    # By hand, before whitening: group b's first dimension is equal (3, 3) → 0; its second is
    # (1, 5): mean 3, std 2√2 → ∓1/√2, × 0.5 → ∓0.35355. The singleton c keeps 2 + 0.5·7 = 5.5 (mean 0,
    # std 1). Whitening is affine, so differences keep their ratio: (5.5 + 0.35355) / 0.70711 = 8.2782.
    ratio = (adv[5, 0] - adv[3, 0]) / (adv[4, 0] - adv[3, 0])
    assert abs(float(ratio) - 8.2782) < 1e-3
    assert adv[1, 1] == 0 and adv[0, 4] == 0  # the hole and the padding are 0


def test_gdpo_all_equal_rewards_give_zero_and_dimensions_are_not_summed_first():
    dims = np.array([[1.0, 5.0]] * 6)
    adv, _ = advantage("gdpo", T(outcome(dims.sum(1), MASK)), T(MASK), index=["a", "a", "a", "b", "b", "b"],
                       reward_dimensions=T(dims))
    assert torch.all(adv == 0)
    # A dominant dimension (×100) does not drown the other: each is normalised on its own, so
    # scaling one dimension leaves the advantages unchanged (GRPO on the sum would change).
    dims = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    index = ["a", "a", "a", "b", "b", "b"]
    base, _ = advantage("gdpo", T(outcome(dims.sum(1), MASK)), T(MASK), index=index, reward_dimensions=T(dims))
    scaled = dims * np.array([100.0, 1.0])
    again, _ = advantage("gdpo", T(outcome(scaled.sum(1), MASK)), T(MASK), index=index,
                         reward_dimensions=T(scaled))
    torch.testing.assert_close(again, base, atol=1e-4, rtol=1e-4)


def test_gdpo_without_dimensions_is_grpo_then_whitened():
    scores = np.array([1.0, 0.0, 2.0, 3.0, 1.0, 4.0])
    rewards = outcome(scores, MASK)
    adv, _ = advantage("gdpo", T(rewards), T(MASK), index=INDEX)
    torch.testing.assert_close(adv, T(gdpo_reference(scores[:, None], MASK, INDEX, [1.0])), atol=1e-5, rtol=1e-5)


def test_gdpo_config_and_single_float_reward_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match="algorithm.gdpo_reward_keys"):
        load_config(None, ["algorithm.adv_estimator=gdpo"])
    with pytest.raises(ConfigError, match="gdpo_reward_weights has 1 weight"):
        load_config(None, ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a,b]",
                           "algorithm.gdpo_reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match="norm_adv_by_std_in_grpo"):
        load_config(None, ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]",
                           "algorithm.norm_adv_by_std_in_grpo=false"])
    cfg = load_config(None, ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt,acc]"])
    assert cfg.algorithm.gdpo_reward_keys == ["fmt", "acc"] and cfg.algorithm.gdpo_reward_weights is None

    from kfrl.stages.advantage import reward_dimensions

    table = pa.table({"sample_id": ["s0", "s1"], "score": [1.0, 0.0], "acc": [1.0, 0.0],
                      "reward_extra": [json.dumps({"fmt": 0.5}), json.dumps({})]})
    assert reward_dimensions(table.slice(0, 1), ["fmt", "acc"]).tolist() == [[0.5, 1.0]]
    with pytest.raises(RuntimeError, match="'fmt'.*'s1'.*single number"):
        reward_dimensions(table, ["fmt"])


# ---------------------------------------------------------------------------------------------
# optimal_token_baseline
# ---------------------------------------------------------------------------------------------


def test_otb_by_hand_two_samples():
    # π = 0.5 and Σπ² = 0.5 everywhere: w = 1 - 1 + 0.5 = 0.5, W = [0.5, 1.0].
    mask = np.ones((2, 2))
    rewards = np.array([[0.0, 1.0], [0.0, 0.0]])
    lp, spp = np.log(np.full((2, 2), 0.5)), np.full((2, 2), 0.5)
    adv, ret = advantage("optimal_token_baseline", T(rewards), T(mask), index=[0, 0], old_logprobs=T(lp),
                         sum_pi_squared=T(spp))
    # G = [[1, 1], [0, 0]]; B_t = (1·W_t + 0) / (2 W_t + 1e-8) = 0.5.
    torch.testing.assert_close(ret, T([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, T([[0.5, 0.5], [-0.5, -0.5]]), atol=1e-6, rtol=0)
    # Zero tail: lengths 2 and 1; the longest's baseline is 0 from position 1 on.
    mask = np.array([[1.0, 1.0], [1.0, 0.0]])
    rewards = np.array([[0.0, 1.0], [2.0, 0.0]])
    adv, _ = advantage("optimal_token_baseline", T(rewards), T(mask), index=[0, 0], old_logprobs=T(lp),
                       sum_pi_squared=T(spp))
    # W = [[0.5, 1.0], [0.5, 0.5]], G = [[1, 1], [2, 0]]: B_0 = (0.5 + 1) / 1 = 1.5; B_1 of sample 0 → 0.
    torch.testing.assert_close(adv, T([[-0.5, 1.0], [0.5, 0.0]]), atol=1e-6, rtol=0)


def test_otb_groups_of_3_2_1_holes_ties_and_singletons():
    rng = np.random.default_rng(0)
    scores = np.array([1.0, 0.0, 2.0, 3.0, 1.0, 4.0])
    rewards = outcome(scores, MASK) + rng.normal(size=MASK.shape) * 0.1 * MASK  # process rewards too
    lp = np.log(rng.uniform(0.05, 1.0, size=MASK.shape))
    spp = rng.uniform(0.05, 1.0, size=MASK.shape)
    # Group a: lengths 4 (sample 0), 3 (sample 1 counts its valid tokens: 3), 2 → sample 0 alone is the
    # longest; group b: 4 and 1 → sample 3; singleton c: advantage = return.
    adv, ret = advantage("optimal_token_baseline", T(rewards), T(MASK), index=INDEX, old_logprobs=T(lp),
                         sum_pi_squared=T(spp))
    exp_adv, exp_ret = otb_reference(rewards, MASK, INDEX, lp, spp)
    torch.testing.assert_close(adv, T(exp_adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, T(exp_ret), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv[5], ret[5] * T(MASK[5]))
    # A tie for the longest: no zero tail.
    tie_index = ["a", "a", "b", "b", "b", "c"]  # group a: lengths 4 and 3; b: 3, 4, 1 → unique; change:
    tie_mask = MASK.copy()
    tie_mask[1] = [1, 1, 1, 1, 0]  # group a: 4 and 4
    adv, _ = advantage("optimal_token_baseline", T(rewards * tie_mask), T(tie_mask), index=tie_index,
                       old_logprobs=T(lp), sum_pi_squared=T(spp))
    exp_adv, _ = otb_reference(rewards * tie_mask, tie_mask, tie_index, lp, spp)
    torch.testing.assert_close(adv, T(exp_adv), atol=1e-5, rtol=1e-5)
    # All-equal returns in a group: baseline = that return, advantage 0 on the shared positions.
    same = np.ones((2, 3))
    adv, _ = advantage("optimal_token_baseline", T(outcome([2.0, 2.0], same)), T(same), index=[0, 0],
                       old_logprobs=T(lp[:2, :3]), sum_pi_squared=T(spp[:2, :3]))
    torch.testing.assert_close(adv, torch.zeros(2, 3), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sum_pi_squared"):
        advantage("optimal_token_baseline", T(rewards), T(MASK), index=INDEX, old_logprobs=T(lp))


# ---------------------------------------------------------------------------------------------
# Σπ² from the chunked inference pass
# ---------------------------------------------------------------------------------------------


def test_sum_pi_squared_chunked_equals_full_softmax(monkeypatch):
    from kfrl.data.synthetic import make_arith_rows
    from kfrl.engines import inference
    from kfrl.models.tiny import arith_corpus, build_tiny_model, build_tokenizer
    from kfrl.trajectory import Trajectories

    rows = make_arith_rows(16, seed=0, split="train")
    tokenizer = build_tokenizer(arith_corpus(rows))
    # float64: the chunked pass and the direct softmax take other kernel paths; the point is the algorithm.
    model = build_tiny_model(tokenizer, seed=0).to(torch.float64).eval()
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows[:4]]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    torch.manual_seed(1)
    responses = [torch.randint(3, tokenizer.vocab_size, (n,)).tolist() for n in (5, 9, 2, 7)]
    batch = Trajectories.from_lists(prompts, responses, pad_id=tokenizer.pad_token_id)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(inference, "LOGIT_CHUNK_ELEMENTS", vocab * 5)  # 5 positions per chunk
    log_probs, entropy, spp = inference.compute_token_stats(model, batch, temperature=0.7, micro_batch_size=3,
                                                            with_entropy=True, with_sum_pi_squared=True)
    with torch.no_grad():
        logits = inference.response_logits(model, batch).double() / 0.7
    direct = (torch.softmax(logits, dim=-1) ** 2).sum(-1)
    valid = batch.response_mask > 0
    # The pass computes in float32 from the (cast) float64 logits: log spp = lse(2s) - 2 lse(s), three
    # float32 log-sum-exps of scores up to 2 max|s|, each within half a logprob_tolerance (tests/numerics.py)
    # of its exact value; spp's relative error is that of its log.
    rtol = 3 * logprob_tolerance(2 * float(logits.abs().max()), vocab)
    torch.testing.assert_close(spp[valid].double(), direct[valid], atol=0, rtol=rtol)
    assert bool(((spp[valid] > 0) & (spp[valid] <= 1 + 1e-6)).all())
    plain, _ = inference.compute_logprobs(model, batch, temperature=0.7, micro_batch_size=3, with_entropy=False)
    torch.testing.assert_close(log_probs, plain)
    _, _, none = inference.compute_token_stats(model, batch, temperature=0.7, micro_batch_size=3, with_entropy=False)
    assert none is None


# ---------------------------------------------------------------------------------------------
# end to end: 2 iterations of the demo model through the stages
# ---------------------------------------------------------------------------------------------

SMALL = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "trainer.log_generations=0", "trainer.val_before_train=false",
         "pipeline.runner=inline", "trainer.test_freq=0", "data.builtin_val_size=8"]


def _train(tmp_path: Path, *extra):
    from kfrl.driver.controller import train

    config = load_config(Path("configs/demo.yaml"), SMALL + [f"store.uri={tmp_path / 'store'}",
                                                             f"tracking.uri=sqlite:///{tmp_path}/m.db", *extra])
    return config, train(config, run_id="e2e", iterations=2)


def _stored(run_uri: str, iteration: int, *groups):
    from kfrl.stages.context import StageContext
    from kfrl.trajectory import Trajectories

    table = StageContext.open(run_uri, iteration).read_groups(*groups)
    batch = Trajectories.from_table(table, pad_id=0, fields=("old_logprobs", "sum_pi_squared", "advantages",
                                                             "returns", "token_level_rewards"))
    return table, batch


def test_gdpo_end_to_end_advantages_equal_the_estimator_on_the_stored_batch(tmp_path):
    reward = tmp_path / "dims.py"
    reward.write_text(
        "def dims(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    accuracy = float(solution_str.strip().startswith(str(ground_truth)))\n"
        "    fmt = float(sum(map(ord, solution_str)) % 5) / 4\n"
        "    return {'score': accuracy + fmt, 'accuracy_reward': accuracy, 'format_reward': fmt}\n")
    keys, weights = ["format_reward", "accuracy_reward"], [0.5, 2.0]
    _, summary = _train(tmp_path, "algorithm.adv_estimator=gdpo", f"reward.custom_function_path={reward}",
                        "reward.custom_function_name=dims", "algorithm.gdpo_reward_keys=[format_reward,accuracy_reward]",
                        "algorithm.gdpo_reward_weights=[0.5,2.0]")
    for iteration in (1, 2):
        table, batch = _stored(summary.run_uri, iteration, "rollout", "score", "advantage")
        extras = [json.loads(e) for e in table.column("reward_extra").to_pylist()]
        dims = np.array([[e[k] for k in keys] for e in extras])
        mask = batch.response_mask.numpy().astype(np.float64)
        expected = gdpo_reference(dims, mask, table.column("uid").to_pylist(), weights)
        torch.testing.assert_close(batch.get("advantages"), T(expected), atol=1e-4, rtol=1e-4)
        assert float(batch.get("advantages").abs().sum()) > 0


def test_otb_end_to_end_old_logprob_runs_on_policy_and_advantages_match(tmp_path):
    from kfrl.run import Run
    from kfrl.stages import skip_reason

    config, summary = _train(tmp_path, "algorithm.adv_estimator=optimal_token_baseline")
    assert not config.recompute_old_logprobs  # on-policy: one mini-batch, one epoch …
    assert skip_reason("old_logprob", config) == ""  # … yet the pass runs for Σπ²
    run = Run.at(summary.run_uri)
    for iteration in (1, 2):
        assert not run.manifest("old_logprob", iteration).info.get("skipped")
        table, batch = _stored(summary.run_uri, iteration, "rollout", "score", "old_logprob", "advantage")
        assert "sum_pi_squared" in table.column_names
        # The estimator recomputed on the stored batch (float32, as stored and as veRL computes it).
        # A float64 reference is not used here: for confident tokens (π ≈ 1) w = 1 - 2π + Σπ² is a
        # cancellation of order 1e-7, so the baseline's weights carry float32 rounding (the formula's
        # numbers are checked against numpy by hand above).
        uids = table.column("uid").to_pylist()
        adv, ret = advantage("optimal_token_baseline", batch.get("token_level_rewards"), batch.response_mask,
                             index=uids, old_logprobs=batch.get("old_logprobs"),
                             sum_pi_squared=batch.get("sum_pi_squared"))
        torch.testing.assert_close(batch.get("advantages"), adv, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(batch.get("returns"), ret, atol=1e-6, rtol=1e-6)
        # Returns are the reward-to-go, and a group's advantages are not all equal to the returns.
        mask = batch.response_mask.numpy().astype(np.float64)
        _, exp_ret = otb_reference(batch.get("token_level_rewards").numpy().astype(np.float64), mask, uids,
                                   batch.get("old_logprobs").numpy().astype(np.float64),
                                   batch.get("sum_pi_squared").numpy().astype(np.float64))
        torch.testing.assert_close(ret, T(exp_ret), atol=1e-5, rtol=1e-5)
        spp = batch.get("sum_pi_squared")[batch.response_mask > 0]
        assert bool(((spp > 0) & (spp <= 1 + 1e-5)).all())
    # Without the estimator the column is absent and the on-policy old_logprob pass is skipped.
    grpo = load_config(Path("configs/demo.yaml"), SMALL)
    assert skip_reason("old_logprob", grpo) != ""
