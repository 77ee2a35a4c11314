"""The retraining workflow (.github/workflows/retrain.yml): valid for GitHub Actions, and its steps
do what a user relies on, run here with bash against a fake `kfrl` (no network, no cluster, no MLflow)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "retrain.yml"
CHECK_JSONSCHEMA = Path(sys.executable).with_name("check-jsonschema")
# Any attempt to reach the network fails fast: the schema check must use its vendored schema.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "ALL_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}

# What GitHub would put in the job's environment, with stand-in values.
JOB_ENV = {
    "CONFIG": "configs/gsm8k_grpo_qwen05b.yaml",
    "ITERATIONS": "20",
    "ALIAS": "champion",
    "MIN_DELTA": "0",
    "KFP_HOST": "http://ml-pipeline.kubeflow:8888",
    "KF_PIPELINES_TOKEN": "t0ken",
    "KFRL_STORE": "s3://kfrl-test/runs",
    "KFRL_OVERRIDES": "data.train_files=s3://kfrl-test/gsm8k/train.parquet model.path=s3://kfrl-test/qwen",
    "AWS_ENDPOINT_URL": "",
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "MLFLOW_TRACKING_URI": "https://mlflow.example",
    "MLFLOW_TRACKING_USERNAME": "bot",
    "MLFLOW_TRACKING_PASSWORD": "pw",
}

# Records every call (argv one per line, then "--"), writes --json for train, exits as told for promote.
FAKE_KFRL = """#!/usr/bin/env bash
printf '%s\\n' "$@" -- >> "$KFRL_CALLS"
case "$1" in
  train)
    for arg in "$@"; do [ "$arg" = --dry-run ] && exit 0; done
    echo "fake kfrl: train without --dry-run: CI must not drive a run itself" >&2; exit 2
    ;;
  submit)
    json=""; prev=""
    for arg in "$@"; do [ "$prev" = --json ] && json=$arg; prev=$arg; done
    [ -n "$json" ] || { echo "fake kfrl: submit without --json" >&2; exit 2; }
    cat > "$json" <<'JSON'
{"run_id": "run-42", "mlflow_run_id": "abc123", "run_uri": "s3://kfrl-test/runs/run-42", "iterations": [19, 20],
 "final_iteration": 20, "final_metrics": {"actor/loss": 0.1, "val-core/openai/gsm8k/reward/mean@1": 0.61},
 "registered_versions": {"20": "7"}}
JSON
    ;;
  promote)
    echo "{\\"promoted\\": $([ "$FAKE_PROMOTE_EXIT" = 0 ] && echo true || echo false), \\"exit\\": $FAKE_PROMOTE_EXIT}"
    exit "$FAKE_PROMOTE_EXIT"
    ;;
  *) echo "fake kfrl: unexpected command $1" >&2; exit 64 ;;
esac
"""


def load_workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def triggers(workflow: dict) -> dict:
    return workflow.get("on", workflow.get(True))  # PyYAML (YAML 1.1) reads the key `on` as True


def job(workflow: dict) -> dict:
    (only,) = workflow["jobs"].values()
    return only


def step_running(workflow: dict, command: str) -> dict:
    (step,) = [s for s in job(workflow)["steps"] if command in s.get("run", "")]
    return step


def check_schema(path: Path) -> subprocess.CompletedProcess:
    assert CHECK_JSONSCHEMA.exists(), "check-jsonschema missing: pip install -c constraints.txt -e '.[dev]'"
    return subprocess.run([str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.github-workflows", str(path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **OFFLINE})


def test_workflow_is_valid_for_github_actions():
    result = check_schema(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "retrain.yml"
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "runs_on:"))
    result = check_schema(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "runs-on" in result.stdout


def test_triggers_inputs_and_guards():
    workflow = load_workflow()
    on = triggers(workflow)
    assert on["schedule"][0]["cron"].split()[2:] == ["*", "*", "*"]  # every night
    inputs = on["workflow_dispatch"]["inputs"]
    defaults = {name: str(spec["default"]) for name, spec in inputs.items()}
    assert defaults == {"iterations": "20", "config": "configs/gsm8k_grpo_qwen05b.yaml", "alias": "champion",
                        "min_delta": "0"}
    assert (REPO / defaults["config"]).is_file()
    env = job(workflow)["env"]
    # Scheduled runs have no inputs: the job falls back to the same defaults.
    for name, variable in (("iterations", "ITERATIONS"), ("config", "CONFIG"), ("alias", "ALIAS"),
                           ("min_delta", "MIN_DELTA")):
        assert env[variable] == f"${{{{ inputs.{name} || '{defaults[name]}' }}}}"
    assert set(JOB_ENV) == set(env)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                 "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[name] == f"${{{{ secrets.{name} }}}}"
    assert workflow["permissions"] == {"contents": "read"}
    assert workflow["concurrency"]["group"] and workflow["concurrency"]["cancel-in-progress"] is False
    # The steps below are run with GitHub's `shell: bash` command line; no step may pick another shell.
    assert workflow["defaults"]["run"]["shell"] == "bash"
    assert not any("shell" in step for step in job(workflow)["steps"])


def run_step(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    path = cwd.parent / "step.sh"
    path.write_text(script)
    # What GitHub runs for `shell: bash`.
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(path)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture()
def runner(tmp_path):
    """A stand-in for the GitHub runner: a checkout folder, a fake `kfrl` and `python` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kfrl = bin_dir / "kfrl"
    kfrl.write_text(FAKE_KFRL)
    kfrl.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    work = tmp_path / "checkout"
    work.mkdir()
    env = {**JOB_ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
           "KFRL_CALLS": str(tmp_path / "calls.txt"), "GITHUB_STEP_SUMMARY": str(tmp_path / "step_summary.md")}
    return work, env


def calls(env: dict) -> list[list[str]]:
    text = Path(env["KFRL_CALLS"]).read_text() if Path(env["KFRL_CALLS"]).exists() else ""
    return [chunk.strip("\n").split("\n") for chunk in text.split("--\n") if chunk.strip("\n")]


@pytest.mark.parametrize("promote_exit, job_ok, verdict", [
    (0, True, "- promoted: `champion` now points at run `run-42`"),
    (3, True, "- not promoted: run `run-42` is not better than `champion` (min delta 0)"),
    (1, False, None),
    (2, False, None),
], ids=["promoted", "not-better", "promote-failed", "promote-refused"])
def test_train_then_promote(runner, promote_exit, job_ok, verdict):
    work, env = runner
    env["FAKE_PROMOTE_EXIT"] = str(promote_exit)
    workflow = load_workflow()

    check = run_step(step_running(workflow, "--dry-run")["run"], work, env)
    assert check.returncode == 0, check.stdout + check.stderr
    train = run_step(step_running(workflow, "kfrl submit")["run"], work, env)
    assert train.returncode == 0, train.stdout + train.stderr
    assert (work / "summary.json").is_file()
    promote = run_step(step_running(workflow, "kfrl promote")["run"], work, env)

    check_argv, submit_argv, promote_argv = calls(env)
    # The same config, overrides and flags are checked (strictly) and then submitted.
    assert check_argv[0] == "train" and check_argv[-2:] == ["--dry-run", "--strict"]
    assert check_argv[check_argv.index("--runner") + 1] == "kfp"
    assert submit_argv[0] == "submit" and "--wait" in submit_argv
    for argv in (check_argv, submit_argv):
        options = argv[1:]
        for flag, value in (("--config", JOB_ENV["CONFIG"]), ("--iterations", "20"),
                            ("--store", JOB_ENV["KFRL_STORE"]), ("--tracking-uri", JOB_ENV["MLFLOW_TRACKING_URI"])):
            assert options[options.index(flag) + 1] == value, (flag, argv)
        # Config overrides: the KFP host, and each of KFRL_OVERRIDES as its own argument.
        assert {f"pipeline.host={JOB_ENV['KFP_HOST']}", "data.train_files=s3://kfrl-test/gsm8k/train.parquet",
                "model.path=s3://kfrl-test/qwen"} <= set(options)
    assert submit_argv[submit_argv.index("--json") + 1] == "summary.json"
    assert promote_argv == ["promote", "--run", "run-42", "--alias", "champion", "--min-delta", "0"]

    summary = Path(env["GITHUB_STEP_SUMMARY"])
    if job_ok:
        assert promote.returncode == 0, promote.stdout + promote.stderr
        text = summary.read_text()
        assert verdict in text.splitlines()
        assert "- run `run-42` to iteration 20, MLflow run `abc123`" in text
        assert "- val-core/openai/gsm8k/reward/mean@1: 0.61" in text and "actor/loss" not in text
        assert f'"exit": {promote_exit}' in text  # promote's JSON line is kept
    else:
        assert promote.returncode != 0
        assert f"kfrl promote failed with exit status {promote_exit}" in promote.stdout
        assert not summary.exists() or "promoted" not in summary.read_text()


def test_the_client_installs_torch_s_cpu_build_and_kfp_gets_the_token_from_the_secrets():
    workflow = load_workflow()
    install = step_running(workflow, "pip install")["run"]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install and "-c constraints.txt -e ." in install
    assert job(workflow)["env"]["KF_PIPELINES_TOKEN"] == "${{ secrets.KF_PIPELINES_TOKEN }}"


def test_train_refuses_before_running_when_configuration_is_missing(runner):
    work, env = runner
    env["KFP_HOST"] = ""
    result = run_step(step_running(load_workflow(), "--dry-run")["run"], work, env)
    assert result.returncode != 0
    assert "KFP_HOST" in result.stderr
    assert calls(env) == []


def test_failed_training_fails_the_job_and_promotes_nothing(runner):
    work, env = runner
    bad = Path(env["PATH"].split(os.pathsep)[0]) / "kfrl"
    bad.write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" -- >> \"$KFRL_CALLS\"\nexit 1\n")
    workflow = load_workflow()
    assert run_step(step_running(workflow, "kfrl submit")["run"], work, env).returncode != 0
    # GitHub skips the promote step after a failure (it has no `if:`); run anyway, it finds no
    # summary.json and calls nothing.
    promote = step_running(workflow, "kfrl promote")
    assert "if" not in promote
    assert run_step(promote["run"], work, env).returncode != 0
    assert [argv[0] for argv in calls(env)] == ["submit"]
