"""The training driver as a KFP component: one task that prepares (or resumes) a kfrl run and drives its
iterations exactly as `kfrl train` does, submitting each iteration's pipeline through the KFP API of
the cluster it runs in. The body imports inside the function: KFP ships only the function's source."""
import os

from kfp import dsl
from kfp.dsl import Metrics, Output

# The driver needs no GPU: the CPU image (docker/cpu.Dockerfile). `kfrl compile --config` sets the
# images of every task from the config's `cluster` section; KFRL_CPU_IMAGE changes the default.
CPU_IMAGE = os.environ.get("KFRL_CPU_IMAGE", "ghcr.io/kfrl/kfrl-cpu:0.1.0")


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def train_driver_op(config_uri: str, model_path: str, train_files: str, val_files: str, store_uri: str,
                    tracking_uri: str, experiment_name: str, iterations: int, run_id: str, overrides: str,
                    promote_alias: str, runner: str, kfp_run_id: str, summary: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import train_for_kfp
    return train_for_kfp(config_uri=config_uri, model_path=model_path, train_files=train_files,
                         val_files=val_files, store_uri=store_uri, tracking_uri=tracking_uri,
                         experiment_name=experiment_name, iterations=iterations, run_id=run_id,
                         overrides=overrides, promote_alias=promote_alias, runner=runner, kfp_run_id=kfp_run_id,
                         metrics_artifact=summary)


@dsl.component(base_image=CPU_IMAGE, install_kfp_package=False)
def engine_cleanup_op(kfp_run_id: str, runner: str) -> str:
    from kfrl.driver.kfp_entry import cleanup_for_kfp
    return cleanup_for_kfp(kfp_run_id=kfp_run_id, runner=runner)
