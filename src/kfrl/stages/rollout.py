"""Stage ``rollout``: n responses per prompt from the current policy; writes the rollout column group."""
from __future__ import annotations

import json

import numpy as np

from kfrl.stages.context import StageContext


def read_dataset(store, manifest):
    """All Parquet files of a committed dataset, concatenated."""
    import pyarrow as pa

    from kfrl.batch import table_from_parquet_bytes

    parts = [table_from_parquet_bytes(store.read_file(manifest, name), store.file_url(manifest, name))
             for name in manifest.names() if name.endswith(".parquet")]
    return pa.concat_tables(parts)


def rollout(ctx: StageContext, attempt) -> dict[str, float]:
    from kfrl import batch
    from kfrl.data.dataset import ground_truth_of, iteration_rows, prompt_messages, tokenize_prompt
    from kfrl.engines.rollout_hf import SamplingParams, generate_responses

    cfg = ctx.config
    train = ctx.store.manifest("data/train")
    if train is None:
        raise RuntimeError(f"no committed training data at {ctx.store.url('data/train')}; `kfrl train` prepares it")
    source = ctx.store.url("data/train")
    table = read_dataset(ctx.store, train)
    epoch, rows = iteration_rows(table.num_rows, cfg.data.train_batch_size, ctx.iteration,
                                 seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    records = table.take(rows).to_pylist()

    policy = ctx.policy_manifest(ctx.iteration - 1)
    tokenizer = ctx.load_tokenizer(policy)
    model = ctx.load_model(policy)
    prompts = [tokenize_prompt(tokenizer, prompt_messages(r, cfg.data.prompt_key, f"{source} row {int(i)}"),
                               cfg.data.max_prompt_length, f"{source} row {int(i)}")
               for r, i in zip(records, rows)]
    params = SamplingParams(n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            top_k=cfg.rollout.top_k, max_new_tokens=cfg.data.max_response_length,
                            cache_implementation=cfg.rollout.hf_cache)
    generations = generate_responses(model, tokenizer, prompts, params,
                                     micro_batch_size=cfg.rollout.micro_batch_size,
                                     seed=cfg.trainer.seed * 1_000_003 + ctx.iteration,
                                     logprob_micro_batch_size=cfg.rollout.log_prob_micro_batch_size_per_gpu)

    columns: dict[str, list] = {name: [] for name in batch.GROUPS["rollout"].names}
    for p, (record, row_index, prompt_ids) in enumerate(zip(records, rows, prompts)):
        uid = f"it{ctx.iteration:06d}-row{int(row_index)}"
        for k in range(cfg.rollout.n):
            gen = generations[p * cfg.rollout.n + k]
            columns["sample_id"].append(f"{uid}-s{k}")
            columns["uid"].append(uid)
            columns["iteration"].append(ctx.iteration)
            columns["policy_version"].append(ctx.iteration - 1)
            columns["data_source"].append(str(record.get("data_source", "")))
            columns["prompt_ids"].append(prompt_ids)
            columns["response_ids"].append(gen.response_ids)
            columns["response_mask"].append([1] * len(gen.response_ids))
            columns["rollout_logprobs"].append(gen.rollout_logprobs)
            columns["finish_reason"].append(gen.finish_reason)
            columns["ground_truth"].append(ground_truth_of(record))
            columns["extra_info"].append(json.dumps(record.get("extra_info") or {}, default=str))
    batch.write_group(attempt, "rollout", batch.make_table("rollout", columns))

    response_lengths = np.array([len(r) for r in columns["response_ids"]], dtype=np.float64)
    prompt_lengths = np.array([len(p) for p in prompts], dtype=np.float64)
    metrics = {
        "training/epoch": float(epoch),
        "response_length/mean": float(response_lengths.mean()),
        "response_length/max": float(response_lengths.max()),
        "response_length/min": float(response_lengths.min()),
        "response_length/clip_ratio": float((np.array(columns["finish_reason"]) == "length").mean()),
        "prompt_length/mean": float(prompt_lengths.mean()),
        "prompt_length/max": float(prompt_lengths.max()),
        "prompt_length/min": float(prompt_lengths.min()),
        "prompt_length/clip_ratio": float((prompt_lengths >= cfg.data.max_prompt_length).mean()),
        "perf/response_tokens": float(response_lengths.sum()),
        "perf/total_num_tokens": float(response_lengths.sum() + prompt_lengths.sum() * cfg.rollout.n),
    }
    return metrics
