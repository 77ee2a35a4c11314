"""Agentic rollouts: multi-turn conversations with tools (``rollout.multi_turn``).

- ``kfrl.agent.tools``: tool declarations (veRL's YAML, typed Python functions) and the worker processes
  that run them with a timeout.
- ``kfrl.agent.chat``: Hermes tool calls out of a turn; tool answers into tokens via the chat template.
- ``kfrl.agent.loop``: the rounds of a rollout batch over any backend, with the response mask.
"""
