"""The multi-turn rollout: the model writes a turn; the tool calls in it run; their answers join the
conversation; the model writes again, until it answers without a call, a turn limit is reached or
the response budget (``data.max_response_length``, counting every response token) is spent.

One rollout batch runs as rounds over all its conversations. A backend provides ``TurnEngine``:
``first`` generates the first turn of n samples per prompt, ``next`` continues some conversations
after appending tokens. ``ResubmitTurns`` works with any backend by sending each continuing
conversation whole (the ``hf`` reference; ``vllm``, whose prefix cache skips the shared part); the
``torch`` backend continues from its KV cache (``kfrl.engines.rollout_torch.TorchTurns``). Either
calls ``on_turn(row, generation)`` as soon as a conversation's turn is over, so its tool calls run
in the tool workers while the other conversations are still decoding.

The response of a sample is every token after its prompt: the model's (``response_mask`` 1, with
their rollout log-probs) and the tool answers the template wraps (``response_mask`` 0, log-prob 0),
so log-probs, KL, entropy, advantages and losses see only what the model wrote.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from kfrl.agent.chat import ToolMessageTokens, parse_hermes, truncate_text
from kfrl.engines.rollout import Generation, SamplingParams

OnTurn = Callable[[int, Generation], None]


class TurnEngine(Protocol):
    def first(self, prompts: list[list[int]], params: SamplingParams, seed: int | None, on_turn: OnTurn) -> None: ...

    def next(self, rows: list[int], appended: list[list[int]], budgets: list[int], params: SamplingParams,
             seed: int | None, on_turn: OnTurn) -> None: ...


class ResubmitTurns:
    """Turns through any backend's ``generate_responses``: each continuing conversation is sent whole."""

    def __init__(self, engine):
        self.engine = engine
        self.contexts: list[list[int]] = []

    def first(self, prompts, params, seed, on_turn) -> None:
        generations = self.engine.generate_responses(prompts, params, seed=seed)
        self.contexts = [list(p) for p in prompts for _ in range(params.n)]
        for row, generation in enumerate(generations):
            self.contexts[row] += generation.response_ids
            on_turn(row, generation)

    def next(self, rows, appended, budgets, params, seed, on_turn) -> None:
        for row, ids in zip(rows, appended):
            self.contexts[row] += ids
        single = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                max_new_tokens=max(budgets), do_sample=params.do_sample)
        generations = self.engine.generate_responses([self.contexts[r] for r in rows], single, seed=seed)
        for row, budget, generation in zip(rows, budgets, generations):
            generation = within_budget(generation, budget)
            self.contexts[row] += generation.response_ids
            on_turn(row, generation)


def within_budget(generation: Generation, budget: int) -> Generation:
    """A turn cut to the tokens its conversation had left (a batch decodes to its longest budget)."""
    if len(generation.response_ids) <= budget:
        return generation
    return Generation(generation.response_ids[:budget], generation.rollout_logprobs[:budget], "length")


@dataclass
class Conversation:
    """One rollout sample as it grows. ``turns``: (role, start, end) spans of the response."""
    prompt_ids: list[int]
    instance_id: str
    tools_kwargs: dict
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[str, int, int]] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    finish_reason: str = "stop"
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0
    tool_seconds: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    error_kinds: list[str] = field(default_factory=list)

    def append(self, ids: list[int], logprobs: list[float] | None, role: str) -> None:
        start = len(self.response_ids)
        self.response_ids += ids
        self.response_mask += [1 if role == "assistant" else 0] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.turns.append((role, start, len(self.response_ids)))

    @property
    def num_turns(self) -> int:
        """veRL's count: the prompt's user turn, each assistant turn and each tool-answer turn."""
        return 1 + self.assistant_turns + self.user_turns

    @property
    def turn_offsets(self) -> list[int]:
        return [start for _, start, _ in self.turns]


@dataclass(frozen=True)
class AgentSettings:
    budget: int                          # response tokens per sample (data.max_response_length)
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    truncate_side: str = "middle"

    @classmethod
    def of(cls, config) -> "AgentSettings":
        mt = config.rollout.multi_turn
        return cls(config.data.max_response_length, mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls,
                   mt.max_tool_response_length, mt.tool_response_truncate_side)


def run_conversations(turns: TurnEngine, prompts: list[list[int]], params: SamplingParams, *, tokenizer, pool,
                      settings: AgentSettings, instance_ids: list[str], tools_kwargs: list[dict],
                      seed: int | None = None, multi_turn: list[bool] | None = None) -> list[Conversation]:
    """n conversations per prompt (prompt-major, as ``generate_responses``). ``instance_ids`` and
    ``tools_kwargs`` are per conversation; ``multi_turn`` (per prompt) lets rows of veRL's
    ``single_turn_agent`` stop after their first turn."""
    n = params.n
    conversations = [Conversation(list(p), instance_ids[i * n + k], tools_kwargs[i * n + k] or {})
                     for i, p in enumerate(prompts) for k in range(n)]
    agentic = [True] * len(conversations) if multi_turn is None else [m for m in multi_turn for _ in range(n)]
    tool_tokens = ToolMessageTokens(tokenizer)
    pending: dict[int, list] = {}

    def on_turn(row: int, generation: Generation) -> None:
        c = conversations[row]
        c.append(list(generation.response_ids), list(generation.rollout_logprobs), "assistant")
        c.assistant_turns += 1
        if generation.finish_reason == "length" or len(c.response_ids) >= settings.budget:
            c.finish_reason = "length"
            return
        if not agentic[row]:
            return
        calls, malformed = parse_hermes(tokenizer.decode(generation.response_ids, skip_special_tokens=False))
        c.malformed_calls += malformed
        if not calls:
            return
        if ((settings.max_assistant_turns and c.assistant_turns >= settings.max_assistant_turns)
                or (settings.max_user_turns and c.user_turns >= settings.max_user_turns)):
            return
        calls = calls[:settings.max_parallel_calls]
        c.tool_calls += len(calls)
        pending[row] = [pool.submit(call.name, c.instance_id, call.arguments,
                                    (c.tools_kwargs.get(call.name) or {}).get("create_kwargs"))
                        for call in calls]

    turns.first(prompts, params, seed, on_turn)
    round_index = 0
    while pending:
        round_index += 1
        rows, appended = [], []
        for row in sorted(pending):
            c = conversations[row]
            answers = []
            for future in pending[row]:
                result = future.result()
                c.tool_seconds.append(result.seconds)
                c.tool_rewards.append(result.reward)
                if not result.ok:
                    c.tool_errors += 1
                    c.error_kinds.append(result.error)
                answers.append(truncate_text(result.text, settings.max_tool_response_length, settings.truncate_side))
            ids = tool_tokens(answers)
            room = settings.budget - len(c.response_ids)
            c.user_turns += 1
            if len(ids) >= room:  # no room left for the model to answer
                c.append(ids[:room], None, "tool")
                c.finish_reason = "length"
                continue
            c.append(ids, None, "tool")
            rows.append(row)
            appended.append(ids)
        pending.clear()
        if rows:
            budgets = [settings.budget - len(conversations[r].response_ids) for r in rows]
            turns.next(rows, appended, budgets, params, None if seed is None else seed + 7919 * round_index, on_turn)
    for c in conversations:
        if c.tool_calls:
            pool.release(c.instance_id)
    return conversations


def num_turns_of(generations: list) -> list[int] | None:
    """Each conversation's turn count (veRL's), or None for single-turn generations."""
    if not generations or not isinstance(generations[0], Conversation):
        return None
    return [c.num_turns for c in generations]


def conversation_metrics(conversations: list[Conversation], seconds: float) -> dict[str, float]:
    """veRL's num_turns/* and tool_call_counts/* plus kfrl's tool counters for one rollout."""
    import numpy as np

    turns = np.array([c.num_turns for c in conversations], dtype=np.float64)
    counts = np.array([c.tool_calls for c in conversations], dtype=np.float64)
    latencies = [s for c in conversations for s in c.tool_seconds]
    calls = sum(c.tool_calls for c in conversations)
    errors = sum(c.tool_errors for c in conversations)
    model_tokens = sum(sum(c.response_mask) for c in conversations)
    inserted = sum(len(c.response_mask) - sum(c.response_mask) for c in conversations)
    metrics = {
        "num_turns/min": float(turns.min()), "num_turns/max": float(turns.max()), "num_turns/mean": float(turns.mean()),
        "tool_call_counts/min": float(counts.min()), "tool_call_counts/max": float(counts.max()),
        "tool_call_counts/mean": float(counts.mean()),
        "tool_calls/total": float(calls),
        "tool_calls/per_sample": calls / len(conversations),
        "tool_calls/sample_rate": sum(c.tool_calls > 0 for c in conversations) / len(conversations),
        "tool_calls/errors": float(errors),
        "tool_calls/error_rate": errors / calls if calls else 0.0,
        "tool_calls/malformed": float(sum(c.malformed_calls for c in conversations)),
        "tool_calls/latency_mean_s": float(np.mean(latencies)) if latencies else 0.0,
        "tool_calls/latency_max_s": float(np.max(latencies)) if latencies else 0.0,
        "response_length/model_tokens_mean": model_tokens / len(conversations),
        "response_length/tool_tokens_mean": inserted / len(conversations),
        "timing_s/agent_loop": seconds,
    }
    for kind in sorted({k for c in conversations for k in c.error_kinds}):
        metrics[f"tool_calls/errors_{kind}"] = float(sum(c.error_kinds.count(kind) for c in conversations))
    return metrics


def turn_engine(engine) -> TurnEngine:
    """The backend's own turn engine where it has one (the torch decoder keeps its KV cache), else
    whole conversations resubmitted."""
    turns = getattr(engine, "turns", None)
    return turns() if callable(turns) else ResubmitTurns(engine)


def agent_name_of(record: dict) -> str:
    """veRL's agent_name column: "single_turn_agent" rows answer in one turn; other rows (and rows
    without the column) run the tool agent."""
    return str(record.get("agent_name") or "tool_agent")


def wants_tools(record: dict) -> bool:
    return agent_name_of(record) != "single_turn_agent"


def tools_kwargs_of(record: dict) -> dict:
    """veRL's extra_info.tools_kwargs: {tool name: {"create_kwargs": {...}}} for this row's tool instances."""
    import json

    extra = record.get("extra_info") or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra else {}
    value = extra.get("tools_kwargs") or {}
    if isinstance(value, str):
        value = json.loads(value) if value else {}
    return value


def agent_generate(engine, prompts: list[list[int]], params: SamplingParams, *, config, tokenizer, pool,
                   records: list[dict], sample_ids: list[str], seed: int | None = None
                   ) -> tuple[list[Conversation], dict[str, float]]:
    """The multi-turn rollout of one batch of prompts (``records`` are their dataset rows,
    ``sample_ids`` one per conversation) and its metrics."""
    started = time.perf_counter()
    conversations = run_conversations(
        turn_engine(engine), prompts, params, tokenizer=tokenizer, pool=pool, settings=AgentSettings.of(config),
        instance_ids=sample_ids, tools_kwargs=[tools_kwargs_of(r) for r in records for _ in range(params.n)],
        seed=seed, multi_turn=[wants_tools(r) for r in records])
    return conversations, conversation_metrics(conversations, time.perf_counter() - started)
