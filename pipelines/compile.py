"""Compile the pipelines to KFP IR YAML (uploadable in the KFP UI, runnable with kfp.Client)."""
from __future__ import annotations

from pathlib import Path

COMPILED_DIR = Path(__file__).resolve().parent / "compiled"


def compiled_path(name: str = "rl_iteration") -> Path:
    return COMPILED_DIR / f"{name}.yaml"


def compile_pipelines(output_dir: str | Path | None = None, config=None, engine=None) -> list[Path]:
    """Write every pipeline's IR YAML. With ``config``, tasks are shaped for a cluster from its ``cluster``
    section (images, CPU/memory/GPU, node selector and tolerations, the credentials secret, /dev/shm);
    without, they are plain (the committed pipelines/compiled/*.yaml, and the local runner). With
    ``engine`` (an ``EngineBinding``: the run has its engine on the cluster) the GPU stages' tasks are
    CPU-only clients of it that carry the run's label and engine token."""
    from kfp import compiler

    from kfrl.pipelines import rl_iteration

    out = Path(output_dir) if output_dir else COMPILED_DIR
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        gpu_tasks = set(rl_iteration.GPU_TASKS) | ({"score"} if config.reward.name == "model" else set())
        rl_iteration.CLUSTER.update(config=config, gpu_tasks=gpu_tasks, engine=engine)
    written = []
    try:
        for name, pipeline in rl_iteration.build_pipelines().items():
            target = out / f"{name}.yaml"
            compiler.Compiler().compile(pipeline, str(target))
            written.append(target)
    finally:
        rl_iteration.CLUSTER.update(config=None, gpu_tasks=rl_iteration.GPU_TASKS, engine=None)
    return written


RUN_PIPELINES = "pipelines"  # under a run's folder: its pipelines, compiled from its own config


def run_pipelines(store, config, engine=None):
    """The run's pipelines compiled from its own config (``compile_pipelines``: images, resources,
    placement, credentials secret, /dev/shm, image pull secrets, no task for a stage it always skips),
    committed in the run's ``store`` under ``pipelines/<digest>``: one commit per distinct compiled
    spec, so the run's folder keeps which spec ran. Returns the manifest (``pipelines/<digest>``)."""
    import hashlib
    import shutil
    import tempfile

    import kfp

    with tempfile.TemporaryDirectory(prefix="kfrl-compile-") as tmp:
        paths = sorted(compile_pipelines(tmp, config, engine))
        digest = hashlib.sha256(b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in paths)).hexdigest()
        prefix = f"{RUN_PIPELINES}/{digest[:12]}"
        manifest = store.manifest(prefix)
        if manifest is None:
            attempt = store.open_attempt(prefix)
            with attempt.staged_dir() as folder:
                for path in paths:
                    shutil.copyfile(path, Path(folder) / path.name)
            manifest = attempt.commit(info={"sha256": digest, "kfp": kfp.__version__,
                                            "pipelines": [p.stem for p in paths]})
    return manifest
