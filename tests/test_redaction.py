"""No secret printed: URI credentials, secret query parameters, the values of secret variables and of
keys named like a secret are redacted in printed and stored configs, MLflow params, log lines, errors
and the parameters a KFP run is submitted with. The values in memory stay usable."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kfrl.cli import app
from kfrl.config import load_config
from kfrl.redaction import MASK, is_secret_key, redact, redact_tree

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, shown", [
    ("http://alice:hunter22@mlflow:5000", "http://***@mlflow:5000"),
    ("https://token123@host/path", "https://***@host/path"),
    ("s3://bucket/key?X-Amz-Signature=abc123&X-Amz-Date=1", "s3://bucket/key?X-Amz-Signature=***&X-Amz-Date=1"),
    ("https://h/x?api_key=k3y&page=2", "https://h/x?api_key=***&page=2"),
    ("uri=http://h:5000 and ftp://u:p@f/ too", "uri=http://h:5000 and ftp://***@f/ too"),
    ("no secrets: user@example.com, a/b@c", "no secrets: user@example.com, a/b@c"),
])
def test_text_redaction(text, shown):
    assert redact(text) == shown


def test_values_of_secret_variables_are_redacted_wherever_they_appear(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wJalrXUtnFEMI")
    assert redact("boto said: key wJalrXUtnFEMI refused") == f"boto said: key {MASK} refused"


@pytest.mark.parametrize("key, secret", [
    ("password", True), ("MLFLOW_TRACKING_PASSWORD", True), ("api_key", True), ("hf_token", True),
    ("aws_secret_access_key", True), ("client_secret", True), ("credentials", True),
    ("secret", False), ("secret_keys", False), ("tokenizer", False), ("max_tokens", False), ("key", False),
])
def test_secret_key_names(key, secret):
    assert is_secret_key(key) is secret


def test_config_trees_hide_secret_keys_and_uri_credentials_but_keep_the_rest():
    tree = {"tracking": {"uri": "http://u:pw@h:5000"}, "cluster": {"secret": "kfrl-creds",
            "secret_keys": ["AWS_SECRET_ACCESS_KEY"], "node_selector": {"api_token": "xyz", "pool": "gpu"}},
            "password": "", "n": 3}
    assert redact_tree(tree) == {"tracking": {"uri": "http://***@h:5000"}, "cluster": {
        "secret": "kfrl-creds", "secret_keys": ["AWS_SECRET_ACCESS_KEY"],
        "node_selector": {"api_token": MASK, "pool": "gpu"}}, "password": "", "n": 3}


def demo_with_a_secret_key(tmp_path) -> Path:
    """configs/demo.yaml plus a free-form mapping holding a key named like a secret."""
    import yaml

    tree = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    tree.setdefault("cluster", {})["node_selector"] = {"api_token": "tok-9f8e7d", "pool": "gpu"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_dry_run_prints_the_config_without_the_password(tmp_path):
    result = runner.invoke(app, ["train", "--config", str(demo_with_a_secret_key(tmp_path)), "--dry-run",
                                 "--store", str(tmp_path / "s"),
                                 "--tracking-uri", "http://alice:hunter22@mlflow.example:5000"])
    assert result.exit_code == 0, result.output
    assert "hunter22" not in result.output and "alice" not in result.output and "tok-9f8e7d" not in result.output
    assert "http://***@mlflow.example:5000" in result.output and f"api_token: '{MASK}'" in result.output
    assert not (tmp_path / "s").exists()


def test_the_config_object_keeps_its_values_and_only_its_text_forms_are_redacted():
    config = load_config(Path(REPO / "configs/demo.yaml"), ["tracking.uri=http://alice:hunter22@h:5000"])
    assert config.tracking.uri == "http://alice:hunter22@h:5000"  # what a connection uses
    assert "hunter22" not in config.to_yaml() and config.flat()["tracking.uri"] == "http://***@h:5000"


def test_a_resumed_run_takes_the_given_value_for_one_stored_redacted():
    from kfrl.config import config_from_yaml_text
    from kfrl.driver.controller import resolve_resume

    given = load_config(Path(REPO / "configs/demo.yaml"), ["model.path=https://bob:s3cret@models.example/m"])
    stored = config_from_yaml_text(given.to_yaml())
    assert stored.model.path == "https://***@models.example/m"
    resumed, ignored = resolve_resume(stored, given, None)
    assert resumed.model.path == given.model.path and "model.path" not in ignored


def test_credentials_redacted_on_the_way_are_not_taken_for_a_user(monkeypatch):
    from kfrl.tracking import credentials_to_environment

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "from-the-secret")
    assert credentials_to_environment("http://***@mlflow:5000") == "http://mlflow:5000"
    import os

    assert "MLFLOW_TRACKING_USERNAME" not in os.environ
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "from-the-secret"


def test_kfp_run_parameters_and_the_submitted_config_carry_no_credentials():
    from kfrl.driver.submit import pipeline_arguments, submitted_config_text

    config = load_config(Path(REPO / "configs/demo.yaml"), ["tracking.uri=http://alice:hunter22@h:5000"])
    arguments = pipeline_arguments(config_uri="s3://b/configs/c.yaml",
                                   overrides=["tracking.uri=http://alice:hunter22@h:5000"], iterations=3)
    assert "hunter22" not in str(arguments) and "alice" not in str(arguments)
    text = submitted_config_text(config)
    assert "http://***@h:5000" in text and "hunter22" not in text


def test_log_lines_of_any_logger_are_redacted():
    """In a fresh process, as the CLI sets it up: a library logging a URI with credentials."""
    code = (
        "import logging, sys\n"
        "from kfrl.redaction import redact_logging\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(name)s %(message)s')\n"
        "redact_logging()\n"
        "logging.getLogger('some.library').info('connecting to %s', 'http://alice:hunter22@h:5000')\n"
        "logging.getLogger('other').warning('token in url https://h/x?token=abc123')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "hunter22" not in out and "abc123" not in out
    assert "some.library connecting to http://***@h:5000" in out and "token=***" in out


def test_an_error_naming_a_uri_with_credentials_is_redacted(tmp_path):
    result = runner.invoke(app, ["train", "--config", "configs/demo.yaml", "--store", str(tmp_path / "s"),
                                 "--tracking-uri", f"sqlite:///{tmp_path}/m.db", "pipeline.runner=inline",
                                 "model.path=https://bob:s3cret@models.example/m"])
    assert result.exit_code != 0 and "error:" in result.output
    assert "https://***@models.example/m" in result.output and "s3cret" not in result.output


def test_stored_config_yaml_has_no_secret_named_values(tmp_path):
    from kfrl.driver.controller import train

    config = load_config(demo_with_a_secret_key(tmp_path), [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db", "pipeline.runner=inline",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "data.max_response_length=8",
        "trainer.val_before_train=false", "trainer.log_generations=0"])
    summary = train(config, run_id="r", iterations=1)
    stored = (Path(summary.run_uri) / "config.yaml").read_text()
    assert "tok-9f8e7d" not in stored and f"api_token: '{MASK}'" in stored
