"""The algorithm suite wired into the stages: every ready config runs on the demo model, stored
advantages equal kfrl.algos on the stored batch, and the per-algorithm machinery (critic and
warm-up, KL in the reward and its controller, DAPO's dynamic sampling and overlong shaping, ReMax's
greedy baseline) does what veRL does."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kfrl import batch
from kfrl.algos import advantage as algos_advantage
from kfrl.algos import kl_penalty
from kfrl.config import ConfigError, load_config
from kfrl.stages import STAGES, plan, run_stage
from kfrl.run import stage_prefix
from kfrl.stages.context import StageContext
from kfrl.stages.prepare import prepare_run
from kfrl.store import Store

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
READY = ["ppo", "grpo", "drgrpo", "dapo", "rloo", "reinforce_pp", "remax"]
# Small enough for 2 CPU cores; everything else (the algorithm) comes from the ready config.
SMALL = ["model.path=builtin:tiny-qwen2-arith", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
         "rollout.n=4", "data.max_prompt_length=64", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8"]


@pytest.fixture(scope="module")
def tiny_model_dir():
    from kfrl.models.tiny import materialize_builtin

    return materialize_builtin("builtin:tiny-qwen2-arith")


def run_iterations(config, root: Path, iterations: int) -> StageContext:
    """Prepare a run and execute its stages in DAG order, as the inline runner does."""
    store = Store(str(root / "run"))
    prepare_run(store, config)
    for iteration in range(1, iterations + 1):
        for stage in STAGES:
            run_stage(stage, store.uri, iteration)
    return StageContext.open(store.uri, iterations)


def metrics_of(ctx: StageContext, stage: str, iteration: int) -> dict:
    return dict(ctx.store.manifest(stage_prefix(iteration, stage)).metrics)


def padded(table, column):
    return batch.to_torch_padded(table, column).float()


@pytest.mark.parametrize("name", READY)
def test_ready_config_runs_on_demo_model_and_stores_algos_advantages(name, tmp_path):
    extra = ["data.gen_batch_size=4", "reward.overlong_buffer.len=4"] if name == "dapo" else []
    config = load_config(CONFIGS / f"{name}.yaml", SMALL + extra)
    ctx = run_iterations(config, tmp_path, 1)

    for stage, reason in plan(config).items():
        manifest = ctx.store.manifest(stage_prefix(1, stage))
        assert manifest is not None, stage
        assert manifest.info.get("skipped", "") == reason, stage
    table = ctx.read_groups("rollout", "score", "old_logprob", "ref_logprob", "values", "gen_max", "advantage")
    assert table.num_rows == 4 * 4
    mask = padded(table, "response_mask")
    rewards = padded(table, "token_level_rewards")
    values = padded(table, "values") if "values" in table.column_names else None
    baselines = (torch.tensor(table.column("reward_baselines").to_pylist())
                 if "reward_baselines" in table.column_names else None)
    algo = config.algorithm
    expected_adv, expected_ret = algos_advantage(
        algo.adv_estimator, rewards, mask, index=table.column("uid").to_pylist(), values=values,
        reward_baselines=baselines, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std_in_grpo)
    valid = mask.bool()
    torch.testing.assert_close(padded(table, "advantages")[valid], expected_adv[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded(table, "returns")[valid], expected_ret[valid], atol=1e-5, rtol=1e-5)
    # The outcome score sits at the last response token (plus the KL penalty where configured).
    if not algo.use_kl_in_reward:
        torch.testing.assert_close(rewards.sum(-1), torch.tensor(table.column("score").to_pylist()))
    update = metrics_of(ctx, "update_actor", 1)
    assert np.isfinite(update["actor/pg_loss"]) and update["actor/grad_norm"] >= 0


def test_ppo_critic_values_gae_and_critic_metrics(tmp_path):
    config = load_config(CONFIGS / "ppo.yaml", SMALL + ["critic.lr=1e-3"])
    ctx = run_iterations(config, tmp_path, 2)
    adv_metrics = metrics_of(ctx, "advantage", 2)
    critic = metrics_of(ctx, "update_critic", 2)
    for key in ("critic/values/mean", "critic/vf_explained_var", "critic/advantages/mean", "critic/returns/mean"):
        assert key in adv_metrics, key
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr"):
        assert key in critic, key
    # Values are zero where the response mask is; GAE returns with gamma = lam = 1 are the outcome score.
    table = ctx.read_groups("rollout", "values", "advantage", "score")
    values = padded(table, "values")
    mask = padded(table, "response_mask")
    assert torch.all(values[~mask.bool()] == 0)
    returns = padded(table, "returns")
    first = torch.tensor([r[0] for r in table.column("returns").to_pylist()])
    torch.testing.assert_close(first, torch.tensor(table.column("score").to_pylist()), atol=1e-5, rtol=0)
    assert returns.shape == values.shape
    # The critic really trained: iteration 2's values come from iteration 1's critic, not the initial one.
    init = ctx.load_critic(ctx.critic_manifest(0))
    trained = ctx.load_critic(ctx.critic_manifest(1))
    assert not torch.equal(init.score.weight, trained.score.weight)
    assert ctx.critic_manifest(2).info["optimizer_steps"] == 2 * (4 // 2)
    state = json.loads(ctx.store.read_file(ctx.run.manifest("critic_state", 2), "trainer_state.json"))
    assert state["optimizer_steps"] == 2 * (4 // 2)


def test_critic_warmup_holds_the_actor_then_updates_it(tmp_path):
    config = load_config(CONFIGS / "ppo.yaml", SMALL + ["trainer.critic_warmup=2"])
    ctx = run_iterations(config, tmp_path, 2)
    first = ctx.store.manifest(stage_prefix(1, "update_actor"))
    assert "critic warm-up" in first.info["skipped"]
    assert ctx.store.manifest(stage_prefix(1, "update_critic")).files  # the critic trained alone
    # Iteration 2 rolls out with the initial policy, then updates it.
    assert ctx.policy_manifest(1).prefix == stage_prefix(0, "update_actor")
    assert ctx.store.manifest(stage_prefix(2, "update_actor")).files
    assert ctx.policy_manifest(2).prefix == stage_prefix(2, "update_actor")


@pytest.mark.numerics
def test_kl_in_reward_with_adaptive_controller_carries_its_coefficient(tmp_path):
    overrides = SMALL + ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=low_var_kl",
                         "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
                         "algorithm.kl_ctrl.target_kl=0.01", "algorithm.kl_ctrl.horizon=100", "actor.lr=1e-3"]
    config = load_config(None, overrides)
    ctx = run_iterations(config, tmp_path, 2)
    assert config.recompute_old_logprobs and config.use_ref
    first, second = metrics_of(ctx, "advantage", 1), metrics_of(ctx, "advantage", 2)
    assert first["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05)
    # Ziegler et al.: value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon, n_steps = 16 trajectories.
    error = np.clip(first["actor/reward_kl_penalty"] / 0.01 - 1, -0.2, 0.2)
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.05 * (1 + error * 16 / 100), rel=1e-6)
    # Rewards are the scores minus beta * KL(old || ref) per token.
    table = ctx.read_groups("rollout", "score", "old_logprob", "ref_logprob", "advantage")
    mask = padded(table, "response_mask")
    kld = kl_penalty(padded(table, "old_logprobs"), padded(table, "ref_logprobs"), "low_var_kl") * mask
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    scores = torch.zeros_like(mask)
    scores[torch.arange(len(lengths)), torch.tensor(lengths) - 1] = torch.tensor(table.column("score").to_pylist())
    beta = second["actor/reward_kl_penalty_coeff"]
    torch.testing.assert_close(padded(table, "token_level_rewards"), (scores - beta * kld) * mask + scores * (1 - mask),
                               atol=1e-6, rtol=1e-5)
    assert second["actor/reward_kl_penalty"] > 0  # the policy moved away from the reference after one update


@pytest.mark.numerics
def test_dapo_dynamic_sampling_keeps_varied_groups_and_advances_the_data_cursor(tmp_path):
    config = load_config(CONFIGS / "dapo.yaml", SMALL + ["data.gen_batch_size=4", "reward.overlong_buffer.len=4"])
    ctx = run_iterations(config, tmp_path, 2)
    cursor = 0
    for iteration in (1, 2):
        manifest = ctx.store.manifest(stage_prefix(iteration, "rollout"))
        n_batches = int(manifest.metrics["train/num_gen_batches"])
        assert manifest.info["data_batch_end"] == cursor + n_batches
        cursor += n_batches
        ctx_it = StageContext.open(ctx.run_uri, iteration)
        table = ctx_it.read_groups("rollout", "score")
        assert table.num_rows == 4 * 4  # trimmed to train_batch_size groups
        by_group: dict[str, list[float]] = {}
        for uid, acc in zip(table.column("uid").to_pylist(), table.column("acc").to_pylist()):
            by_group.setdefault(uid, []).append(acc)
        assert len(by_group) == 4 and all(np.std(accs) > 0 for accs in by_group.values())
    assert cursor > 2, "with 4 prompts per generation batch the tiny model needs extra batches"
    score = metrics_of(ctx, "score", 1)
    assert "reward_extra/overlong_reward/mean" in score and "reward_extra/overlong/mean" in score


@pytest.mark.numerics
def test_dapo_gives_up_after_max_num_gen_batches_with_an_actionable_error(tmp_path):
    from kfrl.stages.rollout import DynamicSamplingError

    # A near-greedy policy gives n identical answers: every group has zero spread.
    config = load_config(CONFIGS / "dapo.yaml", SMALL + ["data.gen_batch_size=4", "rollout.temperature=0.0001",
                                                         "algorithm.filter_groups.max_num_gen_batches=2",
                                                         "reward.overlong_buffer.len=4"])
    store = Store(str(tmp_path / "run"))
    prepare_run(store, config)
    with pytest.raises(DynamicSamplingError, match="max_num_gen_batches=2"):
        run_stage("rollout", store.uri, 1)
    assert store.manifest(stage_prefix(1, "rollout")) is None  # nothing half-committed


def test_remax_baseline_is_the_greedy_score_of_each_prompt(tmp_path):
    config = load_config(CONFIGS / "remax.yaml", SMALL)
    ctx = run_iterations(config, tmp_path, 1)
    table = ctx.read_groups("rollout", "gen_max", "advantage", "score")
    baselines: dict[str, set] = {}
    for uid, b in zip(table.column("uid").to_pylist(), table.column("reward_baselines").to_pylist()):
        baselines.setdefault(uid, set()).add(b)
    assert all(len(v) == 1 for v in baselines.values())
    assert set().union(*baselines.values()) <= {0.0, 1.0}
    # No whitening: the advantage of every token is its return minus the prompt's greedy reward.
    adv, ret = padded(table, "advantages"), padded(table, "returns")
    mask = padded(table, "response_mask")
    expected = (ret - torch.tensor(table.column("reward_baselines").to_pylist())[:, None]) * mask
    torch.testing.assert_close(adv * mask, expected)


# --- pure pieces ------------------------------------------------------------------------------


def test_overlong_penalty_is_linear_over_the_buffer():
    from kfrl.rewards.manager import overlong_penalty

    # max 20, buffer 4: no penalty up to 16 tokens, then -0.25 per token down to -1 at 20.
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(19, 20, 4, 0.5) == pytest.approx(-0.375)


def test_score_responses_shapes_and_logs_extras():
    from types import SimpleNamespace

    from kfrl.rewards.manager import score_responses

    buffer = SimpleNamespace(enable=True, len=4, penalty_factor=1.0, log=True)
    out = score_responses(["#### 5", "#### 6"], ["kfrl/arith"] * 2, ["5", "5"], [None, "{}"], [18, 10],
                          max_response_length=20, overlong_buffer=buffer)
    assert [o.score for o in out] == [0.5, 0.0]
    assert [o.raw_score for o in out] == [1.0, 0.0] and [o.acc for o in out] == [1.0, 0.0]
    assert out[0].extra == {"overlong_reward": -0.5, "overlong": True}


@pytest.mark.numerics
def test_critic_values_sit_at_the_position_before_each_token_and_micro_batching_is_exact(tiny_model_dir):
    from kfrl.engines.critic import compute_values, forward_values, update_critic
    from kfrl.models.hf_io import load_value_model
    from kfrl.trajectory import Trajectories

    # float64: micro-batches of 1 and 2 rows take other kernel paths; the point is the algorithm.
    model = load_value_model(tiny_model_dir, torch.float64, head_seed=0)
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    masks = [[1, 1], [1, 0, 1]]  # a hole in the second response
    trajectories = Trajectories.from_lists(prompts, responses, masks, pad_id=0)
    values = trajectories.unpad(compute_values(model, trajectories, micro_batch_size=1))
    with torch.no_grad():
        full = model(input_ids=torch.tensor([[5, 6, 7, 10, 11]])).logits[0, :, 0]
    # Values are float32 (forward_values casts) of float64 results: equal but for a rounding straddle.
    torch.testing.assert_close(torch.tensor(values[0]), full[2:4].float())  # positions that predict tokens 10, 11
    assert values[1][1] == 0.0

    def grads(micro: int):
        m = load_value_model(tiny_model_dir, torch.float64, head_seed=0)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        captured = {}
        original = opt.step

        def step():
            captured["g"] = m.score.weight.grad.clone()
            original()
        opt.step = step
        data = Trajectories.from_lists(prompts, responses, masks, pad_id=0, fields={
            "values": values, "returns": [[1.0, 1.0], [0.0, 0.0, 0.0]]})
        update_critic(m, opt, data, mini_batch_size=2, micro_batch_size=micro, epochs=1, shuffle=False,
                      grad_clip=1e9, cliprange_value=0.5, loss_agg_mode="seq-mean-token-mean")
        return captured["g"]

    # The network is float64, but forward_values hands the loss float32 values (as in training), so each
    # token's loss gradient may carry float32 rounding (a few u = 2^-24, relative) into the head's
    # gradient, a sum over the batch's 4 valid tokens: |difference| <= 4 u S, S = sum_t |dL/dv_t| |h_t|
    # (2.4e-7 S), within atol 1e-6 for S <= 4 and within rtol 1e-5 of any element whose terms do not
    # cancel below S / 40; the float64 remainder is ~1e-16.
    first, second = grads(1), grads(2)
    assert first.dtype == torch.float64 and float(first.abs().max()) > 1e-3
    torch.testing.assert_close(first, second, atol=1e-6, rtol=1e-5)
    assert forward_values(model, trajectories).shape == (2, 3)


@pytest.mark.numerics
@pytest.mark.parametrize("family", ["qwen2", "bert"])
def test_padded_rows_get_each_row_s_own_values_causal_or_not(family):
    """A causal value model runs right-padded rows without a padding mask, a bidirectional one (BERT)
    with it: either way a padded row's values equal the row's own (float64)."""
    import transformers

    from kfrl.engines.critic import forward_values
    from kfrl.engines.inference import causal_attention
    from kfrl.trajectory import Trajectories

    torch.manual_seed(0)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
                 num_labels=1)
    model = (transformers.Qwen2ForTokenClassification(transformers.Qwen2Config(num_key_value_heads=2, **sizes))
             if family == "qwen2" else transformers.BertForTokenClassification(transformers.BertConfig(**sizes)))
    model = model.to(torch.float64).eval()
    assert causal_attention(model) == (family == "qwen2")
    prompts, responses = [[5, 6, 7], [8, 9], [3]], [[10, 11, 12, 13], [12], [14, 15]]
    batch = Trajectories.from_lists(prompts, responses, pad_id=0)
    with torch.no_grad():
        padded = forward_values(model, batch)
        for i, response in enumerate(responses):
            alone = forward_values(model, batch.select(slice(i, i + 1)).trimmed())
            # float32 values of float64 results: equal but for a rounding straddle (float32 tolerances)
            torch.testing.assert_close(padded[i, :len(response)], alone[0, :len(response)])


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=gae", "critic.enable=false"], "needs a critic"),
    (["algorithm.adv_estimator=grpo_passk", "rollout.n=1"], "rollout.n >= 2"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], "seq_reward"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64", "data.max_response_length=16"],
     "exceeds data.max_response_length"),
    (["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=3"],
     "critic.ppo_mini_batch_size"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator"),
])
def test_inconsistent_algorithm_settings_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_stage_plan_follows_the_algorithm():
    def running(*overrides):
        return {s for s, why in plan(load_config(None, list(overrides))).items() if not why}

    base = {"rollout", "score", "advantage", "update_actor"}
    assert running("data.train_batch_size=8", "actor.ppo_mini_batch_size=8") == base
    # Defaults are on-policy (one mini-batch, one epoch): no old-logprob pass.
    assert running("algorithm.adv_estimator=gae") == base | {"values", "update_critic"}
    assert running("algorithm.adv_estimator=remax", "actor.ppo_epochs=2") == base | {"old_logprob", "gen_max"}
    # KL in the reward needs the old log-probs even on-policy, and the reference.
    assert running("data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                   "algorithm.use_kl_in_reward=true") == base | {"old_logprob", "ref_logprob"}
