"""What orchestration costs on the local runner: each iteration's wall time against the time its stages
computed, per ``pipeline.fuse`` setting, with the resident engine, and against the inline runner.

    python bench/orchestration_cost.py --iterations 8 --out bench/results/orchestration_cost.json

Each setting trains ``configs/demo.yaml`` (the builtin tiny model) for ``--iterations`` iterations in
a fresh store and MLflow (SQLite) in a temporary folder, through ``kfrl.driver.controller.train`` as
`kfrl train` does. Per iteration it reads ``timing_s/step`` (the driver's wall time for the
iteration: submitting the pipeline, waiting for its tasks, recording metrics and tables) and the
stages' own times (``timing_s/<stage>``: what ``run_stage`` spent in the engine or the task), and
reports orchestration = step - stages, as seconds and as a share of the step. Iteration 1 (models
loaded, caches warmed) and validation iterations (``trainer.test_freq``) are reported apart.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "none": ["pipeline.runner=local", "pipeline.fuse=none"],
    "weights": ["pipeline.runner=local", "pipeline.fuse=weights"],
    "all": ["pipeline.runner=local", "pipeline.fuse=all"],
    "inline": ["pipeline.runner=inline"],
}


def stage_seconds(metrics: dict) -> float:
    from kfrl.stages import TIMING_NAMES

    return sum(metrics.get(f"timing_s/{name}", 0.0) for name in set(TIMING_NAMES.values()))


def measure(setting: str, iterations: int, extra: list[str]) -> dict:
    from mlflow import MlflowClient
    from rich.console import Console

    from kfrl.config import load_config
    from kfrl.driver.controller import train
    from kfrl.run import Run
    from kfrl.stages import METRIC_ORDER

    with tempfile.TemporaryDirectory(prefix=f"kfrl-orch-{setting}-") as tmp:
        tracking = f"sqlite:///{tmp}/mlflow.db"
        config = load_config(REPO / "configs" / "demo.yaml", [
            *SETTINGS[setting], f"store.uri={tmp}/store", f"tracking.uri={tracking}",
            f"pipeline.pipeline_root={tmp}/kfp", f"trainer.total_iterations={iterations}", *extra])
        started = time.perf_counter()
        summary = train(config, console=Console(quiet=True))
        run_s = time.perf_counter() - started
        run = Run.at(summary.run_uri)
        client = MlflowClient(tracking_uri=tracking)
        steps = {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, "timing_s/step")}
        rows = []
        for iteration in range(1, iterations + 1):
            metrics = run.iteration_metrics(iteration, METRIC_ORDER)
            step = steps[iteration]
            compute = stage_seconds(metrics)
            rows.append({"iteration": iteration, "step_s": round(step, 3), "stages_s": round(compute, 3),
                         "orchestration_s": round(step - compute, 3),
                         "orchestration_share": round((step - compute) / step, 3),
                         "validation": "timing_s/testing" in metrics and metrics["timing_s/testing"] > 0})
    steady = [r for r in rows[1:] if not r["validation"]] or rows
    median = {key: round(statistics.median(r[key] for r in steady), 3)
              for key in ("step_s", "stages_s", "orchestration_s", "orchestration_share")}
    return {"setting": setting, "overrides": SETTINGS[setting] + extra, "run_s": round(run_s, 1),
            "steady_iterations": len(steady), "median": median, "iterations": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--settings", default="none,weights,all,inline")
    parser.add_argument("--out", default="")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every setting")
    args = parser.parse_args(argv)
    import os

    results = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                           "python": sys.version.split()[0]},
               "date": time.strftime("%Y-%m-%d"), "iterations": args.iterations, "settings": []}
    for setting in args.settings.split(","):
        print(f"[orchestration] {setting}: {args.iterations} iterations ...", file=sys.stderr, flush=True)
        result = measure(setting, args.iterations, args.overrides)
        results["settings"].append(result)
        m = result["median"]
        print(f"[orchestration] {setting}: step {m['step_s']:.2f} s, stages {m['stages_s']:.2f} s, "
              f"orchestration {m['orchestration_s']:.2f} s ({100 * m['orchestration_share']:.0f} %), "
              f"run {result['run_s']:.0f} s", file=sys.stderr, flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
