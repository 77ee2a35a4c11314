"""Tools that ship with kfrl: the calculator of the tool demo and veRL's GSM8K answer checker."""
from __future__ import annotations


def add(a: int, b: int) -> int:
    """Adds two integers exactly.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return int(a) + int(b)


class Gsm8kTool:
    """veRL's ``calc_gsm8k_reward`` (verl.tools.gsm8k_tool.Gsm8kTool): the model submits an answer and
    reads back how it scored against the sample's ground truth (create_kwargs ``ground_truth``). The
    tool reward is 0 when the answer improved on the previous submission, else -0.05, as in veRL."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self.instances: dict[str, dict] = {}

    def create(self, instance_id: str, ground_truth: str = "", **_):
        self.instances[instance_id] = {"ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id

    def execute(self, instance_id: str, parameters: dict):
        from kfrl.rewards.gsm8k import compute_score

        answer = str(parameters.get("answer", ""))
        state = self.instances.setdefault(instance_id, {"ground_truth": "", "reward": 0.0})
        submitted = answer if answer.startswith("#### ") else f"#### {answer}"
        reward = compute_score(submitted, state["ground_truth"], method="flexible", format_score=0.0, score=1.0)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return f"Current parsed answer={answer!r} reward={reward}", tool_reward, {}

    def release(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)
