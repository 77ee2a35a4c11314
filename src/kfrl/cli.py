"""`kfrl` command line: a thin layer over kfrl.controller and kfrl.pipelines."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="veRL-style RL post-training of LLMs as Kubeflow Pipelines.")


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def _load(config: Optional[Path], overrides: List[str], store: Optional[str], tracking_uri: Optional[str],
          runner: Optional[str]):
    from kfrl.config import ConfigError, load_config

    extra = list(overrides or [])
    if store:
        extra.append(f"store.uri={store}")
    if tracking_uri:
        extra.append(f"tracking.uri={tracking_uri}")
    if runner:
        extra.append(f"pipeline.runner={runner}")
    try:
        return load_config(config, extra)
    except ConfigError as err:
        _fail(str(err))


def dry_run_report(cfg) -> tuple[str, list[str]]:
    """The stage plan as text, and warnings about inputs that are missing (nothing is loaded)."""
    from kfrl.stages import plan

    lines = ["stage plan (one KFP pipeline run per iteration):"]
    for stage, why in plan(cfg).items():
        lines.append(f"  {'run ' if not why else 'skip'}  {stage:<13} {('— ' + why) if why else ''}")
    warnings = []
    path = cfg.model.path
    if not path.startswith("builtin:") and "://" not in path and not (Path(path).expanduser() / "config.json").is_file():
        warnings.append(f"model.path {path} is not an HF model directory (no config.json)")
    for key, spec in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        if spec and not spec.startswith("builtin:"):
            for part in spec.split(","):
                if "://" not in part and not Path(part.strip()).expanduser().is_file():
                    warnings.append(f"{key}: {part.strip()} does not exist")
    return "\n".join(lines), warnings


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
):
    """Train: one KFP pipeline run per RL iteration, metrics and checkpoints to MLflow."""
    cfg = _load(config, overrides, store, tracking_uri, runner)
    if iterations:
        cfg.trainer.total_iterations = iterations
    if dry_run:
        report, warnings = dry_run_report(cfg)
        typer.echo(cfg.to_yaml())
        typer.echo(report)
        for w in warnings:
            typer.secho(f"warning: {w}", fg=typer.colors.YELLOW, err=True)
        return
    from kfrl.controller import train as run_training
    from kfrl.runners import IterationFailed

    try:
        summary = run_training(cfg, run_id=run_id, iterations=iterations)
    except IterationFailed as err:
        _fail(f"{err}\nNothing committed is lost: re-run with --run-id to resume.", code=1)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        _fail(f"{type(err).__name__}: {err}", code=1)
    typer.echo(f"done: run {summary.run_id} at {summary.run_uri}; MLflow run {summary.mlflow_run_id}")


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
