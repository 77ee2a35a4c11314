"""Stage ``validate`` (veRL's ``_validate``): the policy after iteration N answers every prompt of
data.val_files with ``rollout.val_kwargs`` (greedy by default); rewards are averaged per data_source.

Metrics follow veRL's names: ``val-core/<data_source>/reward/mean@<n>`` and, when the scorer
reports correctness, ``val-core/<data_source>/acc/mean@<n>``; other numeric reward keys go to
``val-aux``. Iteration 0 validates the initial policy (trainer.val_before_train).
"""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np

from kfrl.stages.context import StageContext


def validation_metrics(data_sources: list[str], scores: list[float], accs: list[float | None],
                       extras: list[dict], response_lengths: list[int], n: int) -> dict[str, float]:
    by_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for source, score, acc, extra, length in zip(data_sources, scores, accs, extras, response_lengths):
        values = by_source[source]
        values["reward"].append(score)
        if acc is not None:
            values["acc"].append(acc)
        values["response_length"].append(float(length))
        for key, value in extra.items():
            if key != "acc" and isinstance(value, (bool, int, float)):
                values[key].append(float(value))
    metrics = {}
    for source, values in by_source.items():
        for name, vals in values.items():
            group = "val-core" if name in ("reward", "acc") else "val-aux"
            metrics[f"{group}/{source}/{name}/mean@{n}"] = float(np.mean(vals))
    return metrics


def validate(ctx: StageContext, inputs, attempt) -> tuple[dict, dict[str, float]]:
    from kfrl.agent.loop import num_turns_of
    from kfrl.data.dataset import ground_truth_of, prompt_messages, tokenize_prompts
    from kfrl.engines.rollout import SamplingParams
    from kfrl.stages.rollout import read_dataset

    cfg = ctx.config
    val = ctx.store.manifest("data/val")
    if val is None:
        raise RuntimeError(f"no committed validation data at {ctx.store.url('data/val')}; set data.val_files")
    source = ctx.store.url("data/val")
    records = read_dataset(ctx.store, val).to_pylist()
    policy = ctx.policy_manifest(ctx.iteration)
    tokenizer = ctx.load_tokenizer(policy)
    where = [f"{source} row {i}" for i in range(len(records))]
    messages = [prompt_messages(r, cfg.data.prompt_key, w) for r, w in zip(records, where)]
    pool = None
    if cfg.rollout.multi_turn.enable:
        from kfrl.agent.tools import tool_pool

        pool = tool_pool(cfg.rollout.multi_turn)
    prompts = tokenize_prompts(tokenizer, messages, cfg.data.max_prompt_length, where, cfg.data.truncation,
                               tools=pool.schemas if pool else None)
    kw = cfg.rollout.val_kwargs
    greedy = not kw.do_sample or kw.temperature == 0
    params = SamplingParams(n=kw.n, temperature=kw.temperature if not greedy else 1.0, top_p=kw.top_p,
                            top_k=kw.top_k, max_new_tokens=cfg.data.max_response_length, do_sample=not greedy)
    engine = ctx.rollout_engine(policy, micro_batch_size=cfg.data.val_batch_size or cfg.rollout.micro_batch_size)
    # The same draws at every validation (iteration 0's seed), so validations compare like with like.
    seed = ctx.seed("validate", iteration=0)
    sample_ids = [f"val-{i}-s{k}" for i in range(len(records)) for k in range(kw.n)]
    agent_metrics: dict[str, float] = {}
    if pool is not None:  # the tool agent answers validation prompts too, as veRL's agent loop does
        from kfrl.agent.loop import agent_generate

        generations, agent_metrics = agent_generate(engine, prompts, params, config=cfg, tokenizer=tokenizer, pool=pool,
                                                    records=records, sample_ids=sample_ids, seed=seed)
    else:
        generations = engine.generate_responses(prompts, params, seed=seed)
    expanded = [i for i in range(len(records)) for _ in range(kw.n)]
    data_sources = [str(records[i].get(cfg.data.reward_fn_key, "")) for i in expanded]
    truths = [ground_truth_of(records[i]) for i in expanded]
    responses = [g.response_ids for g in generations]
    scored = ctx.rewards(tokenizer).score(responses, data_sources, truths,
                                          [records[i].get("extra_info") for i in expanded],
                                          [json.dumps(messages[i], default=str) for i in expanded],
                                          num_turns=num_turns_of(generations))
    columns = {
        "sample_id": sample_ids,
        "data_source": data_sources, "prompt_ids": [prompts[i] for i in expanded], "response_ids": responses,
        "ground_truth": truths, "score": [s.score for s in scored], "acc": [s.acc for s in scored],
        "reward_extra": [json.dumps(s.extra, default=str) for s in scored]}
    metrics = validation_metrics(data_sources, [s.score for s in scored], [s.acc for s in scored],
                                 [s.extra for s in scored], [len(r) for r in responses], kw.n)
    # e.g. val-aux/num_turns/mean, val-aux/tool_calls/sample_rate
    metrics.update({f"val-aux/{name}": value for name, value in agent_metrics.items() if not name.startswith("timing")})
    return columns, metrics
