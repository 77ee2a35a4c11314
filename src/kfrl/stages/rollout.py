"""Stage ``rollout``: n responses per prompt from the current policy; writes the rollout column group.

With DAPO's dynamic sampling (``algorithm.filter_groups.enable``) it generates batches of
``data.gen_batch_size`` prompts, scores them, drops the prompt groups whose filter metric has no
spread, and keeps generating until ``train_batch_size`` groups are kept; then it trims to exactly
that many. The data stream is a cursor over fixed-size batches (veRL's dataloader with
``drop_last``): each rollout records the last batch it consumed, so the next iteration, a
retried stage and a resumed run all read the same prompts and never re-read consumed ones.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from kfrl.data.dataset import ground_truth_of, iteration_rows, prompt_messages, tokenize_prompt
from kfrl.stages.context import StageContext


class DynamicSamplingError(RuntimeError):
    """Dynamic sampling hit algorithm.filter_groups.max_num_gen_batches without enough groups."""


def read_dataset(store, manifest):
    """All Parquet files of a committed dataset, concatenated."""
    import pyarrow as pa

    from kfrl.batch import table_from_parquet_bytes

    parts = [table_from_parquet_bytes(store.read_file(manifest, name), store.file_url(manifest, name))
             for name in manifest.names() if name.endswith(".parquet")]
    return pa.concat_tables(parts)


@dataclass
class GenBatch:
    """One generation batch: its prompts (rows of the dataset) and n responses per prompt."""
    uids: list[str]
    records: list[dict]
    prompts: list[list[int]]
    generations: list  # prompt-major, n per prompt
    epoch: int


def first_data_batch(ctx: StageContext) -> int:
    """1-based index of the first data batch this iteration reads (the cursor after the previous rollout)."""
    if ctx.iteration == 1:
        return 1
    previous = ctx.manifest("rollout", ctx.iteration - 1)
    return int(previous.info.get("data_batch_end", ctx.iteration - 1)) + 1


def group_filter_values(cfg, scored) -> np.ndarray:
    """The per-trajectory value whose within-group spread decides whether DAPO keeps the group."""
    metric = cfg.algorithm.filter_groups.metric
    if metric == "acc":
        return np.array([s.acc for s in scored])
    if metric == "score":
        # veRL's "score" is the scorer's own value, before overlong shaping.
        return np.array([s.raw_score for s in scored])
    # seq_reward = sum of token-level scores; seq_final_reward = sum of token-level rewards, the
    # same here because the KL-in-reward combination is rejected by the config.
    return np.array([s.score for s in scored])


def rollout(ctx: StageContext, inputs, attempt) -> tuple[dict, dict[str, float]]:
    from kfrl import batch
    from kfrl.engines.rollout import SamplingParams

    cfg = ctx.config
    n = cfg.rollout.n
    train = ctx.store.manifest("data/train")
    if train is None:
        raise RuntimeError(f"no committed training data at {ctx.store.url('data/train')}; `kfrl train` prepares it")
    source = ctx.store.url("data/train")
    table = read_dataset(ctx.store, train)
    policy = ctx.policy_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(policy)
    engine = ctx.rollout_engine(policy)
    params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, max_new_tokens=cfg.data.max_response_length)
    dynamic = cfg.algorithm.filter_groups.enable
    batch_size = cfg.gen_batch_size if dynamic else cfg.data.train_batch_size
    rewards = ctx.rewards(tokenizer) if dynamic else None  # DAPO's filter scores every generation batch
    generate_seconds: list[float] = []

    def generate(data_batch: int, k: int) -> GenBatch:
        epoch, rows = iteration_rows(table.num_rows, batch_size, data_batch, seed=cfg.data.seed,
                                     shuffle=cfg.data.shuffle)
        records = table.take(rows).to_pylist()
        prompts = [tokenize_prompt(tokenizer, prompt_messages(r, cfg.data.prompt_key, f"{source} row {int(i)}"),
                                   cfg.data.max_prompt_length, f"{source} row {int(i)}", cfg.data.truncation)
                   for r, i in zip(records, rows)]
        started = time.perf_counter()
        generations = engine.generate_responses(prompts, params, seed=ctx.seed("rollout", stream=k))
        generate_seconds.append(time.perf_counter() - started)
        # The prompt group id; extra generation batches get their own so groups never merge.
        tag = f"it{ctx.iteration:06d}" + (f"-g{k}" if k else "")
        return GenBatch([f"{tag}-row{int(i)}" for i in rows], records, prompts, generations, epoch)

    start = first_data_batch(ctx)
    kept: list[tuple[GenBatch, int]] = []  # (generation batch, prompt index within it)
    n_gen_batches = 0
    while True:
        gen = generate(start + n_gen_batches, n_gen_batches)
        n_gen_batches += 1
        if not dynamic:
            kept = [(gen, g) for g in range(len(gen.uids))]
            break
        kept.extend((gen, g) for g in _filter(ctx, gen, rewards))
        if len(kept) >= cfg.data.train_batch_size:
            kept = kept[:cfg.data.train_batch_size]
            break
        limit = cfg.algorithm.filter_groups.max_num_gen_batches
        if limit > 0 and n_gen_batches >= limit:
            raise DynamicSamplingError(
                f"dynamic sampling kept {len(kept)} of the {cfg.data.train_batch_size} prompt groups it needs after "
                f"{n_gen_batches} generation batches (algorithm.filter_groups.max_num_gen_batches={limit}): every "
                f"other group's {cfg.algorithm.filter_groups.metric} was identical across its {n} samples. The data "
                "may be too hard or too easy for the policy; raise max_num_gen_batches (0 = no limit), "
                "data.gen_batch_size or rollout.n")

    columns: dict[str, list] = {name: [] for name in batch.GROUPS["rollout"].names}
    for gen, g in kept:
        record, prompt_ids, uid = gen.records[g], gen.prompts[g], gen.uids[g]
        for k in range(n):
            generation = gen.generations[g * n + k]
            columns["sample_id"].append(f"{uid}-s{k}")
            columns["uid"].append(uid)
            columns["iteration"].append(ctx.iteration)
            columns["policy_version"].append(ctx.iteration - 1)
            columns["data_source"].append(str(record.get(cfg.data.reward_fn_key, "")))
            columns["prompt_ids"].append(prompt_ids)
            columns["response_ids"].append(generation.response_ids)
            columns["response_mask"].append([1] * len(generation.response_ids))
            columns["rollout_logprobs"].append(generation.rollout_logprobs)
            columns["finish_reason"].append(generation.finish_reason)
            columns["ground_truth"].append(ground_truth_of(record))
            columns["extra_info"].append(json.dumps(record.get("extra_info") or {}, default=str))
            columns["raw_prompt"].append(json.dumps(prompt_messages(record, cfg.data.prompt_key, uid), default=str))
    attempt.info["data_batch_end"] = start + n_gen_batches - 1
    attempt.info["rollout_backend"] = engine.name

    response_lengths = np.array([len(r) for r in columns["response_ids"]], dtype=np.float64)
    prompt_lengths = np.array([len(gen.prompts[g]) for gen, g in kept], dtype=np.float64)
    metrics = {
        "training/epoch": float(kept[0][0].epoch),
        "response_length/mean": float(response_lengths.mean()),
        "response_length/max": float(response_lengths.max()),
        "response_length/min": float(response_lengths.min()),
        "response_length/clip_ratio": float((np.array(columns["finish_reason"]) == "length").mean()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
        "prompt_length/min": float(prompt_lengths.min()),
        "prompt_length/clip_ratio": float((prompt_lengths >= cfg.data.max_prompt_length).mean()),
        "perf/response_tokens": float(response_lengths.sum()),
        "perf/total_num_tokens": float(response_lengths.sum() + prompt_lengths.sum() * n),
        # The engine's generation alone; timing_s/gen is the whole stage (loading the policy, data, writing).
        "timing_s/generate_sequences": float(sum(generate_seconds)),
    }
    if dynamic:
        metrics["train/num_gen_batches"] = float(n_gen_batches)
    return columns, metrics


def _filter(ctx: StageContext, gen: GenBatch, rewards) -> list[int]:
    """DAPO's group filter over one generation batch: the prompt indices to keep."""
    from kfrl.algos.shaping import kept_groups

    cfg = ctx.config
    n = cfg.rollout.n
    records = [r for r in gen.records for _ in range(n)]
    scored = rewards.score(
        [g.response_ids for g in gen.generations], [str(r.get(cfg.data.reward_fn_key, "")) for r in records],
        [ground_truth_of(r) for r in records], [r.get("extra_info") for r in records],
        [json.dumps(prompt_messages(r, cfg.data.prompt_key, "row"), default=str) for r in records])
    return kept_groups(group_filter_values(cfg, scored), n)


def gen_max(ctx: StageContext, table, attempt) -> tuple[dict, dict[str, float]]:
    """Stage ``gen_max`` (ReMax): a greedy response to each prompt of the rollout, scored with the
    same reward; its score is the baseline of every sampled response to that prompt."""
    from kfrl.engines.rollout import SamplingParams

    cfg = ctx.config
    uids = table.column("uid").to_pylist()
    first_of_group: dict[str, int] = {}
    for row, uid in enumerate(uids):
        first_of_group.setdefault(uid, row)
    rows = list(first_of_group.values())
    policy = ctx.policy_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(policy)
    prompts = [table.column("prompt_ids")[r].as_py() for r in rows]
    params = SamplingParams(n=1, do_sample=False, max_new_tokens=cfg.data.max_response_length)
    greedy = ctx.rollout_engine(policy).generate_responses(prompts, params)
    responses = [g.response_ids for g in greedy]

    def column(name: str) -> list:
        return [table.column(name)[r].as_py() for r in rows]

    scored = ctx.rewards(tokenizer).score(responses, column("data_source"), column("ground_truth"),
                                          column("extra_info"), column("raw_prompt"))
    baseline = {uid: s.score for uid, s in zip(first_of_group, scored)}
    columns = {"sample_id": table.column("sample_id").to_pylist(), "reward_baselines": [baseline[u] for u in uids]}
    return columns, {"critic/reward_baselines/mean": float(np.mean(list(baseline.values())))}
