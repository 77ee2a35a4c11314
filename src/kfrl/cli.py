"""`kfrl` command line: a thin layer over kfrl.controller and kfrl.pipelines."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

# Exit statuses: 0 done, 1 failed while running (nothing committed is lost; resume with --run-id),
# 2 refused before doing anything (a bad input or a run that cannot go on as asked).
EXIT_FAILED, EXIT_REFUSED = 1, 2
# `kfrl promote`: the candidate was not better, the alias stays (CI branches on it).
EXIT_NOT_PROMOTED = 3

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="veRL-style RL post-training of LLMs as Kubeflow Pipelines.")


def _fail(message: str, code: int = EXIT_REFUSED) -> None:
    from kfrl.tracking import redact

    typer.secho(f"error: {redact(message)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _unexpected(err: Exception) -> None:
    """One line for an error nobody anticipated; KFRL_TRACEBACK=1 shows the traceback."""
    if os.environ.get("KFRL_TRACEBACK"):
        raise err
    _fail(f"{type(err).__name__}: {err}\n(set KFRL_TRACEBACK=1 to see the traceback)", code=EXIT_FAILED)


def _load(config: Optional[Path], overrides: List[str], store: Optional[str], tracking_uri: Optional[str],
          runner: Optional[str]):
    """The resolved config; veRL keys that mean nothing here are printed as notices."""
    from kfrl.config import ConfigError, load_config

    extra = list(overrides or [])
    if store:
        extra.append(f"store.uri={store}")
    if tracking_uri:
        extra.append(f"tracking.uri={tracking_uri}")
    if runner:
        extra.append(f"pipeline.runner={runner}")
    notices: list[str] = []
    try:
        cfg = load_config(config, extra, notices)
    except ConfigError as err:
        _fail(str(err))
    for notice in notices:
        typer.secho(f"notice: {notice}", fg=typer.colors.CYAN, err=True)
    return cfg


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: List[str] = typer.Argument(None, help="config overrides, e.g. actor.lr=1e-5 rollout.n=8"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="total iterations of the run"),
    store: Optional[str] = typer.Option(None, "--store", help="store URI: a folder or s3://bucket/prefix"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI"),
    run_id: Optional[str] = typer.Option(None, "--run-id", help="resume (or name) this run"),
    runner: Optional[str] = typer.Option(None, "--runner", help="local (KFP local runner) | inline | kfp"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the resolved config and stage plan; run nothing"),
    strict: bool = typer.Option(False, "--strict", help="with --dry-run: exit 2 when there are warnings (for CI)"),
    reprepare: bool = typer.Option(False, "--reprepare", help="repair a run (--run-id) that recorded no iteration: "
                                   "prepare it again (data, initial weights, config) from this invocation"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write a JSON summary (run id, MLflow run, final "
                                           "metrics, registered versions) to this file; - for stdout"),
):
    """Train: one KFP pipeline run per RL iteration, metrics and checkpoints to MLflow."""
    if iterations is not None and iterations < 1:
        _fail(f"--iterations must be at least 1 (got {iterations})")
    if reprepare and not run_id:
        _fail("--reprepare repairs an existing run: give its --run-id")
    cfg = _load(config, overrides, store, tracking_uri, runner)
    if iterations is not None:
        cfg.trainer.total_iterations = iterations
    if dry_run:
        from kfrl import dryrun

        report, warnings = dryrun.report(cfg)
        typer.echo(cfg.to_yaml())
        typer.echo(report)
        for w in warnings:
            typer.secho(f"warning: {w}", fg=typer.colors.YELLOW, err=True)
        if strict and warnings:
            _fail(f"--strict: {len(warnings)} warning(s) above")
        return
    from kfrl.controller import TrainingRefused
    from kfrl.controller import train as run_training
    from kfrl.runners import IterationFailed
    from kfrl.tracking import TrackingError

    try:
        summary = run_training(cfg, run_id=run_id, iterations=iterations, reprepare=reprepare)
    except (TrainingRefused, TrackingError) as err:
        _fail(str(err))
    except IterationFailed as err:
        _fail(f"{err}\nNothing committed is lost: re-run with --run-id to resume.", code=EXIT_FAILED)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        _fail(f"{type(err).__name__}: {err}", code=EXIT_FAILED)
    except Exception as err:  # noqa: BLE001 - MLflow, HTTP and library errors: one line, not 400
        _unexpected(err)
    typer.echo(f"done: run {summary.run_id} at {summary.run_uri}; MLflow run {summary.mlflow_run_id}")
    if json_out:
        _write_json(summary.to_dict(), json_out)


def _write_json(document: dict, target: str) -> None:
    import json

    text = json.dumps(document, sort_keys=True)
    if target == "-":
        typer.echo(text)
    else:
        Path(target).write_text(text + "\n")


@app.command()
def promote(
    run: str = typer.Option(..., "--run", help="the kfrl run id whose newest registered version is the candidate"),
    alias: str = typer.Option("champion", "--alias", help="the alias to move"),
    metric: Optional[str] = typer.Option(None, "--metric", help="validation metric to compare, e.g. "
                                         "val-core/openai/gsm8k/reward/mean@1 (default: the run's one reward metric)"),
    min_delta: float = typer.Option(0.0, "--min-delta", help="promote only when better by more than this"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri",
                                               help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else the "
                                                    "embedded one)"),
):
    """Move an alias to a run's newest model version when its validation metric beats the holder's.
    Exit 0: promoted; 3: not better (kept); 2: nothing to compare. Prints one JSON line."""
    from kfrl.registry import PromotionRefused, promote as run_promotion
    from kfrl.tracking import TrackingError, check_reachable

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    try:
        check_reachable(uri)
        result = run_promotion(uri, run, alias=alias, metric=metric, min_delta=min_delta)
    except (PromotionRefused, TrackingError, ValueError) as err:
        _fail(str(err))
    except Exception as err:  # noqa: BLE001 - MLflow and HTTP errors: one line
        _unexpected(err)
    _write_json(result.to_dict(), "-")
    if not result.promoted:
        raise typer.Exit(EXIT_NOT_PROMOTED)


engine_app = typer.Typer(no_args_is_help=True, help="The resident engine that executes a run's stages.")
app.add_typer(engine_app, name="engine")


@engine_app.command("serve")
def engine_serve(
    run_uri: str = typer.Option(..., "--run-uri", help="the run's store URI (as printed by kfrl train)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0 in a pod)"),
    port: int = typer.Option(0, "--port", help="port (0: any free one)"),
    advertise: Optional[str] = typer.Option(None, "--advertise", help="URL tasks should use (a cluster Service); "
                                            "default http://HOST:PORT"),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="stop when this process exits"),
):
    """Serve a run's stages (kfrl train starts it for the local runner with pipeline.engines=resident)."""
    from kfrl.engine_server import serve

    try:
        serve(run_uri, host=host, port=port, advertise=advertise, parent_pid=parent_pid)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as err:
        _fail(f"{type(err).__name__}: {err}", code=EXIT_FAILED)


data_app = typer.Typer(no_args_is_help=True, help="Prepare datasets as veRL-schema Parquet files.")
app.add_typer(data_app, name="data")


@data_app.command("gsm8k")
def data_gsm8k(
    input: Path = typer.Option(..., "--input", "-i", help="local openai/gsm8k files: the HF repo folder "
                               "(main/*.parquet), a folder of train/test .parquet or .jsonl, or one file"),
    output: Path = typer.Option(..., "--output", "-o", help="folder for train.parquet and test.parquet"),
    split: Optional[str] = typer.Option(None, "--split", help="only this split (train or test)"),
):
    """GSM8K as veRL's examples/data_preprocess/gsm8k.py writes it (same rows, same prompt text)."""
    from kfrl.data.gsm8k import GSM8KError, prepare_gsm8k

    try:
        results = prepare_gsm8k(input, output, split=split)
    except (FileNotFoundError, GSM8KError) as err:
        _fail(str(err), code=1)
    for name, result in results.items():
        typer.echo(f"wrote {result.path} ({result.rows} rows, {name})")


@app.command()
def export(
    run: str = typer.Option(..., "--run", help="the run id (as printed by kfrl train)"),
    to: Path = typer.Option(..., "--to", help="target folder (must be empty or absent)"),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="policy after this iteration "
                                            "(default: the last completed; 0 = the initial model)"),
    store: str = typer.Option("./kfrl-runs/store", "--store", help="the store the run lives in"),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="trainer.experiment_name of the run "
                                             "(found by searching the store when omitted)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="re-save weights as bfloat16 | float16 | float32"),
    critic: bool = typer.Option(False, "--critic", help="export the critic (value model) instead"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty target folder"),
):
    """Write a run's policy (or critic) as a loadable Hugging Face model folder, tokenizer included."""
    from kfrl.export import export_policy, find_run

    try:
        run_uri = find_run(store, run, experiment)
        result = export_policy(run_uri, to, iteration=iteration, dtype=dtype, critic=critic, overwrite=overwrite)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        _fail(str(err), code=1)
    typer.echo(f"exported iteration {result.iteration} of {run_uri} to {result.path}")


@app.command(name="compile")
def compile_cmd(
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="output folder (default: pipelines/compiled)"),
):
    """Write the KFP IR YAML of the iteration pipeline (upload it in the KFP UI or submit with kfp.Client)."""
    from kfrl.pipelines.compile import compile_pipelines

    for path in compile_pipelines(output):
        typer.echo(f"wrote {path}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted; committed stages are kept, re-run with --run-id to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
