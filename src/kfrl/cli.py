"""`kfrl` command line: a thin layer over kfrl.driver.controller and kfrl.pipelines."""
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
    from kfrl.redaction import redact

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
        from kfrl.driver import dryrun

        report, warnings = dryrun.report(cfg)
        typer.echo(cfg.to_yaml())
        typer.echo(report)
        for w in warnings:
            typer.secho(f"warning: {w}", fg=typer.colors.YELLOW, err=True)
        if strict and warnings:
            _fail(f"--strict: {len(warnings)} warning(s) above")
        return
    from kfrl.driver.controller import TrainingRefused
    from kfrl.driver.controller import train as run_training
    from kfrl.driver import IterationFailed
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
    from kfrl.driver.engine.server import serve

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
    tools: bool = typer.Option(False, "--tools", help="the multi-turn rows of veRL's gsm8k_multiturn_w_tool.py "
                               "(calc_gsm8k_reward tool; configs/tools/gsm8k_tool_config.yaml)"),
):
    """GSM8K as veRL's examples/data_preprocess/gsm8k.py writes it (same rows, same prompt text)."""
    from kfrl.data.gsm8k import GSM8KError, prepare_gsm8k

    try:
        results = prepare_gsm8k(input, output, split=split, tools=tools)
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
    adapter: bool = typer.Option(False, "--adapter", help="LoRA runs: the PEFT adapter folder instead of the merged "
                                 "model"),
):
    """Write a run's policy (or critic) as a loadable Hugging Face model folder, tokenizer included (a LoRA
    run: the merged model, or with --adapter the PEFT adapter)."""
    from kfrl.export import export_policy, find_run

    try:
        run_uri = find_run(store, run, experiment)
        result = export_policy(run_uri, to, iteration=iteration, dtype=dtype, critic=critic, overwrite=overwrite,
                               adapter=adapter)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        _fail(str(err), code=1)
    typer.echo(f"exported iteration {result.iteration} of {run_uri} to {result.path}")


@app.command()
def gc(
    run: str = typer.Option(..., "--run", help="the run id (as printed by kfrl train)"),
    store: str = typer.Option("./kfrl-runs/store", "--store", help="the store the run lives in"),
    experiment: Optional[str] = typer.Option(None, "--experiment", help="trainer.experiment_name of the run "
                                             "(found by searching the store when omitted)"),
    keep: Optional[int] = typer.Option(None, "--keep", min=1, help="policy weights to keep: the newest K iterations "
                                       "(default: the run's trainer.keep_policy_weights)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI whose registered "
                                               "versions are kept (default: the run's tracking.uri)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be deleted; delete nothing"),
):
    """Delete a run's old policy weights by the retention rule of trainer.keep_policy_weights: the newest
    K, the initial model, every save_freq-th, those beside a kept trainer state and every registered
    MLflow version stay; files of withdrawn commits go too."""
    from mlflow import MlflowClient

    from kfrl.export import find_run
    from kfrl.retention import collect_garbage
    from kfrl.run import Run
    from kfrl.tracking import registered_iterations, resolve_tracking_uri

    try:
        run_dir = Run.at(find_run(store, run, experiment))
        config = run_dir.config()
        keep = keep or config.trainer.keep_policy_weights
        if keep <= 0:
            raise ValueError(f"run {run} keeps every policy (trainer.keep_policy_weights=0): pass --keep K")
        uri = resolve_tracking_uri(tracking_uri or config.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
        registered = registered_iterations(MlflowClient(tracking_uri=uri, registry_uri=uri), run_dir.uri.rstrip("/").rsplit("/", 1)[-1])
        result = collect_garbage(run_dir, keep, config.trainer.save_freq, registered, dry_run=dry_run)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        _fail(str(err), code=EXIT_FAILED)
    verb = "would delete" if dry_run else "deleted"
    typer.echo(f"{verb} the policy weights of {len(result.deleted)} iteration(s) of {run_dir.uri}: "
               f"{', '.join(map(str, result.deleted)) or 'none'}")
    for iteration, why in sorted(result.kept_for.items()):
        typer.echo(f"  kept iteration {iteration}: {why}")
    typer.echo(f"{verb} {len(result.orphans)} file(s) no commit names")


@app.command(name="compile")
def compile_cmd(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="shape the tasks for a cluster from this "
                                          "config's `cluster` section (resources, GPUs, secret, /dev/shm, images)"),
    image: Optional[str] = typer.Option(None, "--image", help="the GPU image (cluster.image)"),
    cpu_image: Optional[str] = typer.Option(None, "--cpu-image", help="the CPU image (cluster.cpu_image)"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="output folder (default: pipelines/compiled)"),
    overrides: List[str] = typer.Argument(None, help="config overrides, e.g. cluster.gpu_stages.gpus=1"),
):
    """Write the KFP IR YAML of the pipelines (upload them in the KFP UI, or `kfrl submit`). Without
    --config, --image or overrides the tasks are plain (the committed pipelines/compiled/*.yaml)."""
    from kfrl.pipelines.compile import compile_pipelines

    cfg = None
    if config or image or cpu_image or overrides:
        extra = list(overrides or []) + ([f"cluster.image={image}"] if image else []) + \
            ([f"cluster.cpu_image={cpu_image}"] if cpu_image else [])
        cfg = _load(config, extra, None, None, None)
    for path in compile_pipelines(output, cfg):
        typer.echo(f"wrote {path}")


def _cluster_config(config, overrides, store, tracking_uri, host, namespace):
    extra = list(overrides or [])
    if host:
        extra.append(f"pipeline.host={host}")
    if namespace:
        extra.append(f"pipeline.namespace={namespace}")
    return _load(config, extra, store, tracking_uri, None)


def _upload_for_cluster(cfg) -> str:
    """The config in the store for the cluster (``kfrl.driver.submit.upload_config``), after refusing (exit 2)
    what the cluster cannot run."""
    from kfrl.store import StoreError
    from kfrl.driver.submit import cluster_input_problems, upload_config

    problems = cluster_input_problems(cfg)
    if problems:
        _fail("; ".join(problems))
    try:
        return upload_config(cfg)
    except StoreError as err:
        _fail(f"putting the config in the store: {err}", code=EXIT_FAILED)


@app.command()
def submit(
    overrides: List[str] = typer.Argument(None, help="config overrides, e.g. model.path=models:/name@champion"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="total iterations of the run"),
    run_id: str = typer.Option("", "--run-id", help="resume this run (default: a new one named after the KFP run)"),
    store: Optional[str] = typer.Option(None, "--store", help="store URI (s3://bucket/prefix)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI the cluster reaches"),
    host: Optional[str] = typer.Option(None, "--host", help="KFP API URL (pipeline.host; default $KF_PIPELINES_ENDPOINT)"),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubeflow profile namespace (multi-user KFP)"),
    promote_alias: str = typer.Option("", "--promote-alias", help="after training, move this MLflow alias if better"),
    wait: bool = typer.Option(False, "--wait", help="follow the run until it ends: exit 0 done, 1 failed, "
                              "3 trained but not promoted (with --promote-alias)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="with --wait: write the run's summary (kfrl and "
                                           "KFP run ids, state, final metrics, promotion) to this file; - for stdout"),
    poll_seconds: float = typer.Option(10.0, "--poll-seconds", help="with --wait: seconds between state checks"),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="with --wait: give up after this many seconds "
                                            "(exit 1; the run goes on)"),
):
    """Start the training pipeline (rl_train) on a KFP cluster: it prepares the run and drives every
    iteration there. Prints the KFP run id; with --wait follows it to its end (for CI)."""
    from kfrl.driver.submit import pipeline_arguments, submit as submit_run

    cfg = _cluster_config(config, overrides, store, tracking_uri, host, namespace)
    arguments = pipeline_arguments(config_uri=_upload_for_cluster(cfg), overrides=[], iterations=iterations,
                                   run_id=run_id, promote_alias=promote_alias)
    try:
        kfp_run = submit_run(cfg, arguments, run_name=f"{cfg.trainer.experiment_name}-train")
    except Exception as err:  # noqa: BLE001 - connection and API errors: one line
        _fail(f"submitting to KFP at {cfg.pipeline.host or os.environ.get('KF_PIPELINES_ENDPOINT')}: "
              f"{type(err).__name__}: {err}", code=EXIT_FAILED)
    typer.echo(f"submitted KFP run {kfp_run} (pipeline kfrl-rl-train, experiment {cfg.trainer.project_name})")
    if wait:
        _follow(cfg, kfp_run, run_id, promote_alias, json_out, poll_seconds, timeout)


def _follow(cfg, kfp_run: str, run_id: str, promote_alias: str, json_out, poll_seconds: float, timeout) -> None:
    """``kfrl submit --wait``: the run's states as they change, then its summary and exit status."""
    from kfrl.driver.kfp_entry import driver_run_id
    from kfrl.driver.submit import training_summary, wait_for_training_run

    run_id = run_id or driver_run_id(kfp_run)
    try:
        state = wait_for_training_run(cfg, kfp_run, poll_s=poll_seconds, timeout_s=timeout, echo=typer.echo)
    except Exception as err:  # noqa: BLE001 - connection and API errors: one line
        _fail(f"following KFP run {kfp_run}: {type(err).__name__}: {err}; it goes on in the cluster",
              code=EXIT_FAILED)
    summary = training_summary(cfg, run_id) if state == "SUCCEEDED" else None
    document = {"kfp_run_id": kfp_run, "run_id": run_id, "state": state, **(summary or {})}
    if json_out:
        _write_json(document, json_out)
    if state != "SUCCEEDED":
        _fail(f"KFP run {kfp_run} (kfrl run {run_id}) ended {state}" if state != "TIMEOUT" else
              f"KFP run {kfp_run} still running after {timeout:.0f} s; it goes on in the cluster", code=EXIT_FAILED)
    promotion = (summary or {}).get("promotion")
    if promote_alias and promotion is not None and not promotion.get("promoted"):
        typer.echo(f"not promoted: @{promote_alias} stays ({promotion.get('reason') or 'not better'})")
        raise typer.Exit(EXIT_NOT_PROMOTED)
    if promote_alias and promotion is None:
        typer.echo(f"done: kfrl run {run_id}; its summary was not readable from the store, so whether "
                   f"@{promote_alias} moved is unknown here (`kfrl promote` decides it again)")
        return
    typer.echo(f"done: kfrl run {run_id}" + (f", @{promote_alias} moved" if promotion else ""))


@app.command()
def schedule(
    cron: Optional[str] = typer.Option(None, "--cron", help="when, as crontab's five fields, e.g. '0 2 * * *' (02:00 daily)"),
    overrides: List[str] = typer.Argument(None, help="config overrides, e.g. model.path=models:/name@champion"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML config file"),
    name: Optional[str] = typer.Option(None, "--name", help="the recurring run's name (default <experiment>-nightly)"),
    iterations: Optional[int] = typer.Option(None, "--iterations", "-n", help="iterations of each night's run"),
    store: Optional[str] = typer.Option(None, "--store", help="store URI (s3://bucket/prefix)"),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI the cluster reaches"),
    host: Optional[str] = typer.Option(None, "--host", help="KFP API URL (pipeline.host; default $KF_PIPELINES_ENDPOINT)"),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubeflow profile namespace (multi-user KFP)"),
    promote_alias: str = typer.Option("", "--promote-alias", help="after each run, move this MLflow alias if better"),
    list_: bool = typer.Option(False, "--list", help="list the recurring runs of the training pipeline"),
    delete: Optional[str] = typer.Option(None, "--delete", help="delete the recurring run(s) of this name"),
):
    """A KFP recurring run of the training pipeline: each run is a new kfrl run (e.g. continuing from
    model.path=models:/<name>@champion), at most one at a time, missed runs not caught up. Scheduling
    a name again replaces its recurring run; --list shows them, --delete NAME removes one."""
    from kfrl.driver.submit import delete_schedule, kfp_cron, pipeline_arguments, schedule as schedule_runs, schedule_rows

    if sum([bool(cron), list_, delete is not None]) != 1:
        _fail("give one of --cron (schedule), --list or --delete NAME")
    if cron:
        try:
            kfp_cron(cron)
        except ValueError as err:
            _fail(str(err))
    cfg = _cluster_config(config, overrides, store, tracking_uri, host, namespace)
    where = f"KFP at {cfg.pipeline.host or os.environ.get('KF_PIPELINES_ENDPOINT')}"
    try:
        if list_:
            rows = schedule_rows(cfg)
            typer.echo(f"{'NAME':<32} {'ID':<38} {'CRON':<16} {'STATUS':<10} CREATED")
            for row in rows:
                typer.echo(f"{row['name']:<32} {row['id']:<38} {row['cron']:<16} {row['status']:<10} {row['created']}")
            return
        if delete is not None:
            ids = delete_schedule(cfg, delete)
            if not ids:
                _fail(f"no recurring run named {delete!r} of the training pipeline on {where}; "
                      "`kfrl schedule --list` shows them")
            typer.echo(f"deleted recurring run {', '.join(ids)} ({delete})")
            return
        arguments = pipeline_arguments(config_uri=_upload_for_cluster(cfg), overrides=[], iterations=iterations,
                                       promote_alias=promote_alias)
        job, replaced = schedule_runs(cfg, arguments, cron=cron, name=name or f"{cfg.trainer.experiment_name}-nightly")
    except typer.Exit:
        raise
    except ValueError as err:
        _fail(str(err))
    except Exception as err:  # noqa: BLE001 - connection and API errors: one line
        _fail(f"scheduling on {where}: {type(err).__name__}: {err}", code=EXIT_FAILED)
    also = f"; replaced {', '.join(replaced)}" if replaced else ""
    typer.echo(f"scheduled recurring run {job} ({cron}, pipeline kfrl-rl-train{also})")


def main() -> None:
    from kfrl.redaction import redact_logging

    redact_logging()
    try:
        app()
    except KeyboardInterrupt:
        typer.secho("interrupted; committed stages are kept, re-run with --run-id to resume", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
