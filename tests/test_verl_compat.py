"""veRL command lines: the quickstart resolves in --dry-run with no model, data or vLLM present;
veRL keys map onto kfrl's, keys without effect print a notice, misspelt keys fail naming the
nearest; docs/config.md carries the mapping table."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import ConfigError, load_config, valid_keys
from kfrl.verl_compat import VERL_KEYS

runner = CliRunner()

# veRL's docs/start/quickstart.rst PPO command on GSM8K, as a user would paste it.
QUICKSTART = """
 data.train_files=$HOME/data/gsm8k/train.parquet
 data.val_files=$HOME/data/gsm8k/test.parquet
 data.train_batch_size=256
 data.max_prompt_length=512
 data.max_response_length=512
 actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
 actor_rollout_ref.actor.optim.lr=1e-6
 actor_rollout_ref.actor.ppo_mini_batch_size=64
 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
 actor_rollout_ref.rollout.name=vllm
 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
 actor_rollout_ref.rollout.tensor_model_parallel_size=1
 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
 critic.optim.lr=1e-5
 critic.model.path=Qwen/Qwen2.5-0.5B-Instruct
 critic.ppo_micro_batch_size_per_gpu=4
 algorithm.kl_ctrl.kl_coef=0.001
 trainer.logger=console
 trainer.val_before_train=False
 trainer.n_gpus_per_node=1
 trainer.nnodes=1
 trainer.save_freq=10
 trainer.test_freq=10
 trainer.total_epochs=15
""".split()


def test_quickstart_line_resolves_in_dry_run_without_model_data_or_vllm(tmp_path):
    args = [a.replace("$HOME", str(tmp_path)) for a in QUICKSTART]
    result = runner.invoke(app, ["train", "--dry-run", "--store", str(tmp_path / "s"), *args])
    assert result.exit_code == 0, result.output
    out = result.output
    # PPO with a critic: veRL's default estimator (gae) applies to a veRL command line.
    assert "adv_estimator: gae" in out and "run   values" in out and "run   update_critic" in out
    assert "skip  ref_logprob" in out  # kl_ctrl.kl_coef without use_kl_in_reward: no reference
    assert "run   validate" in out
    for line in ("train_batch_size: 256", "ppo_mini_batch_size: 64", "ppo_micro_batch_size_per_gpu: 4",
                 "lr: 1.0e-06", "lr: 1.0e-05", "total_epochs: 15", "save_freq: 10", "test_freq: 10",
                 "val_before_train: false", "name: vllm", "model_path: Qwen/Qwen2.5-0.5B-Instruct",
                 "gpu_memory_utilization: 0.4"):
        assert line in out, line
    # Accepted veRL keys that mean nothing here are named, never dropped silently.
    for key in ("actor_rollout_ref.rollout.tensor_model_parallel_size", "trainer.logger"):
        assert f"notice: veRL key '{key}' has no effect" in out, key
    # The device counts are kfrl keys (the multi-GPU update and replicas): taken, no notice.
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node"):
        assert f"veRL key '{key}'" not in out, key
    assert "n_gpus_per_node: 1" in out and "nnodes: 1" in out
    # What is missing is a warning, not a failure.
    assert "warning: model.path: Qwen/Qwen2.5-0.5B-Instruct is not a local HF model directory" in out
    assert f"warning: data.train_files: {tmp_path}/data/gsm8k/train.parquet does not exist" in out
    assert "warning: rollout.name=vllm" in out
    assert not (tmp_path / "s").exists()


def test_quickstart_iterations_follow_verl_epoch_accounting(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"x": list(range(7473))}), data / "train.parquet")  # GSM8K's train size
    args = [a.replace("$HOME", str(tmp_path)) for a in QUICKSTART]
    result = runner.invoke(app, ["train", "--dry-run", *args])
    assert result.exit_code == 0, result.output
    # len(dataloader) = 7473 // 256 = 29 with drop_last; x 15 epochs.
    assert "iterations: 435 = 29 per epoch (7473 rows // 256 prompts, drop_last) x 15 epochs" in result.output


def test_verl_keys_map_onto_kfrl_keys():
    notices: list[str] = []
    cfg = load_config(None, [
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.optim.lr=2e-6",
        "actor_rollout_ref.rollout.val_kwargs.n=4", "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "critic.optim.lr=3e-5", "critic.model.path=/m", "custom_reward_function.path=/r.py",
        "custom_reward_function.name=my_score", "reward_model.enable=True", "reward_model.model.path=/rm",
        "trainer.total_training_steps=7", "+trainer.val_before_train=False",
        "actor_rollout_ref.actor.strategy=deepspeed", "critic.strategy=fsdp", "trainer.n_gpus_per_node=8",
        "trainer.nnodes=2"], notices)
    assert cfg.actor.loss_mode == "gspo" and cfg.actor.lr == 2e-6
    assert cfg.rollout.val_kwargs.n == 4 and cfg.rollout.val_kwargs.do_sample
    assert cfg.critic.lr == 3e-5 and cfg.critic.model_path == "/m"
    assert (cfg.reward.custom_function_path, cfg.reward.custom_function_name) == ("/r.py", "my_score")
    assert cfg.reward.name == "model" and cfg.reward.model_path == "/rm"
    assert cfg.trainer.total_iterations == 7 and not cfg.trainer.val_before_train
    assert cfg.actor.strategy == "deepspeed" and (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (8, 2)
    assert any("'critic.strategy'" in n and "follows actor.strategy" in n for n in notices)
    assert any("veRL's defaults apply" in n for n in notices)


def test_kfrl_command_lines_keep_kfrl_defaults():
    notices: list[str] = []
    cfg = load_config(None, ["data.train_batch_size=8", "trainer.save_freq=2"], notices)
    assert cfg.algorithm.adv_estimator == "grpo" and not notices


@pytest.mark.parametrize("key, nearest", [
    ("actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
    ("trainer.nnode", "trainer.nnodes"),
    ("algorithm.adv_estimater", "algorithm.adv_estimator"),
])
def test_misspelt_verl_key_names_the_nearest(key, nearest):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=1"])
    assert f"'{key}'" in str(err.value) and f"'{nearest}'" in str(err.value)


def test_misspelt_verl_key_exits_nonzero_on_the_command_line():
    result = runner.invoke(app, ["train", "--dry-run", "actor_rollout_ref.actor.ppo_mini_batchsize=4"])
    assert result.exit_code != 0
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in result.output


def test_mapping_targets_exist_and_docs_carry_the_current_table():
    from kfrl.verl_compat import DOC_END, DOC_START, markdown_table

    keys = set(valid_keys())
    assert all(target in keys for target in VERL_KEYS.values())
    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert f"{DOC_START}\n{markdown_table()}\n{DOC_END}" in doc, \
        "docs/config.md's veRL table is stale: run `python -m kfrl.verl_compat docs/config.md`"
