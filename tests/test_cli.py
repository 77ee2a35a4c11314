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
    assert "/nowhere/model is not an HF model directory" in result.output
    assert not (tmp_path / "s").exists()


def test_misspelt_key_exits_nonzero_with_nearest_key():
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--dry-run", "actor.clip_ratoi=0.3"])
    assert result.exit_code != 0
    assert "actor.clip_ratoi" in result.output and "actor.clip_ratio" in result.output


def test_missing_model_path_names_it(tmp_path):
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--store", str(tmp_path / "s"),
                                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "--runner", "inline",
                                 "model.path=/nowhere/model"])
    assert result.exit_code == 1
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
