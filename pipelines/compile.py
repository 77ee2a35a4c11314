"""Compile the pipelines to KFP IR YAML (uploadable in the KFP UI, runnable with kfp.Client)."""
from __future__ import annotations

from pathlib import Path

COMPILED_DIR = Path(__file__).resolve().parent / "compiled"


def compiled_path(name: str = "rl_iteration") -> Path:
    return COMPILED_DIR / f"{name}.yaml"


def compile_pipelines(output_dir: str | Path | None = None) -> list[Path]:
    from kfp import compiler

    from kfrl.pipelines.rl_iteration import PIPELINES

    out = Path(output_dir) if output_dir else COMPILED_DIR
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, pipeline in PIPELINES.items():
        target = out / f"{name}.yaml"
        compiler.Compiler().compile(pipeline, str(target))
        written.append(target)
    return written
