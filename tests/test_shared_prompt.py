"""Shared-prompt passes (``model.share_prompt_forward``): the rows of a micro-batch that share a prompt
run it through the model once, and every log-prob, entropy and gradient equals the one-row-per-sequence
pass's.

Both passes run in float64 with RMSNorm computed in float64 too (HF's computes in float32 whatever the
model's dtype, and the shared pass sums a prompt token's gradients before that float32 step, the plain
pass after it): what is compared is the algorithm, so the tolerances are float64 summation bounds
(tests/numerics.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from kfrl.config import ActorConfig
from kfrl.engines import inference, shared_prompt
from kfrl.engines.actor import update_actor
from kfrl.trajectory import Trajectories
from numerics import float64_sum_tolerance

TOLERANCE = float64_sum_tolerance(10**4)


def _float64_norms(model) -> None:
    """RMSNorm in the model's own dtype (float64 here) instead of HF's float32."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)


def _model(kind: str):
    import transformers

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    config = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
              "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind](**shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float64)
    _float64_norms(model)
    return model.train()


def _batch(prompt_lengths=(7, 11, 9), seed=1) -> Trajectories:
    """Three prompts: one with three responses and a fourth row further down, one with three, one alone;
    responses of different lengths (one of a single token)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 120, (n,), generator=g).tolist() for n in prompt_lengths]
    rows = [prompts[0]] * 3 + [prompts[1]] * 3 + [prompts[2], prompts[0]]
    responses = [torch.randint(5, 120, (n,), generator=g).tolist() for n in (5, 8, 1, 6, 3, 2, 4, 7)]
    advantages = [[a] * len(r) for a, r in zip((1.0, -1.0, 0.5, 2.0, -0.5, 0.7, 0.3, -2.0), responses)]
    return Trajectories.from_lists(rows, responses, pad_id=0, fields={"advantages": advantages})


def _layout(model, batch: Trajectories):
    layout_of = inference.prompt_sharing(model, batch, True)
    return layout_of(torch.arange(len(batch)), batch)


def test_the_layout_holds_each_row_once_per_prompt_at_its_own_positions():
    batch = _batch()
    index = shared_prompt.PromptIndex.of(batch)
    assert index.prompt_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 0]

    def plan(rows):
        return shared_prompt.plan_layout(index, torch.tensor(rows), batch.input_ids.shape[1],
                                         batch.gather_positions.shape[1], "cpu")

    layout = plan(range(len(batch)))
    # 3 packed sequences: the longest prompt (11), then 4 slots (prompt 0 has 4 rows) of 8 tokens
    assert (layout.prompt_width, layout.slots, layout.slot_width) == (11, 4, 8)
    assert layout.source_rows.shape == (3, 11 + 4 * 8)
    packed = batch.input_ids[layout.source_rows, layout.source_cols].flatten()
    packed_positions = layout.position_ids.flatten()
    # each response token is predicted, in the packed sequence, by the same token at the same position
    # as in its own row
    row_positions = batch.gather_positions
    expected_tokens = torch.gather(batch.input_ids, 1, row_positions)
    assert torch.equal(packed[layout.gather], expected_tokens)
    assert torch.equal(packed_positions[layout.gather], row_positions)
    # 3 x 43 = 129 packed tokens instead of 8 rows of 17
    assert layout.source_rows.numel() == 129 and batch.input_ids.shape == (8, 17)
    # no two rows of one prompt, or small groups whose empty slots outweigh the sharing: the rows as they are
    assert plan([0, 3, 6]) is None
    assert plan([0, 1, 3, 6]) is None  # 3 x (11 + 2 x 8) = 81 against 4 x 17 = 68
    assert plan([0, 1, 2, 3, 4, 5]).source_rows.numel() == 70  # 2 x (11 + 3 x 8) against 102


@pytest.mark.numerics
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "mistral"])
@pytest.mark.parametrize("prompt_lengths", [(7, 11, 9), (9, 9, 9)], ids=["uneven", "even"])
def test_shared_pass_equals_the_row_pass_with_its_gradients(kind, prompt_lengths):
    model = _model(kind)
    batch = _batch(prompt_lengths)
    mask = batch.response_mask

    def run(layout):
        model.zero_grad(set_to_none=True)
        log_probs, entropy = inference.forward_response(model, batch, 0.7, True, layout=layout)
        ((log_probs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
        return log_probs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = run(None)
    layout = _layout(model, batch)
    assert layout is not None and (layout.prompt_lengths is None) == (len(set(prompt_lengths)) == 1)
    shared = run(layout)
    real = mask.bool()
    torch.testing.assert_close(shared[0][real], plain[0][real], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(shared[1][real], plain[1][real], atol=TOLERANCE, rtol=0)
    assert max(float(g.abs().max()) for g in plain[2].values()) > 1e-3  # a gradient to compare
    for name, grad in plain[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=TOLERANCE, rtol=TOLERANCE, msg=name)


@pytest.mark.numerics
@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_update_with_shared_prompts_takes_the_same_step(checkpointing, monkeypatch):
    """update_actor with share_prompts against without: the same SGD step (lr 1: the weights move by
    the gradient), micro-batches of 6 rows (packed) and 2 (of two prompts: not packed); with HF's
    gradient checkpointing the layout also reaches the recomputed blocks."""
    base = _model("qwen2")
    batch = _batch()
    cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=6, grad_clip=1e9)
    attended = []
    attend = shared_prompt.SharedPromptLayout.attend
    monkeypatch.setattr(shared_prompt.SharedPromptLayout, "attend",
                        lambda self, *args: attended.append(self.slots) or attend(self, *args))

    def step(share: bool):
        model = copy.deepcopy(base)
        _float64_norms(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        metrics = update_actor(model, optimizer, batch, cfg, mini_batch_size=len(batch), temperature=1.0,
                               share_prompts=share)
        return metrics, dict(model.named_parameters())

    plain_metrics, plain = step(False)
    assert attended == []
    shared_metrics, shared = step(True)
    # 2 layers, once each in the forward (and once more each when recomputed for the backward)
    assert attended == [3] * (4 if checkpointing else 2)
    assert plain_metrics["actor/grad_norm"] > 1e-3
    assert shared_metrics["actor/grad_norm"] == pytest.approx(plain_metrics["actor/grad_norm"], rel=TOLERANCE)
    for name, weight in plain.items():
        torch.testing.assert_close(shared[name], weight, atol=TOLERANCE, rtol=TOLERANCE, msg=name)


@pytest.mark.numerics
def test_log_prob_passes_with_shared_prompts_equal_the_plain_ones():
    model = _model("llama").eval()
    batch = _batch()
    with torch.no_grad():
        plain = inference.compute_token_stats(model, batch, temperature=0.9, micro_batch_size=5, with_entropy=True)
        shared = inference.compute_token_stats(model, batch, temperature=0.9, micro_batch_size=5, with_entropy=True,
                                               share_prompts=True)
    real = batch.response_mask.bool()
    for k in (0, 1):
        torch.testing.assert_close(shared[k][real], plain[k][real], atol=TOLERANCE, rtol=0)


def test_models_off_sdpa_or_of_other_types_keep_one_sequence_per_row():
    import transformers

    eager = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, attn_implementation="eager"))
    assert inference.prompt_sharing(eager, _batch(), True) is None
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    assert inference.prompt_sharing(gpt2, _batch(), True) is None
    assert inference.prompt_sharing(_model("qwen2"), _batch(), False) is None


def test_a_model_saved_after_a_shared_pass_names_no_kfrl_attention(tmp_path):
    """The attention switch lives in the process: a checkpoint written after it loads anywhere (HF,
    vLLM) with the attention it had."""
    import transformers

    model = _model("qwen2")
    assert inference.prompt_sharing(model, _batch(), True) is not None
    assert model.config._attn_implementation == shared_prompt.ATTENTION_NAME
    model.save_pretrained(tmp_path)
    assert shared_prompt.ATTENTION_NAME not in (tmp_path / "config.json").read_text()
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"
