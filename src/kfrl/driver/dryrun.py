"""``kfrl train --dry-run``: the stage plan, the iteration count and what a real run would lack,
from the config alone (no model, no data beyond Parquet footers, no rollout backend loaded)."""
from __future__ import annotations

from pathlib import Path


def _local_parts(spec: str | None) -> list[Path]:
    if not spec or spec.startswith("builtin:"):
        return []
    return [Path(p.strip()).expanduser() for p in spec.split(",") if p.strip() and "://" not in p]


def _train_rows(cfg) -> int | None:
    """Rows of the training data, from Parquet footers only; None when unknown here."""
    if cfg.data.train_files == "builtin:arith":
        return cfg.data.builtin_train_size
    parts = _local_parts(cfg.data.train_files)
    if not parts or not all(p.is_file() for p in parts) or "://" in cfg.data.train_files:
        return None
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in parts)


def _column_warnings(part: Path, key: str, cfg) -> list[str]:
    """What a training run would refuse in a data file's columns, from its Parquet footer."""
    import pyarrow.parquet as pq

    from kfrl.data.dataset import missing_columns

    try:
        columns = pq.read_schema(part).names
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported, not raised
        return [f"{key}: {part} is not a readable Parquet file ({err})"]
    return [f"{key}: {part} lacks column '{name}' ({why}); its columns are: {', '.join(columns)}"
            for name, why in missing_columns(columns, cfg)]


def report(cfg) -> tuple[str, list[str]]:
    """The stage plan and iteration count as text, and warnings about what is missing. Nothing is
    loaded: no model, no data beyond Parquet footers, no rollout backend."""
    import importlib.util

    from kfrl.stages import plan, skip_reason

    lines = ["stage plan (one KFP pipeline run per iteration):"]
    for stage, why in plan(cfg).items():
        lines.append(f"  {'run ' if not why else 'skip'}  {stage:<13} {('— ' + why) if why else ''}")
    warnings = []
    if not skip_reason("validate", cfg, 0):
        lines.append("  validation of the initial policy before iteration 1 (trainer.val_before_train)")
    rows = _train_rows(cfg)
    if cfg.trainer.total_iterations:
        lines.append(f"iterations: {cfg.trainer.total_iterations} (trainer.total_iterations)")
    elif rows is not None:
        per_epoch = rows // cfg.data.train_batch_size
        lines.append(f"iterations: {per_epoch * cfg.trainer.total_epochs} = {per_epoch} per epoch ({rows} rows // "
                     f"{cfg.data.train_batch_size} prompts, drop_last) x {cfg.trainer.total_epochs} epochs")
    else:
        lines.append(f"iterations: {cfg.trainer.total_epochs} epochs x (training rows // "
                     f"{cfg.data.train_batch_size}), counted when the data is read")
    for key, path in (("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path if cfg.use_critic
                                                          else ""), ("reward.model_path", cfg.reward.model_path)):
        if path and not path.startswith(("builtin:", "models:/")) and "://" not in path \
                and not (Path(path).expanduser() / "config.json").is_file():
            warnings.append(f"{key}: {path} is not a local HF model directory (no config.json); "
                            "kfrl loads models from local directories or the store, not from a hub")
    for key, spec in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for part in _local_parts(spec):
            if not part.is_file():
                warnings.append(f"{key}: {part} does not exist (prepare GSM8K with `kfrl data gsm8k`)")
                continue
            warnings += _column_warnings(part, key, cfg)
    if cfg.reward.custom_function_path:
        from kfrl.rewards import load_custom_reward

        try:
            load_custom_reward(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
        except Exception as err:  # noqa: BLE001 - whatever the user's file does on import is reported
            warnings.append(f"reward.custom_function_path: {type(err).__name__}: {err}")
    if cfg.pipeline.runner == "kfp":
        from kfrl.driver.submit import cluster_input_problems

        warnings += [f"pipeline.runner=kfp: {problem}" for problem in cluster_input_problems(cfg)]
    if cfg.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        warnings.append("rollout.name=vllm: the vllm package is not installed here (pip install 'kfrl[gpu]', or "
                        "the kfrl GPU image); rollout.name=torch or auto run without it")
    return "\n".join(lines), warnings
