"""Reward curves of PPO (critic + GAE), GRPO and RLOO on the demo task, for the same budget.

    python bench/algo_curves.py [--iterations 20] [--algos ppo,grpo,rloo] [--seeds 1]
                                [--critic-lr 1e-3] [--out bench/results/algo_curves]
                                [--work-dir DIR] [key=value ...]

Trains ``configs/demo.yaml`` (tiny Qwen2-shaped model, 2-digit additions, 32 prompts x 8 samples
per iteration) once per algorithm and seed, with the inline runner (no KFP), in this process. All
runs share the budget: same prompts, samples per prompt, iterations, seed and actor settings. Only
``algorithm.adv_estimator`` differs, plus the critic's settings for PPO: ``--critic-lr`` (default
1e-3, picked from short runs at 1e-4, 1e-3 and 1e-2; docs/performance.md) and micro-batch 128 like
the actor. Extra ``key=value`` arguments are passed to every run and win over the script's own
overrides.

Measures, per iteration: ``critic/score/mean`` (mean reward of the iteration's samples, before
that iteration's update), ``critic/acc/mean``, ``timing_s/step`` and, for PPO, the critic's
``vf_loss`` and ``vf_explained_var``; per run: the wall time and the median step.
Writes ``<out>/curves.json`` and ``<out>/curves.png`` (score vs iteration, one line per algorithm)
and prints a JSON summary to stdout; progress goes to stderr. The runs' stores and MLflow
databases go to ``--work-dir`` if given (kept), else to a temporary directory deleted at the end;
never under ``--out``.
Needs matplotlib: ``pip install -e .[bench]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
# Per-iteration metrics kept in curves.json; the critic's two are only there for PPO.
RECORDED = ("critic/score/mean", "critic/acc/mean", "timing_s/step", "critic/vf_loss", "critic/vf_explained_var")
HEAD_TAIL = 5  # iterations averaged at the start and at the end of a curve


def algorithm_overrides(critic_lr: float) -> dict[str, list[str]]:
    """What each algorithm changes on top of configs/demo.yaml."""
    return {
        "ppo": ["algorithm.adv_estimator=gae", f"critic.lr={critic_lr:g}",
                "critic.ppo_micro_batch_size_per_gpu=128"],
        "grpo": ["algorithm.adv_estimator=grpo"],
        "rloo": ["algorithm.adv_estimator=rloo"],
    }


def run_overrides(algo_overrides: list[str], algo: str, seed: int, iterations: int, work: Path,
                  extra: list[str]) -> list[str]:
    """The full override list of one run; its store, MLflow and KFP folders live under ``work``."""
    run_dir = work / f"{algo}-seed{seed}"
    return [
        "pipeline.runner=inline",
        f"store.uri={run_dir / 'store'}",
        f"tracking.uri=sqlite:///{run_dir / 'mlflow.db'}",
        f"pipeline.pipeline_root={run_dir / 'kfp'}",
        f"trainer.experiment_name={algo}",
        f"trainer.total_iterations={iterations}",
        f"trainer.seed={seed}",
        *algo_overrides,
        *extra,
    ]


def train_once(overrides: list[str]) -> tuple[dict[int, dict[str, float]], float]:
    """Train the demo config with ``overrides``; returns the per-iteration metrics and wall seconds."""
    from rich.console import Console

    from kfrl.config import load_config
    from kfrl.driver.controller import train

    config = load_config(DEMO_CONFIG, overrides)
    started = time.perf_counter()
    summary = train(config, console=Console(stderr=True))
    return summary.iterations, time.perf_counter() - started


def curve_rows(iterations: dict[int, dict[str, float]]) -> list[dict[str, float]]:
    """One row per iteration with the recorded metrics (those an algorithm does not log are left out)."""
    rows = []
    for iteration in sorted(iterations):
        metrics = iterations[iteration]
        row = {"iteration": iteration}
        row.update({name: round(metrics[name], 4) for name in RECORDED if name in metrics})
        rows.append(row)
    return rows


def summarize_run(rows: list[dict[str, float]], wall_s: float) -> dict[str, float]:
    """Score at the start and end of the curve, and time: the run's wall clock (including preparing
    the run and MLflow) and the median iteration (robust to other processes sharing the CPU)."""
    scores = scores_of(rows)
    return {
        "first": round(scores[0], 4),
        f"mean_first_{HEAD_TAIL}": round(statistics.fmean(scores[:HEAD_TAIL]), 4),
        f"mean_last_{HEAD_TAIL}": round(statistics.fmean(scores[-HEAD_TAIL:]), 4),
        "last": round(scores[-1], 4),
        "wall_s": round(wall_s, 1),
        "median_step_s": round(statistics.median(row["timing_s/step"] for row in rows), 2),
    }


def average_summaries(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each figure over seeds (the figures themselves when there is one seed)."""
    return {key: round(statistics.fmean(s[key] for s in summaries), 4) for key in summaries[0]}


def scores_of(rows: list[dict[str, float]]) -> list[float]:
    return [row["critic/score/mean"] for row in rows]


def run_algorithm(algo: str, algo_overrides: list[str], seeds: list[int], iterations: int, work: Path,
                  extra: list[str]) -> dict:
    runs = []
    for seed in seeds:
        overrides = run_overrides(algo_overrides, algo, seed, iterations, work, extra)
        log(f"[{algo} seed {seed}] training {iterations} iterations: {' '.join(algo_overrides + extra) or '(demo)'}")
        metrics, wall_s = train_once(overrides)
        rows = curve_rows(metrics)
        summary = summarize_run(rows, wall_s)
        log(f"[{algo} seed {seed}] done in {wall_s:.0f}s: {json.dumps(summary)}")
        runs.append({"seed": seed, "overrides": overrides, "iterations": rows, "summary": summary})
    return {"overrides": algo_overrides + extra, "runs": runs,
            "summary": average_summaries([run["summary"] for run in runs])}


def mean_curve(runs: list[dict]) -> tuple[list[int], list[float]]:
    """Iterations and the score averaged over the runs (seeds)."""
    its = [row["iteration"] for row in runs[0]["iterations"]]
    per_run = [scores_of(run["iterations"]) for run in runs]
    return its, [statistics.fmean(values) for values in zip(*per_run)]


def require_matplotlib():
    """matplotlib on the Agg backend, or exit with how to install it."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("bench/algo_curves.py needs matplotlib for the plot: pip install -e .[bench]")
    matplotlib.use("Agg")
    return matplotlib


def plot_curves(results: dict[str, dict], title: str, path: Path) -> None:
    require_matplotlib()
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for algo, result in results.items():
        its, scores = mean_curve(result["runs"])
        line, = ax.plot(its, scores, marker="o", markersize=3, label=algo_label(algo, result))
        if len(result["runs"]) > 1:
            per_run = [scores_of(run["iterations"]) for run in result["runs"]]
            ax.fill_between(its, [min(v) for v in zip(*per_run)], [max(v) for v in zip(*per_run)],
                            color=line.get_color(), alpha=0.15)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("critic/score/mean (fraction of correct samples)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_title(extra: list[str], iterations: int, seeds: list[int]) -> str:
    from kfrl.config import load_config

    config = load_config(DEMO_CONFIG, extra)
    seed_word = "seed" if len(seeds) == 1 else "mean of seeds"
    return (f"demo task, {iterations} iterations x {config.data.train_batch_size} prompts x "
            f"{config.rollout.n} samples, {seed_word} {','.join(map(str, seeds))}")


def algo_label(algo: str, result: dict) -> str:
    if algo == "ppo":
        critic_lr = next(o.split("=", 1)[1] for o in reversed(result["overrides"]) if o.startswith("critic.lr="))
        return f"PPO (critic + GAE, critic lr {critic_lr})"
    return algo.upper()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--algos", default="ppo,grpo,rloo", help="comma-separated subset of ppo,grpo,rloo")
    parser.add_argument("--seeds", default="1", help="comma-separated trainer.seed values, one run each")
    parser.add_argument("--critic-lr", type=float, default=1e-3, help="PPO's critic.lr")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "algo_curves")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the runs' stores and MLflow databases here (default: a temp dir, "
                             "deleted at the end; ~300 MB for the three default runs)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="extra overrides for every run")
    args = parser.parse_args()
    args.algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args


def run_all(args: argparse.Namespace, known: dict[str, list[str]], work: Path) -> dict[str, dict]:
    log(f"runs' stores and MLflow under {work}")
    return {algo: run_algorithm(algo, known[algo], args.seeds, args.iterations, work, args.overrides)
            for algo in args.algos}


def main() -> None:
    args = parse_args()
    known = algorithm_overrides(args.critic_lr)
    unknown = [a for a in args.algos if a not in known]
    if unknown:
        sys.exit(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    require_matplotlib()  # fail before training, not after
    args.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    if args.work_dir:
        results = run_all(args, known, args.work_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="kfrl-algo-curves-") as tmp:
            results = run_all(args, known, Path(tmp))
    report = {
        "config": str(DEMO_CONFIG.relative_to(REPO)),
        "iterations": args.iterations,
        "seeds": args.seeds,
        "extra_overrides": args.overrides,
        "total_wall_s": round(time.perf_counter() - started, 1),
        "algorithms": results,
    }
    (args.out / "curves.json").write_text(json.dumps(report, indent=2) + "\n")
    title = plot_title(args.overrides, args.iterations, args.seeds)
    plot_curves(results, title, args.out / "curves.png")
    log(f"wrote {args.out / 'curves.json'} and {args.out / 'curves.png'}")
    print(json.dumps({"total_wall_s": report["total_wall_s"], "out": str(args.out),
                      **{algo: result["summary"] for algo, result in results.items()}}, indent=2))


if __name__ == "__main__":
    main()
