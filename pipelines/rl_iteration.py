"""One RL iteration as a KFP pipeline.

              ┌─► score ───────┐
              ├─► gen_max ─────┤                 ┌─► update_critic
    rollout ──┼─► old_logprob ─┼─► advantage ────┤
              ├─► ref_logprob ─┤                 └─► update_actor ─► validate
              └─► values ──────┘

Everything that reads only the rollout (scoring, ReMax's greedy baseline, the old/reference
log-probs, the critic's values) is a parallel branch; the critic and actor updates are too.

The edges are derived from ``kfrl.stages.STAGE_TABLE`` (what each stage reads or needs), not
written here. ``rl_iteration_fused`` runs the same stage functions as two tasks, ``infer`` (rollout to values)
then ``train`` (advantage and both updates), and ``rl_iteration_single`` as one task, so weights
and imports are loaded once per task (config ``pipeline.fuse``). A stage the algorithm does not
need (no KL → no reference; no GAE → no critic; not ReMax → no greedy baseline; the on-policy
shortcut → no old-logprob pass; validation only every trainer.test_freq iterations) still appears
as a task in the committed pipelines and records why it was skipped, so one compiled pipeline serves
every algorithm. Compiled for a run (``kfrl.pipelines.compile.compile_pipelines`` with its config, as
the cluster driver does) the stages the run skips in every iteration have no task: no pod starts for
them, and the driver records their skips.
``rl_validate`` validates one policy on its own (the initial one, for trainer.val_before_train).
"""
from kfp import dsl

from kfrl.components.stages import (
    advantage_op,
    gen_max_op,
    infer_op,
    iteration_op,
    old_logprob_op,
    ref_logprob_op,
    rollout_op,
    score_op,
    train_op,
    update_actor_op,
    update_critic_op,
    validate_op,
    values_op,
)
from kfrl.components.train import engine_cleanup_op, train_driver_op
from kfrl.driver.engine.client import REQUIRED_VARIABLE as ENGINE_REQUIRED_VARIABLE
from kfrl.stages import STAGES, always_skipped, pipeline_edges

PIPELINE_NAME = "kfrl-rl-iteration"
FUSED_PIPELINE_NAME = "kfrl-rl-iteration-fused"
SINGLE_PIPELINE_NAME = "kfrl-rl-iteration-single"
VALIDATE_PIPELINE_NAME = "kfrl-validate"
TRAIN_PIPELINE_NAME = "kfrl-rl-train"
RETRIES = 2
# Tasks that load a model (a GPU on a cluster); the others (scoring with rule rewards, advantages, the
# driver) run on the CPU image. Fused tasks hold GPU stages.
GPU_TASKS = {"rollout", "gen_max", "old_logprob", "ref_logprob", "values", "update_critic", "update_actor",
             "validate", "infer", "train", "iteration"}
# With trainer.nnodes > 1 these tasks run no update themselves: they submit it as a multi-node job
# (kfrl.distributed.multinode, cluster.multi_node) and wait, on the CPU image without accelerators.
MULTI_NODE_TASKS = {"update_actor", "update_critic", "train"}
# Set by kfrl.pipelines.compile while compiling for a cluster (the config, or only its `cluster`
# section, and whether a reward model makes scoring a GPU task); None compiles plain tasks.
# "engine": a kfrl.driver.engine.workload.EngineBinding when the run has an engine on the cluster.
CLUSTER: dict = {"config": None, "gpu_tasks": GPU_TASKS, "engine": None}
# A task of a run with a cluster engine that finds no live engine fails and is retried while the
# driver replaces the engine (its pod is recreated within minutes): 30 s, 60 s, ... up to 5 min apart.
ENGINE_CLIENT_RETRIES = 5


def _task(task, name: str):
    # The store makes every stage idempotent, so KFP's own cache is off and retries are safe.
    task.set_display_name(name)
    task.set_caching_options(False)
    task.set_retry(num_retries=RETRIES, backoff_duration="5s", backoff_factor=2.0)
    if CLUSTER["config"] is not None:
        cluster, gpu, gpus = task_shape(CLUSTER["config"], name, CLUSTER["gpu_tasks"])
        engine = CLUSTER["engine"] if name != "driver" else None
        if engine is not None and gpu:  # the engine runs it: this task is a CPU-only client
            gpu, gpus = False, 0
            task.set_env_variable(ENGINE_REQUIRED_VARIABLE, "1")
            task.set_retry(num_retries=ENGINE_CLIENT_RETRIES, backoff_duration="30s", backoff_factor=2.0,
                           backoff_max_duration="300s")
        shape_for_cluster(task, cluster, gpu=gpu, gpus=gpus)
        if engine is not None:
            bind_to_engine(task, engine)
    return task


def bind_to_engine(task, engine):
    """A task of a run whose engine lives on the cluster: it carries the run's label (the engine's
    NetworkPolicy admits only those pods) and the run's engine token, from the secret the driver made."""
    from kfp import kubernetes

    from kfrl.driver.engine.workload import LABEL_RUN, TOKEN_KEY

    kubernetes.add_pod_label(task, LABEL_RUN, engine.run_label)
    kubernetes.use_secret_as_env(task, secret_name=engine.secret_name, secret_key_to_env={TOKEN_KEY: TOKEN_KEY})
    return task


def owned_by_its_pod(task):
    """The driver's pod name and uid (the downward API), so the engine it creates is owned by it and
    Kubernetes deletes the engine when the driver's pod goes."""
    from kfp import kubernetes

    from kfrl.driver.engine.workload import POD_NAME_VARIABLE, POD_UID_VARIABLE

    kubernetes.use_field_path_as_env(task, env_name=POD_NAME_VARIABLE, field_path="metadata.name")
    kubernetes.use_field_path_as_env(task, env_name=POD_UID_VARIABLE, field_path="metadata.uid")
    return task


def task_shape(config, name: str, gpu_tasks=GPU_TASKS) -> tuple:
    """(cluster section, GPU task?, accelerators) of task ``name`` under ``config``: the whole config, or
    only its ``cluster`` section (then GPU tasks ask for ``cluster.gpu_stages.gpus``, as before).

    With the whole config a GPU task asks for one accelerator per process, ``trainer.n_gpus_per_node``
    (``cluster.gpu_stages.gpus`` may ask for more), none under ``trainer.device=cpu`` unless
    gpu_stages.gpus says so; and with ``trainer.nnodes > 1`` the update tasks are CPU tasks that submit
    the multi-node job."""
    cluster = getattr(config, "cluster", config)
    if cluster is config:
        return cluster, name in gpu_tasks, None
    from kfrl.kube import gpus_per_node

    gpu = name in gpu_tasks and not (config.trainer.nnodes > 1 and name in MULTI_NODE_TASKS)
    return cluster, gpu, gpus_per_node(config) if gpu else None


def shape_for_cluster(task, cluster, *, gpu: bool, gpus: int | None = None):
    """Image, resources, placement, credentials and /dev/shm of one task, from the ``cluster`` config;
    ``gpus``: the accelerator limit (None: that of ``cluster.gpu_stages`` / ``cpu_stages``)."""
    from kfp import kubernetes

    task.set_container_image(cluster.image if gpu else cluster.cpu_image)
    resources = cluster.gpu_stages if gpu else cluster.cpu_stages
    if resources.cpu:
        task.set_cpu_request(resources.cpu).set_cpu_limit(resources.cpu)
    if resources.memory:
        task.set_memory_request(resources.memory).set_memory_limit(resources.memory)
    gpus = resources.gpus if gpus is None else gpus
    if gpus:
        task.set_accelerator_type(resources.accelerator).set_accelerator_limit(gpus)
    if gpu:
        for key, value in cluster.node_selector.items():
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        for toleration in cluster.tolerations:
            kubernetes.add_toleration(task, key=toleration.key or None, operator=toleration.operator,
                                      value=toleration.value or None, effect=toleration.effect or None)
        if cluster.shm_size:
            kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                       size_limit=cluster.shm_size)
    if cluster.secret:
        kubernetes.use_secret_as_env(task, secret_name=cluster.secret,
                                     secret_key_to_env={key: key for key in cluster.secret_keys}, optional=True)
    if cluster.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(cluster.image_pull_secrets))
    kubernetes.set_image_pull_policy(task, cluster.image_pull_policy)
    return task


def pipeline_stages(config) -> tuple[str, ...]:
    """The stages an iteration pipeline compiled for ``config`` holds a task for: all of them without a
    run's config (the committed pipelines, one for every algorithm), else those the run does not skip
    in every iteration (``kfrl.stages.always_skipped``: their skip records come from the driver)."""
    if config is None or not hasattr(config, "trainer"):
        return STAGES
    skipped = set(always_skipped(config))
    return tuple(stage for stage in STAGES if stage not in skipped)


STAGE_OPS = {"rollout": rollout_op, "gen_max": gen_max_op, "score": score_op, "old_logprob": old_logprob_op,
             "ref_logprob": ref_logprob_op, "values": values_op, "advantage": advantage_op,
             "update_critic": update_critic_op, "update_actor": update_actor_op, "validate": validate_op}


def build_pipelines() -> dict:
    """The pipelines, built now: KFP runs a pipeline's body when it is decorated, so the cluster shape
    (``CLUSTER``, set by ``kfrl.pipelines.compile``) applies to pipelines built while it is set."""
    @dsl.pipeline(name=PIPELINE_NAME, description="One veRL-style RL iteration: rollout, then score, "
                  "greedy baseline, old/ref log-probs and critic values in parallel, advantage, then the critic "
                  "and actor updates. Inputs and outputs live in the run's store.")
    def rl_iteration(run_uri: str = "", iteration: int = 1) -> str:
        """One iteration of a prepared run.

        Args:
            run_uri: The run's folder in the store (s3://bucket/prefix/<experiment>/<run-id>), as printed by kfrl train or kfrl submit; the run must be prepared.
            iteration: The iteration to run (1 = the first); its stages already committed are not redone.
        """
        # Every edge comes from kfrl.stages.STAGE_TABLE: a stage runs after the stages it reads or needs.
        tasks = {}
        for stage, upstream in pipeline_edges(pipeline_stages(CLUSTER["config"])).items():
            tasks[stage] = _task(STAGE_OPS[stage](run_uri=run_uri, iteration=iteration), stage)
            for name in upstream:
                tasks[stage].after(tasks[name])
        return tasks["update_actor"].outputs["Output"]

    @dsl.pipeline(name=FUSED_PIPELINE_NAME, description="One veRL-style RL iteration in two fused tasks: "
                  "infer (rollout, score, greedy baseline, old/ref log-probs, values) and train (advantage, "
                  "critic and actor updates).")
    def rl_iteration_fused(run_uri: str = "", iteration: int = 1) -> str:
        """One iteration of a prepared run.

        Args:
            run_uri: The run's folder in the store (s3://bucket/prefix/<experiment>/<run-id>), as printed by kfrl train or kfrl submit; the run must be prepared.
            iteration: The iteration to run (1 = the first); its stages already committed are not redone.
        """
        infer = _task(infer_op(run_uri=run_uri, iteration=iteration), "infer")
        train = _task(train_op(run_uri=run_uri, iteration=iteration), "train").after(infer)
        return train.outputs["Output"]

    @dsl.pipeline(name=SINGLE_PIPELINE_NAME, description="One veRL-style RL iteration as a single task "
                  "(all stages in one process).")
    def rl_iteration_single(run_uri: str = "", iteration: int = 1) -> str:
        """One iteration of a prepared run.

        Args:
            run_uri: The run's folder in the store (s3://bucket/prefix/<experiment>/<run-id>), as printed by kfrl train or kfrl submit; the run must be prepared.
            iteration: The iteration to run (1 = the first); its stages already committed are not redone.
        """
        return _task(iteration_op(run_uri=run_uri, iteration=iteration), "iteration").outputs["Output"]

    @dsl.pipeline(name=VALIDATE_PIPELINE_NAME, description="Validate the policy after an iteration (0 = the "
                  "initial policy) on the run's validation data; metrics val-core/<data_source>/...")
    def rl_validate(run_uri: str = "", iteration: int = 1) -> str:
        """Validation of one policy of a prepared run.

        Args:
            run_uri: The run's folder in the store (s3://bucket/prefix/<experiment>/<run-id>), as printed by kfrl train or kfrl submit; the run must be prepared.
            iteration: The policy to validate: after this iteration (0 = the initial policy).
        """
        return _task(validate_op(run_uri=run_uri, iteration=iteration), "validate").outputs["Output"]



    @dsl.pipeline(name=TRAIN_PIPELINE_NAME, description="A whole RL training run: prepare (or resume) it, then one "
                  "kfrl-rl-iteration run per iteration through this cluster's KFP API, metrics and model versions to "
                  "MLflow (as `kfrl train` does); optionally promote the result to an MLflow alias. Start it from the "
                  "KFP UI or on a schedule (`kfrl schedule`).")
    def rl_train(config_uri: str = "", model_path: str = "", train_files: str = "", val_files: str = "",
                 store_uri: str = "", tracking_uri: str = "", experiment_name: str = "", iterations: int = 0,
                 run_id: str = "", overrides: str = "", promote_alias: str = "", runner: str = "kfp"):
        """A whole training run.

        Args:
            config_uri: A kfrl config YAML in the store, s3://bucket/prefix/configs/<name>.yaml (kfrl submit and kfrl schedule put it there and fill this in; or copy a configs/*.yaml file there). Empty = the defaults. The fields below override it.
            model_path: The initial policy: an HF directory in the store (s3://...), or a registered version, models:/<name>@champion or models:/<name>/<version>. Empty = the config's model.path.
            train_files: Training data, Parquet in veRL's RL-dataset schema (s3://.../train.parquet). Empty = the config's.
            val_files: Validation data (s3://.../test.parquet). Empty = the config's.
            store_uri: Where runs live: s3://bucket/prefix (terraform output store_uri). Empty = the config's store.uri.
            tracking_uri: The MLflow tracking URI (terraform output tracking_uri). Empty = $MLFLOW_TRACKING_URI of the task (the credentials secret), else the config's.
            experiment_name: trainer.experiment_name (the run's folder and the MLflow run name). Empty = the config's.
            iterations: Total iterations of the run; 0 = the config's trainer.total_iterations (or its epochs).
            run_id: Resume this kfrl run; empty = a new run named after this KFP run (a retried task resumes it).
            overrides: More config overrides, space-separated key=value (e.g. actor.lr=1e-6 rollout.n=8).
            promote_alias: After training, move this MLflow alias (e.g. champion) to the new version when its validation metric is better; empty = do not promote.
            runner: How iterations run: kfp (runs on this cluster), local or inline (inside this task; for tests).
        """
        # Whatever ends the run (success, failure, cancellation), the run's engine objects go with it.
        cleanup = _task(engine_cleanup_op(kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, runner=runner), "cleanup")
        cleanup.set_retry(num_retries=RETRIES, backoff_duration="5s", backoff_factor=2.0)
        with dsl.ExitHandler(cleanup, name="engine-cleanup"):
            driver = train_driver_op(config_uri=config_uri, model_path=model_path, train_files=train_files,
                                     val_files=val_files, store_uri=store_uri, tracking_uri=tracking_uri,
                                     experiment_name=experiment_name, iterations=iterations, run_id=run_id,
                                     overrides=overrides, promote_alias=promote_alias, runner=runner,
                                     kfp_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
            _task(driver, "driver")
            owned_by_its_pod(driver)
        # No pipeline output: KFP cannot return one from inside an exit handler. The run's URI is the
        # driver task's output and in its summary metrics; `kfrl submit --wait` reads summary.json.

    return {"rl_iteration": rl_iteration, "rl_iteration_fused": rl_iteration_fused,
            "rl_iteration_single": rl_iteration_single, "rl_validate": rl_validate, "rl_train": rl_train}


PIPELINES = build_pipelines()
FUSE_TO_PIPELINE = {"none": "rl_iteration", "weights": "rl_iteration_fused", "all": "rl_iteration_single"}


def pipeline_for(fuse: str, pipeline: str = "iteration") -> str:
    """The compiled pipeline that runs ``pipeline`` ("iteration" or "validate") under ``pipeline.fuse``."""
    return "rl_validate" if pipeline == "validate" else FUSE_TO_PIPELINE[fuse]
