"""The text side of a tool conversation: Hermes tool calls out of a model turn, tool answers into tokens
through the model's own chat template."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MARKER = "kfrl-agent-turn-marker"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: object   # a dict when well formed; anything else is answered with an error


def parse_hermes(text: str) -> tuple[list[ToolCall], int]:
    """(the calls of a turn, how many ``<tool_call>`` blocks were not JSON with a name). Hermes format,
    as Qwen2.5/3 and veRL's ``format=hermes`` write it: ``<tool_call>{"name": .., "arguments": ..}</tool_call>``;
    arguments given as a JSON string are decoded. A malformed block is dropped, as veRL's parser does."""
    calls, malformed = [], 0
    for body in _HERMES_CALL.findall(text):
        try:
            payload = json.loads(body)
        except json.JSONDecodeError:
            malformed += 1
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            malformed += 1
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append(ToolCall(payload["name"], arguments))
    return calls, malformed


def truncate_text(text: str, limit: int, side: str) -> str:
    """veRL's tool_response_truncate_side: keep the first (right), the last (left) or both ends (middle)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class ToolMessageTokens:
    """Token ids that follow a model turn ending in EOS when tool answers come back: what the chat
    template renders after the assistant's content and its end-of-turn token, through the next
    assistant header. Rendered from the template itself, so the training sequence is exactly what the
    template would produce for the conversation."""

    def __init__(self, tokenizer, eos_text: str | None = None):
        self.tokenizer = tokenizer
        self.eos_text = eos_text if eos_text is not None else (tokenizer.eos_token or "")

    def __call__(self, answers: list[str]) -> list[int]:
        conversation = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
        text = self.tokenizer.apply_chat_template(conversation + [{"role": "tool", "content": a} for a in answers],
                                                  add_generation_prompt=True, tokenize=False)
        at = text.rfind(_MARKER)
        if at < 0:
            raise ValueError("the chat template does not render assistant messages' content; cannot append tool answers")
        rest = text[at + len(_MARKER):]
        if self.eos_text and rest.startswith(self.eos_text):
            rest = rest[len(self.eos_text):]  # the model wrote its end-of-turn token itself
        return list(self.tokenizer(rest, add_special_tokens=False)["input_ids"])
