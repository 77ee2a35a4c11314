"""The `kfrl` command line: dry-run, errors a user can act on (non-zero exit, named key/path/URI)."""
import subprocess
import sys

from typer.testing import CliRunner

from kfrl.cli import app

runner = CliRunner()


def test_dry_run_prints_config_and_plan_and_runs_nothing(tmp_path):
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--dry-run", "--store", str(tmp_path / "s"),
                                 "actor.use_kl_loss=true", "model.path=/nowhere/model"])
    assert result.exit_code == 0, result.output
    assert "adv_estimator: grpo" in result.output
    assert "run   ref_logprob" in result.output  # KL loss → reference pass planned
    assert "run   old_logprob" in result.output  # two mini-batches → old log-probs recomputed
    assert "/nowhere/model is not a local HF model directory" in result.output
    assert not (tmp_path / "s").exists()


def test_misspelt_key_exits_nonzero_with_nearest_key():
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--dry-run", "actor.clip_ratoi=0.3"])
    assert result.exit_code != 0
    assert "actor.clip_ratoi" in result.output and "actor.clip_ratio" in result.output


def test_missing_model_path_names_it(tmp_path):
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--store", str(tmp_path / "s"),
                                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "--runner", "inline",
                                 "model.path=/nowhere/model"])
    assert result.exit_code == 2  # refused while preparing: nothing ran
    assert "/nowhere/model" in result.output


def test_unreachable_store_fails_fast_naming_the_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    result = subprocess.run(
        [sys.executable, "-m", "kfrl.cli", "train", "--config", "configs/demo.yaml", "--store", "s3://nobucket/runs",
         "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "store.retries=1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "s3://nobucket/runs" in result.stderr


def test_compile_writes_yaml(tmp_path):
    result = runner.invoke(app, ["compile", "--output", str(tmp_path)])
    assert result.exit_code == 0
    assert (tmp_path / "rl_iteration.yaml").read_text().startswith("# PIPELINE DEFINITION")


def test_gsm8k_prep_then_two_iterations_with_validation_and_export(tmp_path):
    """veRL's quickstart path on the demo model: GSM8K files → kfrl data gsm8k → the ready PPO
    config for 2 iterations with test_freq=1 → val-core metrics → kfrl export loads."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "gsm8k"
    result = runner.invoke(app, ["data", "gsm8k", "--input", "tests/fixtures/gsm8k/hf", "--output", str(data)])
    assert result.exit_code == 0, result.output
    assert "train.parquet (5 rows, train)" in result.output
    store, db = tmp_path / "store", tmp_path / "m.db"
    result = runner.invoke(app, [
        "train", "--config", "configs/gsm8k_ppo_qwen05b.yaml", "--store", str(store), "--tracking-uri",
        f"sqlite:///{db}", "--runner", "inline", "--run-id", "q1", "model.path=builtin:tiny-qwen2-arith",
        f"data.train_files={data}/train.parquet", f"data.val_files={data}/test.parquet", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1", "data.max_response_length=8", "trainer.test_freq=1",
        "trainer.total_iterations=2", "trainer.log_generations=0"])
    assert result.exit_code == 0, result.output
    assert "validate after   2" in result.output and "openai/gsm8k/reward/mean@1" in result.output
    metrics = json.loads((store / "ppo-qwen2.5-0.5b" / "q1" / "iter-000002" / "validate" / "_COMMITTED").read_text())
    assert "val-core/openai/gsm8k/reward/mean@1" in metrics["metrics"]

    result = runner.invoke(app, ["export", "--run", "q1", "--store", str(store), "--to", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    assert "exported iteration 2" in result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size >= len(tokenizer) - 8
    assert not (tmp_path / "hf" / "optimizer.pt").exists()


def test_export_of_an_unknown_run_names_the_store(tmp_path):
    result = runner.invoke(app, ["export", "--run", "nope", "--store", str(tmp_path), "--to", str(tmp_path / "x")])
    assert result.exit_code == 1
    assert "nope" in result.output and str(tmp_path) in result.output


def test_gsm8k_prep_missing_input_names_the_path(tmp_path):
    result = runner.invoke(app, ["data", "gsm8k", "--input", str(tmp_path / "none"), "--output", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert str(tmp_path / "none") in result.output
