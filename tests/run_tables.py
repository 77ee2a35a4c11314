"""Test helpers shared by modules: what a run committed, read back."""
from pathlib import Path

import pyarrow.parquet as pq

from kfrl.run import Run
from kfrl.stages import STAGES


def committed_tables(run: Run, iterations) -> dict[tuple[int, str, str], object]:
    """Every Parquet file every stage committed at ``iterations`` of a run in a local store."""
    tables = {}
    for iteration in iterations:
        for stage in STAGES:
            manifest = run.manifest(stage, iteration)
            for name in manifest.names():
                if name.endswith(".parquet"):
                    tables[(iteration, stage, name)] = pq.read_table(
                        Path(run.store.url(f"{manifest.prefix}/{manifest.attempt}/{name}")))
    return tables


def forget_process_state() -> None:
    """What a new process starts with: no training copy, no loaded models, no writes in flight."""
    from kfrl.models import hf_io
    from kfrl.stages import context, update

    update.drain()
    hf_io._TOKENIZER_FILES.clear()
    update._RESIDENT_TRAINERS.clear()
    context._MODEL_CACHE.clear()
    context._MODEL_SLOTS.clear()
    context._TOKENIZER_CACHE.clear()


def demo_config(root: Path, *overrides):
    """configs/demo.yaml with a store and an SQLite tracking database under ``root``."""
    from kfrl.config import load_config

    return load_config(Path("configs/demo.yaml"), [*overrides, f"store.uri={root / 'store'}",
                                                    f"tracking.uri=sqlite:///{root}/m.db"])
