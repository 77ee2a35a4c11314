"""Multi-turn rollouts with tools (rollout.multi_turn): Hermes parsing, tool answers through the chat
template, tools isolated in worker interpreters (errors, hangs, crashes become messages), the agent loop's
response mask and budgets, and a multi-turn run through the stages."""
import textwrap
import time

import pytest
import torch

from kfrl.agent.chat import ToolMessageTokens, parse_hermes, truncate_text
from kfrl.agent.loop import AgentSettings, ResubmitTurns, conversation_metrics, run_conversations
from kfrl.agent.tools import ToolConfigError, ToolPool, function_schema, load_tool_specs
from kfrl.config import MultiTurnConfig, load_config
from kfrl.engines.rollout import Generation, SamplingParams
from kfrl.models.tiny import build_tokenizer, tool_call_text


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["What is 123 + 456?", "#### 579", tool_call_text(123, 456), "answer=1 reward=0.0"] * 20
    return build_tokenizer(corpus, vocab_size=200, tool_tokens=True)


def test_hermes_calls_are_parsed_as_qwen_writes_them():
    text = ('I will add.<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call><tool_call>[1, 2]</tool_call>')
    calls, malformed = parse_hermes(text)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert malformed == 2
    assert parse_hermes("#### 3") == ([], 0)


def test_tool_answers_truncate_on_veRLs_sides():
    assert truncate_text("abcdefghij", 20, "middle") == "abcdefghij"
    assert truncate_text("abcdefghij", 4, "right") == "abcd...(truncated)"
    assert truncate_text("abcdefghij", 4, "left") == "(truncated)...ghij"
    assert truncate_text("abcdefghij", 4, "middle") == "ab...(truncated)...ij"


def test_tool_answer_tokens_continue_the_conversation_exactly_as_the_template_renders_it(tokenizer):
    """Prompt + model turn (ending in its EOS) + the appended tokens + final answer is, token for
    token, the chat template's rendering of the whole conversation."""
    messages = [{"role": "user", "content": "What is 123 + 456?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    call = tool_call_text(123, 456)
    appended = ToolMessageTokens(tokenizer)(["579"])
    sequence = (tokenizer(prompt + call, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                + appended + tokenizer("#### 579", add_special_tokens=False)["input_ids"])
    rendered = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": call}, {"role": "tool", "content": "579"},
                    {"role": "assistant", "content": "#### 579"}], tokenize=False)
    assert tokenizer.decode(sequence) + "<|im_end|>\n" == rendered
    assert "<tool_response>" in tokenizer.convert_ids_to_tokens(appended)  # one token, as in Qwen2.5
    two = tokenizer.decode(ToolMessageTokens(tokenizer)(["1", "2"]))
    assert two.count("<|im_start|>user") == 1 and two.count("<tool_response>") == 2  # one user turn


def test_function_tools_get_their_schema_from_type_hints_and_docstring(tmp_path):
    from kfrl.agent.builtin_tools import add

    schema = function_schema(add)
    assert schema["function"]["name"] == "add"
    assert schema["function"]["parameters"]["properties"]["a"]["type"] == "integer"
    assert schema["function"]["parameters"]["required"] == ["a", "b"]
    bad = tmp_path / "untyped.py"
    bad.write_text("def lookup(x):\n    return x\n")
    with pytest.raises(ToolConfigError, match="type hints"):
        load_tool_specs(MultiTurnConfig(enable=True, tools=[f"{bad}:lookup"]))
    with pytest.raises(ToolConfigError, match="declares no tools"):
        load_tool_specs(MultiTurnConfig(enable=True))
    with pytest.raises(ToolConfigError, match="no file"):
        load_tool_specs(MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "missing.yaml")))


TOOLS_PY = textwrap.dedent('''
    import os, time

    def slow(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    def broken(x: int) -> int:
        """Raises.

        Args:
            x: Anything.
        """
        raise RuntimeError("the tool broke")

    def die(x: int) -> int:
        """Kills its own process.

        Args:
            x: Anything.
        """
        os._exit(3)

    def pid(x: int) -> int:
        """The worker's process id.

        Args:
            x: Anything.
        """
        return os.getpid()

    class Counter:
        def __init__(self, config, tool_schema):
            self.start = config.get("start", 0)
            self.counts = {}

        async def create(self, instance_id, offset=0, **kwargs):
            self.counts[instance_id] = self.start + offset

        async def execute(self, instance_id, parameters):
            self.counts[instance_id] += parameters.get("by", 1)
            return {"text": f"count={self.counts[instance_id]}"}, 0.5, {"seen": 1}

        async def release(self, instance_id):
            self.counts.pop(instance_id, None)
''')

VERL_YAML = textwrap.dedent('''
    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
        config: {type: native}
        tool_schema:
          type: function
          function:
            name: calc_gsm8k_reward
            description: Scores an answer.
            parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
      - class_name: "{module}:Counter"
        config: {start: 10}
        tool_schema:
          type: function
          function: {name: counter, description: Counts., parameters: {type: object, properties: {}}}
''')


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "user_tools.py").write_text(TOOLS_PY)
    (folder / "tools.yaml").write_text(VERL_YAML.replace("{module}", str(folder / "user_tools.py")))
    config = MultiTurnConfig(enable=True, tool_config_path=str(folder / "tools.yaml"),
                             tools=[f"{folder}/user_tools.py:{name}" for name in ("slow", "broken", "die", "pid")])
    tools = ToolPool(load_tool_specs(config), workers=2, timeout_s=2.0)
    yield tools
    tools.close()


def test_tools_run_outside_the_trainer_and_failures_become_messages(pool):
    import os

    worker_pid = int(pool.submit("pid", "a", {"x": 0}).result().text)
    assert worker_pid != os.getpid()
    ok = pool.submit("slow", "a", {"seconds": 0.01}).result()
    assert (ok.ok, ok.text) == (True, "woke")
    raised = pool.submit("broken", "a", {"x": 1}).result()
    assert not raised.ok and raised.error == "exception" and "the tool broke" in raised.text
    unknown = pool.submit("nope", "a", {}).result()
    assert unknown.error == "unknown_tool" and "calc_gsm8k_reward" in unknown.text
    assert pool.submit("slow", "a", {"wrong": 1}).result().error == "bad_arguments"
    assert pool.submit("slow", "a", "not json").result().error == "bad_arguments"


def test_a_hung_or_dying_tool_is_replaced_and_the_next_call_works(pool):
    started = time.perf_counter()
    hung = pool.submit("slow", "h", {"seconds": 60}).result()
    assert hung.error == "timeout" and "within 2 s" in hung.text
    assert time.perf_counter() - started < 10
    after = pool.submit("slow", "h", {"seconds": 0.01}).result()
    assert after.ok and after.text == "woke"
    crashed = pool.submit("die", "d", {"x": 0}).result()
    assert crashed.error == "crash"
    assert pool.submit("pid", "d", {"x": 0}).result().ok


def test_verl_tool_classes_keep_per_sample_state_from_create_kwargs(pool):
    first = pool.submit("counter", "sample-1", {"by": 2}, {"offset": 5}).result()
    assert (first.text, first.reward, first.metrics) == ("count=17", 0.5, {"seen": 1})
    assert pool.submit("counter", "sample-1", {}, {"offset": 5}).result().text == "count=18"
    assert pool.submit("counter", "sample-2", {}, {}).result().text == "count=11"  # its own instance
    # veRL's builtin class path resolves to kfrl's Gsm8kTool: state from create_kwargs, veRL's rewards.
    wrong = pool.submit("calc_gsm8k_reward", "g", {"answer": "41"}, {"ground_truth": "42"}).result()
    right = pool.submit("calc_gsm8k_reward", "g", {"answer": "42"}, {"ground_truth": "42"}).result()
    assert (wrong.reward, right.reward) == (-0.05, 0.0)
    assert "reward=1.0" in right.text and "reward=0" in wrong.text


class ScriptedEngine:
    """A rollout backend whose turns are fixed by the conversation so far: the first turn of prompt 0's
    samples calls `add`, prompt 1's answers at once; after a tool answer the model copies it."""

    def __init__(self, tokenizer, *, call_again: bool = False):
        self.tokenizer, self.call_again, self.calls = tokenizer, call_again, []

    def generate_responses(self, prompts, params, *, seed=None):
        self.calls.append([len(p) for p in prompts])
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            if "</tool_response>" in text and not self.call_again:
                reply = "#### " + text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
            elif "123" in text:
                reply = tool_call_text(123, 456)
            else:
                reply = "#### 7"
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            ids = ids[:params.max_new_tokens]
            for _ in range(params.n):
                out.append(Generation(ids, [-0.5] * len(ids), "stop" if len(ids) and ids[-1] == self.tokenizer.eos_token_id
                                      else "length"))
        return out


class AddPool:
    """The loop's view of a pool (submit/release), answering in-process: the loop is tested here,
    the worker processes above."""

    def __init__(self):
        self.released = []

    def submit(self, name, instance_id, arguments, create_kwargs=None):
        from concurrent.futures import Future

        from kfrl.agent.tools import ToolResult

        future = Future()
        future.set_result(ToolResult(str(arguments["a"] + arguments["b"]), True, 0.01))
        return future

    def release(self, instance_id):
        self.released.append(instance_id)


def encode_prompts(tokenizer, questions):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            for q in questions]


def converse(tokenizer, engine, settings, n=2, multi_turn=None, pool=None):
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p)
               for p in encode_prompts(tokenizer, ["What is 123 + 456?", "What is 3 + 4?"])]
    ids = [f"s{i}" for i in range(len(prompts) * n)]
    return prompts, run_conversations(ResubmitTurns(engine), prompts, SamplingParams(n=n, max_new_tokens=settings.budget),
                                      tokenizer=tokenizer, pool=pool or AddPool(), settings=settings, instance_ids=ids,
                                      tools_kwargs=[{}] * len(ids), seed=0, multi_turn=multi_turn)


def test_the_loop_masks_tool_tokens_and_records_turns(tokenizer):
    engine = ScriptedEngine(tokenizer)
    pool = AddPool()
    prompts, conversations = converse(tokenizer, engine, AgentSettings(budget=200), pool=pool)
    tool_user, direct = conversations[0], conversations[2]
    text = tokenizer.decode(tool_user.response_ids)
    assert text.endswith("<tool_response>\n579\n</tool_response><|im_end|>\n<|im_start|>assistant\n#### 579<|im_end|>")
    roles = [role for role, _, _ in tool_user.turns]
    assert roles == ["assistant", "tool", "assistant"] and tool_user.num_turns == 4
    for role, start, end in tool_user.turns:
        assert set(tool_user.response_mask[start:end]) == {1 if role == "assistant" else 0}
        assert set(tool_user.rollout_logprobs[start:end]) == {-0.5 if role == "assistant" else 0.0}
    assert tool_user.turn_offsets == [start for _, start, _ in tool_user.turns]
    assert tokenizer.decode([t for t, m in zip(tool_user.response_ids, tool_user.response_mask) if m]) == \
        tool_call_text(123, 456) + "<|im_end|>#### 579<|im_end|>"
    assert (direct.num_turns, direct.tool_calls, direct.response_mask) == (2, 0, [1] * len(direct.response_ids))
    assert engine.calls[1] == [len(prompts[0]) + len(tool_user.response_ids) - 6] * 2  # both samples, whole
    assert pool.released == ["s0", "s1"]
    metrics = conversation_metrics(conversations, 1.0)
    assert (metrics["num_turns/min"], metrics["num_turns/max"], metrics["num_turns/mean"]) == (2, 4, 3)
    assert metrics["tool_calls/total"] == 2 and metrics["tool_calls/sample_rate"] == 0.5


def test_turn_limits_budget_and_single_turn_rows(tokenizer):
    looping = ScriptedEngine(tokenizer, call_again=True)  # calls the tool on every turn
    _, limited = converse(tokenizer, looping, AgentSettings(budget=400, max_assistant_turns=3))
    assert limited[0].assistant_turns == 3 and limited[0].user_turns == 2 and limited[0].finish_reason == "stop"
    _, user_limited = converse(tokenizer, ScriptedEngine(tokenizer, call_again=True),
                               AgentSettings(budget=400, max_user_turns=1))
    assert user_limited[0].user_turns == 1 and user_limited[0].assistant_turns == 2
    _, short = converse(tokenizer, ScriptedEngine(tokenizer, call_again=True), AgentSettings(budget=40))
    assert all(len(c.response_ids) <= 40 for c in short)
    assert short[0].finish_reason == "length" and len(short[0].response_ids) == 40
    _, single = converse(tokenizer, ScriptedEngine(tokenizer), AgentSettings(budget=200), multi_turn=[False, True])
    assert single[0].num_turns == 2 and single[0].tool_calls == 0  # veRL's single_turn_agent row


def test_verl_multi_turn_keys_map_to_kfrls():
    config = load_config(None, ["actor_rollout_ref.rollout.multi_turn.enable=true",
                                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5",
                                "actor_rollout_ref.rollout.multi_turn.tool_config_path=/x/tools.yaml",
                                "actor_rollout_ref.rollout.multi_turn.format=hermes",
                                "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=100"])
    mt = config.rollout.multi_turn
    assert (mt.enable, mt.max_assistant_turns, mt.tool_config_path, mt.max_tool_response_length) == \
        (True, 5, "/x/tools.yaml", 100)


def test_the_tool_demo_learns_to_call_the_calculator_and_trains_on_its_own_tokens_only(tmp_path):
    """configs/demo_tools.yaml, shortened to 10 iterations, through the controller: held-out accuracy
    and the tool-call rate rise; tool tokens are stored with response_mask 0 and get no advantage;
    MLflow's generations table shows the conversation turn by turn."""
    from kfrl.config import load_config
    from kfrl.driver.controller import generation_rows, train
    from kfrl.run import Run
    from kfrl.stages import METRIC_ORDER
    from kfrl.stages.context import StageContext

    config = load_config("configs/demo_tools.yaml", [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db", "pipeline.runner=inline",
        "trainer.total_iterations=10", "trainer.test_freq=10", "trainer.save_freq=-1", "data.builtin_val_size=64"])
    run = Run.at(train(config, run_id="tools").run_uri)
    before, after = run.iteration_metrics(0, METRIC_ORDER), run.iteration_metrics(10, METRIC_ORDER)
    first = run.iteration_metrics(1, METRIC_ORDER)
    accuracy = "val-core/kfrl/arith/acc/mean@1"
    assert after[accuracy] >= before[accuracy] + 0.4, (before[accuracy], after[accuracy])
    assert after["tool_calls/sample_rate"] >= first["tool_calls/sample_rate"] + 0.3
    assert 0.05 < first["tool_calls/sample_rate"] < 0.6  # the warm start calls it sometimes
    assert after["num_turns/mean"] > first["num_turns/mean"] and after["num_turns/max"] == 4
    assert after["tool_calls/errors"] <= 0.05 * after["tool_calls/total"]

    table = StageContext.open(run.uri, 1).read_groups("rollout", "advantage")
    masks, advantages = table.column("response_mask").to_pylist(), table.column("advantages").to_pylist()
    offsets, turns = table.column("turn_offsets").to_pylist(), table.column("num_turns").to_pylist()
    with_tools = [i for i, t in enumerate(turns) if t == 4]
    assert with_tools, "no conversation used the tool"
    for i in with_tools:
        inserted = [j for j, m in enumerate(masks[i]) if m == 0]
        assert inserted and inserted == list(range(offsets[i][1], offsets[i][2]))  # the tool turn, exactly
        assert all(advantages[i][j] == 0 for j in inserted)
    # Groups where the tool path won: the model's own tokens of those conversations carry the advantage.
    assert any(advantages[i][j] > 0 for i in with_tools for j, m in enumerate(masks[i]) if m)
    rows = generation_rows(run, 1, 64)
    shown = [r for r in rows if r.get("num_turns") == 4]
    assert shown and shown[0]["conversation"].startswith("[assistant] <tool_call>")
    assert "\n[tool] " in shown[0]["conversation"] and shown[0]["conversation"].count("[assistant]") == 2


def test_remax_greedy_baselines_are_whole_conversations_with_tools(tmp_path):
    """ReMax in a multi-turn run: the gen_max stage's greedy response goes through the agent loop and
    its tools, as veRL's baseline goes through its agent loop. Once the greedy policy calls the
    calculator, its conversations answer right: a baseline near 1, where a single-turn greedy
    response (the tool call alone) would score 0."""
    from kfrl.config import load_config
    from kfrl.driver.controller import train
    from kfrl.run import Run
    from kfrl.stages import METRIC_ORDER
    from kfrl.stages.context import StageContext

    iterations = 8
    config = load_config("configs/demo_tools.yaml", [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db", "pipeline.runner=inline",
        f"trainer.total_iterations={iterations}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "algorithm.adv_estimator=remax"])
    run = Run.at(train(config, run_id="remax-tools").run_uri)
    metrics = [run.iteration_metrics(i, METRIC_ORDER) for i in range(1, iterations + 1)]
    assert metrics[0]["gen_max/tool_calls/per_sample"] < 0.5  # the warm start answers greedily in its head
    calling = [m for m in metrics if m["gen_max/tool_calls/per_sample"] >= 0.5]
    assert calling, [m["gen_max/tool_calls/per_sample"] for m in metrics]
    assert all(m["gen_max/num_turns/mean"] > 3 and m["critic/reward_baselines/mean"] >= 0.5 for m in calling), \
        [(m["gen_max/num_turns/mean"], m["critic/reward_baselines/mean"]) for m in calling]
    table = StageContext.open(run.uri, iterations).read_groups("rollout", "gen_max")
    assert set(table.column("agent_name").to_pylist()) == {"tool_agent"}
    baselines, uids = table.column("reward_baselines").to_pylist(), table.column("uid").to_pylist()
    assert all(b == baselines[uids.index(u)] for b, u in zip(baselines, uids))  # one baseline per prompt group


def test_reward_functions_see_each_conversations_turn_count_as_verl_passes_it(tmp_path):
    """veRL's reward managers put the conversation's turn count in extra_info["num_turns"]: a custom
    reward function reading it works unchanged, in training scores and in validation."""
    from kfrl.config import load_config
    from kfrl.driver.controller import train
    from kfrl.run import Run
    from kfrl.stages import METRIC_ORDER

    reward_file = tmp_path / "turns_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.0, 'turns': extra_info['num_turns']}\n")
    config = load_config("configs/demo_tools.yaml", [
        f"store.uri={tmp_path / 'store'}", f"tracking.uri=sqlite:///{tmp_path}/m.db", "pipeline.runner=inline",
        "trainer.total_iterations=1", "trainer.test_freq=1", "trainer.save_freq=-1", "data.builtin_val_size=16",
        "data.train_batch_size=16", f"reward.custom_function_path={reward_file}"])
    run = Run.at(train(config, run_id="turns").run_uri)
    metrics = run.iteration_metrics(1, METRIC_ORDER)
    assert metrics["num_turns/max"] == 4  # some conversations called the tool
    assert metrics["reward_extra/turns/mean"] == pytest.approx(metrics["num_turns/mean"])
    assert metrics["tool_call_counts/mean"] == pytest.approx(metrics["tool_calls/per_sample"])
    assert metrics["tool_call_counts/max"] >= 1 and metrics["tool_call_counts/min"] == 0
    validation = run.iteration_metrics(1, METRIC_ORDER)
    turns = [v for k, v in validation.items() if k.startswith("val-aux/") and "/turns/" in k]
    assert turns and turns[0] == pytest.approx(validation["val-aux/num_turns/mean"]), turns


@pytest.fixture(scope="module")
def tools_model():
    from kfrl.models.hf_io import load_causal_lm, load_tokenizer
    from kfrl.models.tiny import materialize_builtin

    path = materialize_builtin("tiny-qwen2-arith-tools")
    return path, load_causal_lm(path, dtype=torch.float32), load_tokenizer(path)


@pytest.mark.parametrize("bucketed", [False, True], ids=["exact", "bucketed"])
def test_torch_turns_continue_from_the_kv_cache_as_a_full_forward_would(tools_model, bucketed):
    """The torch backend's multi-turn session: each turn after a tool answer computes only the new tokens
    (the previous turn's last token and the answer), and every log-prob it samples with equals a
    teacher-forced pass over the whole conversation; sequences that end early are reported at once
    (their tools start while the others decode), and compaction keeps the caches of waiting ones."""
    from kfrl.data.synthetic import make_tool_rows
    from kfrl.engines.decoder import Decoder
    from kfrl.engines.inference import compute_logprobs
    from kfrl.engines.rollout import checkpoint_eos_ids, pad_token_id
    from kfrl.engines.rollout_torch import TorchRollout
    from kfrl.trajectory import Trajectories

    path, model, tokenizer = tools_model
    eos = checkpoint_eos_ids(path, tokenizer)
    engine = TorchRollout(Decoder.from_pretrained(path, device="cpu", dtype=torch.float32), eos,
                          pad_token_id(tokenizer, eos), micro_batch_size=6, use_cuda_graphs=False, bucketed=bucketed)
    rows = make_tool_rows(12, 3, "test")
    prompts = [list(tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)["input_ids"]) for r in rows]
    turns = engine.turns()
    reported_at: list[int] = []
    original = turns.first

    def first(prompts_, params_, seed_, on_turn):
        def watching(row, generation):
            reported_at.append(engine.stats["decode_steps"])
            on_turn(row, generation)
        original(prompts_, params_, seed_, watching)

    turns.first = first
    settings = AgentSettings(budget=64, max_assistant_turns=3)
    ids = [f"s{i}" for i in range(len(prompts) * 4)]
    conversations = run_conversations(turns, prompts, SamplingParams(n=4, max_new_tokens=64), tokenizer=tokenizer,
                                      pool=AddPool(), settings=settings, instance_ids=ids, tools_kwargs=[{}] * len(ids),
                                      seed=11)
    for chunk in turns.chunks:  # the cache shows each sequence exactly the tokens it holds, no filler
        visible = (chunk.state.attn_bias == 0).sum(-1).tolist()
        assert visible == [chunk.cached[row] for row in chunk._rows_by_slot()]
    with_tools = [c for c in conversations if c.user_turns]
    assert len(with_tools) >= 3 and any(c.assistant_turns == 2 for c in with_tools)
    assert min(reported_at) < max(reported_at)  # early finishers were handed over before the decode ended
    inserted = sum(end - start for c in conversations for role, start, end in c.turns if role == "tool")
    assert engine.stats["extend_tokens"] == inserted + sum(c.user_turns for c in with_tools)  # no re-prefill
    batch = Trajectories.from_lists([c.prompt_ids for c in conversations], [c.response_ids for c in conversations],
                                    [c.response_mask for c in conversations], pad_id=engine.pad_id)
    teacher, _ = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=64, with_entropy=False)
    for c, forced in zip(conversations, batch.unpad(teacher)):
        model_tokens = [j for j, m in enumerate(c.response_mask) if m]
        assert torch.allclose(torch.tensor([c.rollout_logprobs[j] for j in model_tokens]),
                              torch.tensor([forced[j] for j in model_tokens]), atol=2e-4), c.turns
        answer = tokenizer.decode(c.response_ids)
        if c.user_turns and c.finish_reason == "stop":
            assert answer.endswith("<|im_end|>") and "</tool_response>" in answer


def test_gsm8k_tool_rows_give_each_sample_an_answer_checker_with_its_ground_truth(tmp_path, tokenizer):
    """`kfrl data gsm8k --tools` writes veRL's multi-turn rows; with configs/tools/gsm8k_tool_config.yaml
    (veRL's class path) each conversation's calc_gsm8k_reward instance scores against its own row."""
    import pyarrow.parquet as pq

    from kfrl.agent.loop import tools_kwargs_of, wants_tools
    from kfrl.data.gsm8k import prepare_gsm8k

    written = prepare_gsm8k("tests/fixtures/gsm8k/jsonl", tmp_path, tools=True)
    rows = pq.read_table(written["test"].path).to_pylist()
    assert rows[0]["agent_name"] == "tool_agent" and wants_tools(rows[0])
    assert rows[0]["prompt"][0]["role"] == "system" and "calc_gsm8k_reward" in rows[0]["prompt"][0]["content"]
    truths = [r["reward_model"]["ground_truth"] for r in rows[:2]]
    assert truths[0] != truths[1]
    kwargs = [tools_kwargs_of(r) for r in rows[:2]]
    assert [k["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] for k in kwargs] == truths

    pool = ToolPool(load_tool_specs(MultiTurnConfig(enable=True, tool_config_path="configs/tools/gsm8k_tool_config.yaml")),
                    workers=1, timeout_s=10)
    try:
        # Both samples submit the first row's answer: right for the first, wrong for the second.
        results = [pool.submit("calc_gsm8k_reward", f"row{i}", {"answer": truths[0]},
                               kwargs[i]["calc_gsm8k_reward"]["create_kwargs"]).result() for i in range(2)]
    finally:
        pool.close()
    assert "reward=1.0" in results[0].text and (results[0].reward, results[1].reward) == (0.0, -0.05)
    assert "reward=1.0" not in results[1].text
