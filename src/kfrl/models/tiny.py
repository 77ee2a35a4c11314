"""A tiny Qwen2-architecture model for the synthetic arithmetic task, built locally.

Everything here runs on CPU without network access: a small BPE tokenizer
trained on the task corpus, a random-init ``Qwen2ForCausalLM`` and a short
SFT warm start, so that RL (GRPO) starts from a policy that is right on part
of the prompts and therefore gets a non-zero reward signal from iteration 1.

``materialize_builtin("tiny-qwen2-arith")`` packages all of that as an HF
model directory in a local cache, so pipelines can say ``builtin:tiny-qwen2-arith``
wherever they would otherwise name a hub model.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from kfrl.data.synthetic import make_arith_rows
from kfrl.engines.inference import uncached
from kfrl.models import cache_dir
from kfrl.rewards.gsm8k import extract_solution

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen's ChatML layout, without Qwen2.5's default system prompt: that prompt
# would triple the length of every sequence for no benefit on this task.
# Tool answers render as Qwen2.5's template renders them: consecutive `tool` messages share one user
# turn, each wrapped in <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] | string + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Printable ASCII plus newline and tab; characters outside it are not in the
# vocabulary (BPE without byte fallback drops them). The full 256-byte
# alphabet would break the "vocab < 200" budget.
_ASCII_ALPHABET = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
_ROLE_NAMES = ("system", "user", "assistant")
# Qwen2.5's tool tokens (added tokens, not special: decoded text keeps them, as Qwen's tokenizer does).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
DEFAULT_TOKENIZER_VOCAB = 160


# --------------------------------------------------------------------------- tokenizer


def _qwen_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's exact pre-tokenizer: its split regex, then byte-level mapping.

    It must be Qwen's: AutoTokenizer loads any ``model_type: qwen2`` directory
    as ``Qwen2Tokenizer``, which rebuilds the pipeline from vocab + merges with
    this pre-tokenizer, so a different one would tokenise differently after a
    save/load round trip. Its regex also isolates every digit (``\\p{N}``),
    which keeps numbers digit-by-digit, as arithmetic needs.
    """
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_alphabet(chars: Iterable[str]) -> list[str]:
    """The byte-level (GPT-2 style) symbols that encode `chars`."""
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return sorted({piece for ch in chars for piece, _ in to_bytes.pre_tokenize_str(ch)})


def _chat_scaffold_texts() -> list[str]:
    """Role headers of the chat template, so that role names become single tokens."""
    return [f"{role}\n" for role in _ROLE_NAMES] * 50


def _train_bpe(corpus_texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()  # as Qwen2Tokenizer
    tokenizer.pre_tokenizer = _qwen_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_byte_level_alphabet(_ASCII_ALPHABET),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus_texts) + _chat_scaffold_texts(), trainer)
    return tokenizer


def build_tokenizer(corpus_texts: Iterable[str], vocab_size: int = DEFAULT_TOKENIZER_VOCAB,
                    tool_tokens: bool = False) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer on the task corpus; return it as a Qwen2Tokenizer.

    Every digit is its own token (Qwen's pre-tokenizer isolates digits before
    BPE runs), so a multi-digit number reads digit by digit. Special tokens and
    chat template follow Qwen: ``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn.
    Wrapping the trained vocab + merges in Qwen2Tokenizer makes the saved
    ``tokenizer_config.json`` name the class that loaders pick for qwen2 anyway.
    """
    if tool_tokens:
        corpus_texts = [_strip_tool_tokens(t) for t in corpus_texts]
    trained = json.loads(_train_bpe(corpus_texts, vocab_size).to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(merge) for merge in trained["merges"]],
        unk_token=None,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        padding_side="left",  # generation appends on the right
        chat_template=CHAT_TEMPLATE,
        model_max_length=128,
    )
    if tool_tokens:
        tokenizer.add_tokens(TOOL_TOKENS)
    return tokenizer


def _strip_tool_tokens(text: str) -> str:
    for token in TOOL_TOKENS:
        text = text.replace(token, " ")
    return text


def arith_corpus(rows: Sequence[dict]) -> list[str]:
    """The texts the tokenizer is trained on: questions and reference solutions."""
    return [r["extra_info"]["question"] for r in rows] + [r["extra_info"]["answer"] for r in rows]


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TinyModelShape:
    hidden_size: int = 96
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden_size: int = TinyModelShape.hidden_size,
    layers: int = TinyModelShape.layers,
    heads: int = TinyModelShape.heads,
    kv_heads: int = TinyModelShape.kv_heads,
    intermediate_size: int = TinyModelShape.intermediate_size,
    max_position_embeddings: int = TinyModelShape.max_position_embeddings,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2ForCausalLM sized for fast CPU RL on the arithmetic task."""
    pad_id = tokenizer.pad_token_id
    eos_id = tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        # Like Qwen2: bos is <|endoftext|> (never prepended by the tokenizer),
        # eos is <|im_end|> because chat turns end there.
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


# --------------------------------------------------------------------------- SFT


@dataclass
class SftBatchTensors:
    """All SFT examples, right-padded to one length; labels are -100 off the response."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor


def prompt_text(tokenizer: PreTrainedTokenizerFast, row: dict) -> str:
    return tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)


def _encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left and right padding give the same result."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def encode_sft_examples(tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict]) -> SftBatchTensors:
    """Tokenise prompt (chat template) + reference answer + eos for every row."""
    pad_id = tokenizer.pad_token_id
    sequences, label_rows = [], []
    for row in rows:
        prompt_ids = _encode(tokenizer, prompt_text(tokenizer, row))
        response_ids = _encode(tokenizer, row["extra_info"]["answer"]) + [tokenizer.eos_token_id]
        sequences.append(prompt_ids + response_ids)
        # The prompt is masked: the model is trained only to write answers.
        label_rows.append([-100] * len(prompt_ids) + response_ids)
    return sft_batch(sequences, label_rows, pad_id)


def sft_batch(sequences: list[list[int]], label_rows: list[list[int]], pad_id: int) -> SftBatchTensors:
    """Token sequences and their labels (-100 where not trained), right-padded to one length."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), width), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (seq, lab) in enumerate(zip(sequences, label_rows)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(seq)] = 1
    return SftBatchTensors(input_ids, attention_mask, position_ids_from_mask(attention_mask), labels)


def response_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (response) positions."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _cosine_lr(step: int, total_steps: int, peak_lr: float, warmup_steps: int) -> float:
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def sft_warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    *,
    eval_rows: Sequence[dict] | None = None,
    stop_at_accuracy: float | None = None,
    eval_every: int = 25,
    log_every: int = 0,
    data: SftBatchTensors | None = None,
) -> dict:
    """Supervised warm start on the reference solutions (response tokens only).

    AdamW with a short warmup and cosine decay over `steps`. With `eval_rows`
    and `stop_at_accuracy`, the sampled (temperature 1) accuracy on eval_rows
    is measured every `eval_every` steps and training stops once it reaches
    the target. Why: this task is learnt in a sharp transition (accuracy goes
    from ~10 % to ~90 % within a few hundred steps, at a point that moves with
    seed and floating-point details), so a fixed step count cannot reliably
    leave a policy that is right on only part of the prompts, which is what RL
    needs to have signal. Deterministic for a given seed on a given platform.
    """
    data = data if data is not None else encode_sft_examples(tokenizer, rows)
    device = model.device
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup_steps = max(1, steps // 20)
    early_stopping = eval_rows is not None and stop_at_accuracy is not None
    eval_accuracy = None
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(step, steps, lr, warmup_steps)
        # Indices are drawn on CPU so the sequence of batches is the same on any device.
        batch = torch.randint(0, data.input_ids.size(0), (batch_size,), generator=generator)
        logits = model(
            input_ids=data.input_ids[batch].to(device),
            attention_mask=data.attention_mask[batch].to(device),
            position_ids=data.position_ids[batch].to(device),
            **uncached(model),
        ).logits
        loss = response_token_loss(logits, data.labels[batch].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
        if early_stopping and (step + 1) % eval_every == 0:
            eval_accuracy = answer_accuracy(model, tokenizer, eval_rows, do_sample=True, seed=seed + step)["accuracy"]
            model.train()
            if eval_accuracy >= stop_at_accuracy:
                break
    model.eval()
    tail = losses[-10:]
    metrics = {
        "sft/steps": len(losses),
        "sft/max_steps": steps,
        "sft/loss_first": losses[0] if losses else float("nan"),
        "sft/loss_last": sum(tail) / len(tail) if tail else float("nan"),
        "sft/seconds": time.perf_counter() - started,
    }
    if eval_accuracy is not None:
        metrics["sft/eval_sampled_accuracy"] = eval_accuracy
    return metrics


# --------------------------------------------------------------------------- evaluation

# veRL's gsm8k "strict" rule (verl-semantics.md §2), repeated here only to
# measure the warm start; the reward used in training lives in kfrl.rewards.


@torch.no_grad()
def generate_responses(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict],
                       do_sample: bool, max_new_tokens: int = 24, temperature: float = 1.0,
                       seed: int | None = None) -> list[str]:
    """Decoded responses (special tokens skipped) for each row's chat prompt, through the ``hf``
    rollout backend (the same generation the pipeline's rollout runs)."""
    from kfrl.engines.rollout import SamplingParams
    from kfrl.engines.rollout_hf import HFRollout

    prompts = [_encode(tokenizer, prompt_text(tokenizer, row)) for row in rows]
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens, do_sample=do_sample)
    generations = HFRollout(model, tokenizer).generate_responses(prompts, params, seed=seed)
    return tokenizer.batch_decode([g.response_ids for g in generations], skip_special_tokens=True)


def answer_accuracy(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict],
    do_sample: bool,
    seed: int = 0,
) -> dict[str, float]:
    """Fraction of rows whose response passes the strict rule, and fraction in `#### n` format."""
    model.eval()
    # A private RNG stream: evaluating must not shift the caller's random state.
    cuda_devices = [model.device.index or 0] if model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        responses = generate_responses(model, tokenizer, rows, do_sample=do_sample, seed=seed)
    answers = [extract_solution(text, method="strict") for text in responses]
    correct = [a == row["reward_model"]["ground_truth"] for a, row in zip(answers, rows)]
    return {
        "accuracy": sum(correct) / len(rows),
        "format_rate": sum(a is not None for a in answers) / len(rows),
    }


# --------------------------------------------------------------------------- builtin


@dataclass(frozen=True)
class BuiltinRecipe:
    """Everything that determines a builtin model's weights; hashed into its cache key."""

    seed: int = 0
    n_sft_rows: int = 4000
    tokenizer_vocab: int = DEFAULT_TOKENIZER_VOCAB
    hidden_size: int = 96
    layers: int = 3
    sft_max_steps: int = 900
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    # Stop the warm start once sampled accuracy on held-out training-split
    # prompts reaches this, leaving RL room to improve (see sft_warm_start).
    sft_stop_at_accuracy: float = 0.4
    n_eval_rows: int = 128
    sft_eval_every: int = 25
    # Bump when code changes alter the result without changing the fields above.
    revision: int = 2
    # "arith": 2-digit sums answered directly. "arith_tools": 3-digit sums; a tool_fraction of the warm
    # start's examples call the `add` tool (Hermes format) and copy its answer, the rest answer directly.
    task: str = "arith"
    tool_fraction: float = 0.0


BUILTIN_MODELS: dict[str, BuiltinRecipe] = {
    "tiny-qwen2-arith": BuiltinRecipe(),
    # The tool demo's policy: calls the calculator on about a quarter of the prompts after its warm start.
    "tiny-qwen2-arith-tools": BuiltinRecipe(task="arith_tools", tool_fraction=0.25, n_sft_rows=3000,
                                            tokenizer_vocab=200, sft_max_steps=500, sft_stop_at_accuracy=1.0),
}
BUILTIN_PREFIX = "builtin:"


default_cache_dir = cache_dir


def _recipe_key(recipe: BuiltinRecipe) -> str:
    blob = json.dumps(asdict(recipe), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _resolve_builtin(name: str) -> tuple[str, BuiltinRecipe]:
    bare = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if bare not in BUILTIN_MODELS:
        raise ValueError(f"unknown builtin model {name!r}; valid names: {sorted(BUILTIN_MODELS)}")
    return bare, BUILTIN_MODELS[bare]


def held_out_rows(sft_rows: Sequence[dict], n: int, seed: int) -> list[dict]:
    """n training-split rows whose questions are not among sft_rows (none repeated).

    Used to decide when to stop the warm start without looking at the test split.
    """
    seen = {row["extra_info"]["question"] for row in sft_rows}
    picked: list[dict] = []
    for row in make_arith_rows(8 * n, seed + 1, "train"):
        question = row["extra_info"]["question"]
        if question not in seen:
            seen.add(question)
            picked.append(row)
            if len(picked) == n:
                break
    return picked


def tool_call_text(a: int, b: int) -> str:
    """A Hermes tool call of the demo's calculator, as Qwen2.5 writes one."""
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


def encode_tool_sft_examples(tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict], tool_fraction: float,
                             seed: int) -> SftBatchTensors:
    """The tool task's warm start: a ``tool_fraction`` of the rows call ``add`` (the call and EOS, then
    the tool answer exactly as the rollout appends it, unlabelled, then ``#### sum`` and EOS); the others
    answer ``#### sum`` directly."""
    import random

    from kfrl.agent.chat import ToolMessageTokens

    rng = random.Random(seed)
    eos, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    tool_answer = ToolMessageTokens(tokenizer)
    sequences, label_rows = [], []
    for row in rows:
        prompt = _encode(tokenizer, prompt_text(tokenizer, row))
        total = row["reward_model"]["ground_truth"]
        answer = _encode(tokenizer, f"#### {total}") + [eos]
        if rng.random() < tool_fraction:
            a, b = (int(x) for x in row["extra_info"]["question"].removeprefix("What is ").rstrip("?").split(" + "))
            call = _encode(tokenizer, tool_call_text(a, b)) + [eos]
            inserted = tool_answer([total])
            sequences.append(prompt + call + inserted + answer)
            label_rows.append([-100] * len(prompt) + call + [-100] * len(inserted) + answer)
        else:
            sequences.append(prompt + answer)
            label_rows.append([-100] * len(prompt) + answer)
    return sft_batch(sequences, label_rows, pad_id)


def _build_tool_builtin(recipe: BuiltinRecipe) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, dict]:
    from kfrl.data.synthetic import make_tool_rows

    rows = make_tool_rows(recipe.n_sft_rows, recipe.seed, "train")
    corpus = arith_corpus(rows) + [tool_call_text(1, 2), f"#### {rows[0]['reward_model']['ground_truth']}"] * 50
    tokenizer = build_tokenizer(corpus, vocab_size=recipe.tokenizer_vocab, tool_tokens=True)
    model = build_tiny_model(tokenizer, recipe.seed, hidden_size=recipe.hidden_size, layers=recipe.layers)
    data = encode_tool_sft_examples(tokenizer, rows, recipe.tool_fraction, recipe.seed)
    metrics = sft_warm_start(model, tokenizer, rows, steps=recipe.sft_max_steps, lr=recipe.sft_lr,
                             batch_size=recipe.sft_batch_size, seed=recipe.seed, data=data)
    return model, tokenizer, metrics


def build_builtin(recipe: BuiltinRecipe, out_dir: Path) -> dict:
    """Build tokenizer + model + SFT warm start for `recipe` and save it as an HF dir."""
    from kfrl.models.hf_io import save_hf  # local import: hf_io is a thin sibling module

    if recipe.task == "arith_tools":
        model, tokenizer, metrics = _build_tool_builtin(recipe)
        save_hf(model, tokenizer, out_dir)
        (out_dir / "kfrl_builtin.json").write_text(
            json.dumps({"recipe": asdict(recipe), "metrics": metrics}, indent=2, sort_keys=True))
        return metrics
    rows = make_arith_rows(recipe.n_sft_rows, recipe.seed, "train")
    tokenizer = build_tokenizer(arith_corpus(rows), vocab_size=recipe.tokenizer_vocab)
    model = build_tiny_model(tokenizer, recipe.seed, hidden_size=recipe.hidden_size, layers=recipe.layers)
    metrics = sft_warm_start(
        model,
        tokenizer,
        rows,
        steps=recipe.sft_max_steps,
        lr=recipe.sft_lr,
        batch_size=recipe.sft_batch_size,
        seed=recipe.seed,
        eval_rows=held_out_rows(rows, recipe.n_eval_rows, recipe.seed),
        stop_at_accuracy=recipe.sft_stop_at_accuracy,
        eval_every=recipe.sft_eval_every,
    )
    save_hf(model, tokenizer, out_dir)
    (out_dir / "kfrl_builtin.json").write_text(
        json.dumps({"recipe": asdict(recipe), "metrics": metrics}, indent=2, sort_keys=True)
    )
    return metrics


def _make_world_readable(directory: Path) -> None:
    """mkdtemp (and some writers) create private files; the cache may be shared between users."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def materialize_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """Return the HF directory of builtin model `name`, building it on first use.

    The directory only ever appears complete: it is built in a temporary
    sibling and renamed into place (atomic on one filesystem). When two
    processes race, the loser's rename fails and it discards its own copy.
    """
    bare, recipe = _resolve_builtin(name)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_dir = cache_dir / f"{bare}-{_recipe_key(recipe)}"
    if final_dir.is_dir():
        return final_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{bare}-building-", dir=cache_dir))
    try:
        build_builtin(recipe, staging_dir)
        _make_world_readable(staging_dir)
        try:
            os.rename(staging_dir, final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
            # Another process finished first; its copy is equivalent.
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
    return final_dir
