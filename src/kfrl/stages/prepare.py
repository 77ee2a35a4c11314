"""Run preparation (once per training run, idempotent): config, training data and the initial policy
are committed into the run's store, so every stage, local or on a cluster, reads them from there."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kfrl.config import Config
from kfrl.run import CRITIC_STAGE, INIT_ITERATION, POLICY_STAGE, Run, stage_prefix
from kfrl.store import Store

# Each preparation commit records a fingerprint of the settings it was made from. Until the run's
# config.yaml exists (written last: the preparation's own commit), a commit whose fingerprint differs
# from the current invocation's was made for another config, so it is discarded and redone.
FINGERPRINT = "prepared_with"

BUILTIN_DATA = {"builtin:arith", "builtin:arith_tools"}


def fingerprint(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _data_settings(config: Config, spec: str) -> dict:
    data = config.data
    settings = {"source": spec, "seed": data.seed, "builtin": [data.builtin_train_size, data.builtin_val_size],
                "prompt_key": data.prompt_key, "reward": [config.reward.name, config.reward.custom_function_path]}
    if data.filter_overlong_prompts:
        settings.update(filter=[data.max_prompt_length, config.model.path])
    return settings


def _read_dataset_source(spec: str, *, split: str, config: Config):
    """A table in veRL's RL-dataset schema from a builtin name, a local file or a store URI, checked for
    the columns the run needs."""
    import pyarrow as pa

    from kfrl.batch import table_from_parquet_bytes
    from kfrl.data.dataset import check_columns

    if spec in BUILTIN_DATA:
        from kfrl.data.synthetic import make_arith_rows, make_tool_rows

        n = config.data.builtin_train_size if split == "train" else config.data.builtin_val_size
        seed = config.data.seed if split == "train" else config.data.seed + 7919
        make_rows = make_tool_rows if spec == "builtin:arith_tools" else make_arith_rows
        # The synthetic task's held-out problems are its "test" split.
        return pa.Table.from_pylist(make_rows(n, seed, "train" if split == "train" else "test"))
    tables = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if "://" in part:
            root, _, name = part.rpartition("/")
            data = Store(root).read_bytes(name)
        else:
            path = Path(part).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"data file not found: {path} (data.{split}_files); expected a Parquet "
                                        "file in veRL's RL-dataset schema, or builtin:arith / builtin:arith_tools")
            data = path.read_bytes()
        table = table_from_parquet_bytes(data, part, written_by=f"you (data.{split}_files)")
        check_columns(table.column_names, config, part, f"data.{split}_files")
        tables.append(table)
    return pa.concat_tables(tables)


def filter_overlong(table, tokenizer, config: Config, source: str):
    """veRL's data.filter_overlong_prompts: drop rows whose templated prompt exceeds max_prompt_length."""
    from kfrl.data.dataset import prompt_messages, tokenize_prompt

    keep = []
    for i, row in enumerate(table.select([config.data.prompt_key]).to_pylist()):
        ids = tokenize_prompt(tokenizer, prompt_messages(row, config.data.prompt_key, f"{source} row {i}"),
                              10**9, f"{source} row {i}")
        if len(ids) <= config.data.max_prompt_length:
            keep.append(i)
    return table.take(keep)


def _is_current(store: Store, prefix: str, settings: dict) -> bool:
    """Whether ``prefix`` holds a commit to keep. Before the run's config exists, one made from other
    settings is withdrawn (see FINGERPRINT), so the caller prepares it again."""
    manifest = store.manifest(prefix)
    if manifest is None:
        return False
    if Run(store).has_config() or manifest.info.get(FINGERPRINT, fingerprint(settings)) == fingerprint(settings):
        return True
    store.uncommit(prefix)
    return False


def prepare_data(store: Store, config: Config) -> None:
    for split, spec in (("train", config.data.train_files), ("val", config.data.val_files)):
        prefix = f"data/{split}"
        settings = _data_settings(config, spec) if spec else {}
        if spec is None or _is_current(store, prefix, settings):
            continue
        table = _read_dataset_source(spec, split=split, config=config)
        info = {"source": spec, "rows": table.num_rows, FINGERPRINT: fingerprint(settings)}
        if config.data.filter_overlong_prompts:
            from kfrl.stages.context import StageContext

            # The run's config.yaml is written after preparation, so the context gets the config directly.
            ctx = StageContext(store.uri, INIT_ITERATION, Run(store), config)
            before = table.num_rows
            table = filter_overlong(table, ctx.load_tokenizer(ctx.policy_manifest(INIT_ITERATION)), config, spec)
            info.update(rows=table.num_rows, filtered_overlong=before - table.num_rows)
        attempt = store.open_attempt(prefix)
        attempt.write_parquet("part-00000.parquet", table)
        attempt.commit(info=info)


def _commit_weights(attempt, path: str, key: str, tracking_uri: str = "") -> None:
    """Commit weights from a builtin name (built here), a store URI (referenced in place), a local HF
    directory (checked, then uploaded) or a registered model version (``models:/<name>/<version>``,
    ``models:/<name>@<alias>``: its source, resolved now and recorded, so a resumed run keeps the
    version it started from); ``key`` names the config key in errors."""
    settings = {FINGERPRINT: fingerprint({key: path})}
    # Spelled out rather than kfrl.registry.is_models_uri: importing the registry imports MLflow, which
    # the stages (and the GPU image's engine) must not need unless a models:/ URI is given.
    if path.startswith("models:/"):
        from kfrl.models import cache_dir
        from kfrl.registry import model_version_source

        source, facts = model_version_source(path, tracking_uri, cache_dir())
        settings.update(facts)
        path = source
    if path.startswith("builtin:"):
        from kfrl.models.tiny import materialize_builtin

        attempt.upload_dir(materialize_builtin(path))
        attempt.commit(info={"source": path, **settings})
    elif "://" in path and not path.startswith("file://"):
        attempt.commit(info={"source": path, **settings})
    else:
        from kfrl.models.hf_io import check_safetensors

        local = Path(path.removeprefix("file://")).expanduser()
        if not (local / "config.json").is_file():
            raise FileNotFoundError(f"{key} {local} is not an HF model directory (no config.json there)")
        check_safetensors(local, key)  # corrupt weights are refused here, never committed
        attempt.upload_dir(local)
        attempt.commit(info={"source": str(local.resolve()), **settings})


def prepare_policy(store: Store, config: Config) -> None:
    """Commit the initial weights as iteration 0's policy."""
    prefix = stage_prefix(INIT_ITERATION, POLICY_STAGE)
    if not _is_current(store, prefix, {"model.path": config.model.path}):
        _commit_weights(store.open_attempt(prefix), config.model.path, "model.path",
                        config.tracking.from_environment().uri)


def prepare_critic(store: Store, config: Config) -> None:
    """Commit the critic's initialisation as iteration 0's ``update_critic``: a reference, not a copy.

    Default: the actor's initial weights (``init_from: policy``: nothing is copied and no model code
    runs here); otherwise ``critic.model_path``, handled like ``model.path``. A missing value head is
    added (seeded by trainer.seed) when a stage loads the critic.
    """
    prefix = stage_prefix(INIT_ITERATION, CRITIC_STAGE)
    key = "critic.model_path"
    if not config.use_critic or _is_current(store, prefix, {key: config.critic.model_path}):
        return
    attempt = store.open_attempt(prefix)
    if config.critic.model_path:
        _commit_weights(attempt, config.critic.model_path, key, config.tracking.from_environment().uri)
    else:
        attempt.commit(info={"init_from": "policy", FINGERPRINT: fingerprint({key: ""})})


def prepare_run(store: Store, config: Config) -> None:
    """Commit the initial policy (and critic), then the data, then the config: a run whose config.yaml
    exists is prepared. Before that, a repeated call with another config redoes what differs."""
    if config.reward.custom_function_path and config.pipeline.runner != "kfp":
        from kfrl.rewards import load_custom_reward

        # Stages on this machine will import it: a missing file or function is refused now, not mid-run.
        load_custom_reward(config.reward.custom_function_path, config.reward.custom_function_name)
    prepare_policy(store, config)
    prepare_critic(store, config)
    prepare_data(store, config)  # after the policy: filtering overlong prompts needs its tokenizer
    run = Run(store)
    if not run.has_config():
        run.write_config(config.to_yaml())
