"""Two iterations of PPO with a critic and of DAPO through KFP's local runner, recorded in a real
MLflow server: the per-stage DAG (values and update_critic as their own tasks) and the fused one."""
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from kfrl.config import load_config
from kfrl.driver.controller import train
from kfrl.store import Store

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SMALL = ["model.path=builtin:tiny-qwen2-arith", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
         "rollout.n=4", "data.max_prompt_length=64", "data.max_response_length=16",
         "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
         "trainer.total_iterations=2", "trainer.log_generations=2"]


def _history(client: MlflowClient, experiment: str, run_id: str, key: str) -> list[int]:
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                             f"tags.`kfrl.run_id` = '{run_id}'")[0]
    return [m.step for m in client.get_metric_history(run.info.run_id, key)]


def test_ppo_with_critic_two_iterations_per_stage_tasks(mlflow_server, tmp_path):
    cfg = load_config(CONFIGS / "ppo.yaml", SMALL + [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri={mlflow_server}", "pipeline.runner=local",
        f"pipeline.pipeline_root={tmp_path / 'kfp'}", "pipeline.fuse=none", "critic.lr=1e-3"])
    summary = train(cfg, run_id="ppo-kfp")
    assert sorted(summary.iterations) == [1, 2]
    run = Store(summary.run_uri)
    for it in (1, 2):
        for stage in ("values", "update_critic", "update_actor", "old_logprob"):
            manifest = run.manifest(f"iter-{it:06d}/{stage}")
            assert manifest.files and not manifest.info.get("skipped"), (it, stage)
        assert run.manifest(f"iter-{it:06d}/ref_logprob").info["skipped"]  # no KL term in the quickstart
        assert run.manifest(f"iter-{it:06d}/gen_max").info["skipped"]
    # Each stage ran as its own KFP task: the local runner left one directory per task.
    logs = (tmp_path / "kfp" / "logs" / "ppo-kfp" / "iter-000002.log").read_text()
    for task in ("values-op", "update-critic-op", "update-actor-op", "advantage-op"):
        assert task in logs, task
    client = MlflowClient(tracking_uri=mlflow_server)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
                "critic/values/mean", "critic/advantages/mean", "critic/returns/mean", "timing_s/values",
                "timing_s/update_critic", "actor/pg_loss"):
        assert _history(client, cfg.tracking_experiment, "ppo-kfp", key) == [1, 2], key


def test_dapo_two_iterations_fused_tasks(mlflow_server, tmp_path):
    cfg = load_config(CONFIGS / "dapo.yaml", SMALL + [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri={mlflow_server}", "pipeline.runner=local",
        f"pipeline.pipeline_root={tmp_path / 'kfp'}", "pipeline.fuse=weights", "data.gen_batch_size=4",
        "reward.overlong_buffer.len=4"])
    summary = train(cfg, run_id="dapo-kfp")
    assert sorted(summary.iterations) == [1, 2]
    for it in (1, 2):
        metrics = summary.iterations[it]
        assert metrics["train/num_gen_batches"] >= 1
        assert "reward_extra/overlong_reward/mean" in metrics
    client = MlflowClient(tracking_uri=mlflow_server)
    for key in ("train/num_gen_batches", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/score/mean"):
        assert _history(client, cfg.tracking_experiment, "dapo-kfp", key) == [1, 2], key
