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
