"""vllm.inputs.TokensPrompt: in vLLM a TypedDict with the prompt's token ids."""
from typing import TypedDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
