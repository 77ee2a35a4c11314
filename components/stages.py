"""The stage components: one per stage of kfrl.stages.STAGE_TABLE, plus the fused groups. Each takes
the run and the iteration and returns its stage's URI; the pipeline orders them with ``.after()``
from the table. Bodies import inside the function: KFP ships only the function's source."""
import os

from kfp import dsl
from kfp.dsl import Metrics, Output

# The component image on a cluster (docker/gpu.Dockerfile); the local runner ignores it. `kfrl compile
# --config C` sets every task's image from the config's `cluster` section (`--image` overrides it);
# KFRL_IMAGE changes this default.
IMAGE = os.environ.get("KFRL_IMAGE", "ghcr.io/kfrl/kfrl-gpu:0.1.0")


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def rollout_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("rollout", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def gen_max_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("gen_max", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def score_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("score", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def old_logprob_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("old_logprob", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def ref_logprob_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("ref_logprob", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def values_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("values", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def advantage_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("advantage", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def update_critic_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("update_critic", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def update_actor_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("update_actor", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def validate_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_for_kfp
    return run_for_kfp("validate", run_uri, iteration, metrics)


# Fused components (pipeline.fuse): the same stage functions, fewer processes per iteration.
@dsl.component(base_image=IMAGE, install_kfp_package=False)
def infer_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_group_for_kfp
    return run_group_for_kfp("infer", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def train_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_group_for_kfp
    return run_group_for_kfp("train", run_uri, iteration, metrics)


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def iteration_op(run_uri: str, iteration: int, metrics: Output[Metrics]) -> str:
    from kfrl.driver.kfp_entry import run_group_for_kfp
    return run_group_for_kfp("iteration", run_uri, iteration, metrics)
