"""The training prompts: which rows an iteration uses, and how a row becomes prompt token ids.

veRL's dataloader semantics: ``train_batch_size`` prompts per step, ``drop_last``, a fresh
shuffle each epoch. Here the rows of iteration N are a pure function of (N, seed), so a resumed
run never re-reads what earlier iterations consumed and a retried stage reads the same rows.
"""
from __future__ import annotations

import json

import numpy as np


class DatasetError(ValueError):
    """A dataset problem that names the file, the row and the column."""


def missing_columns(columns: list[str], config) -> list[tuple[str, str]]:
    """(column, why) for each column the run needs that ``columns`` lacks: the prompt, and for rule
    rewards the data source that picks the scorer and ``reward_model`` holding the ground truth
    (veRL's reward managers read both)."""
    need = [(config.data.prompt_key, "data.prompt_key: the chat prompt")]
    if config.reward.name == "rule":
        if not config.reward.custom_function_path:
            need.append((config.data.reward_fn_key, "data.reward_fn_key: picks the reward function"))
        need.append(("reward_model", "reward_model.ground_truth: what rule rewards compare against"))
    return [(name, why) for name, why in need if name not in columns]


def check_columns(columns: list[str], config, source: str, key: str) -> None:
    """Refuse a dataset without the columns the run needs, naming the user's file and the config key."""
    missing = missing_columns(columns, config)
    if missing:
        wanted = "; ".join(f"'{name}' ({why})" for name, why in missing)
        raise DatasetError(f"{source} ({key}) lacks column(s) {wanted}; its columns are: {', '.join(columns)}. "
                           "kfrl reads veRL's RL-dataset schema (`kfrl data gsm8k` writes it)")


def steps_per_epoch(n_rows: int, batch_size: int) -> int:
    return n_rows // batch_size


def iteration_rows(n_rows: int, batch_size: int, iteration: int, *, seed: int, shuffle: bool) -> tuple[int, np.ndarray]:
    """(epoch, row indices) of iteration ``iteration`` (1-based)."""
    per_epoch = steps_per_epoch(n_rows, batch_size)
    if per_epoch == 0:
        raise DatasetError(f"the training set has {n_rows} rows, fewer than data.train_batch_size={batch_size}")
    epoch, step = divmod(iteration - 1, per_epoch)
    order = np.random.default_rng(seed + epoch).permutation(n_rows) if shuffle else np.arange(n_rows)
    return epoch, order[step * batch_size:(step + 1) * batch_size]


def prompt_messages(row: dict, prompt_key: str, source: str) -> list[dict]:
    messages = row.get(prompt_key)
    if isinstance(messages, str):
        messages = json.loads(messages) if messages.startswith("[") else [{"role": "user", "content": messages}]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DatasetError(f"{source}: column '{prompt_key}' must hold chat messages "
                           f"([{{'role': 'user', 'content': ...}}]); got {type(messages).__name__}")
    return [dict(m) for m in messages]


def tokenize_prompt(tokenizer, messages: list[dict], max_length: int, source: str,
                    truncation: str = "error") -> list[int]:
    """The chat template applied by the tokenizer (with the generation prompt), then veRL's
    ``data.truncation``: "error" names the row, "left" keeps the last tokens, "right" the first."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return _truncated(list(ids), max_length, source, truncation)


def tokenize_prompts(tokenizer, conversations: list[list[dict]], max_length: int, sources: list[str],
                     truncation: str = "error", tools: list[dict] | None = None) -> list[list[int]]:
    """``tokenize_prompt`` of each conversation, the chat template rendered per conversation and the
    texts encoded in one batch (one call into the tokenizer's backend instead of one per prompt).
    ``tools``: OpenAI function schemas the template lists for the model (multi-turn rollouts)."""
    if not conversations:
        return []
    extra = {"tools": tools} if tools else {}
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **extra)
             for m in conversations]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [_truncated(list(ids), max_length, source, truncation) for ids, source in zip(encoded, sources)]


def _truncated(ids: list[int], max_length: int, source: str, truncation: str) -> list[int]:
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    raise DatasetError(f"{source}: prompt is {len(ids)} tokens, over data.max_prompt_length={max_length}; "
                       "set data.truncation=left|right, or data.filter_overlong_prompts=true to drop such rows")


def ground_truth_of(row: dict) -> str:
    reward_model = row.get("reward_model") or {}
    if isinstance(reward_model, str):
        reward_model = json.loads(reward_model)
    value = reward_model.get("ground_truth")
    return "" if value is None else str(value)
