"""Compile the pipelines to KFP IR YAML (uploadable in the KFP UI, runnable with kfp.Client)."""
from __future__ import annotations

from pathlib import Path

COMPILED_DIR = Path(__file__).resolve().parent / "compiled"


def compiled_path(name: str = "rl_iteration") -> Path:
    return COMPILED_DIR / f"{name}.yaml"


def compile_pipelines(output_dir: str | Path | None = None, config=None) -> list[Path]:
    """Write every pipeline's IR YAML. With ``config``, tasks are shaped for a cluster from its ``cluster``
    section (images, CPU/memory/GPU, node selector and tolerations, the credentials secret, /dev/shm);
    without, they are plain (the committed pipelines/compiled/*.yaml, and the local runner)."""
    from kfp import compiler

    from kfrl.pipelines import rl_iteration

    out = Path(output_dir) if output_dir else COMPILED_DIR
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        gpu_tasks = set(rl_iteration.GPU_TASKS) | ({"score"} if config.reward.name == "model" else set())
        rl_iteration.CLUSTER.update(config=config, gpu_tasks=gpu_tasks)
    written = []
    try:
        for name, pipeline in rl_iteration.build_pipelines().items():
            target = out / f"{name}.yaml"
            compiler.Compiler().compile(pipeline, str(target))
            written.append(target)
    finally:
        rl_iteration.CLUSTER.update(config=None, gpu_tasks=rl_iteration.GPU_TASKS)
    return written
