"""The stages run where only the engine's packages exist (the GPU image's benchmark machine has no
MLflow, KFP, s3fs or boto3): preparing a run and one iteration import none of them."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from test_algo_pipeline import SMALL

SCRIPT = textwrap.dedent("""
    import sys
    for name in ("mlflow", "kfp", "s3fs", "boto3", "botocore"):
        sys.modules[name] = None  # an import of any of them raises ImportError
    from kfrl.config import load_config
    from kfrl.stages import STAGES, run_stage
    from kfrl.stages.prepare import prepare_run
    from kfrl.store import Store

    store = Store(sys.argv[1])
    prepare_run(store, load_config(None, sys.argv[2:] + [f"store.uri={sys.argv[1]}", "pipeline.runner=inline"]))
    for stage in STAGES:
        run_stage(stage, store.uri, 1)
    print("committed", sorted(m for m in STAGES if store.manifest(f"iter-000001/{m}") is not None))
""")


def test_a_run_prepares_and_iterates_without_mlflow_kfp_or_s3_packages(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), *SMALL],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'update_actor'" in done.stdout and "'rollout'" in done.stdout
