"""kfrl's LoRA linear (``kfrl.models.lora_linear``) against PEFT's own forward: the same outputs and
gradients (float64), close in bf16, less saved for the backward pass, and PEFT's path wherever the fused
one does not apply (adapters disabled, another mode)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from kfrl.models.lora import LoraSpec, add_adapters
from kfrl.models.lora_linear import fuse_lora_linears
from numerics import float64_sum_tolerance

CONFIG = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=80, max_position_embeddings=64, use_cache=False)
SPEC = LoraSpec(rank=4, alpha=7.0)  # scaling 1.75: folding it into B rounds unlike scaling the product


def lora_model(mode: str, monkeypatch, dtype=torch.float64, seed: int = 0):
    """A Qwen2 (q/k/v with biases) with adapters on every linear, B made non-zero as after training."""
    monkeypatch.setenv("KFRL_LORA_LINEAR", mode)
    torch.manual_seed(seed)
    base = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(dtype)
    model = add_adapters(base, SPEC, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.float64 if dtype == torch.float64 else torch.float32)
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1)
    return model


def loss_and_grads(model, input_ids, autocast_dtype=None):
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    weights = torch.randn(*input_ids.shape, CONFIG["vocab_size"], generator=torch.Generator().manual_seed(7),
                          dtype=torch.float64)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        logits = model(inputs_embeds=embeds).logits
    loss = (logits.double() * weights).sum()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), logits.detach().double(), embeds.grad.detach().double(), grads


@pytest.fixture()
def input_ids():
    return torch.randint(0, CONFIG["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1))


def test_every_plain_lora_linear_is_fused_and_peft_mode_fuses_none(monkeypatch):
    fused = lora_model("fused", monkeypatch)
    from peft.tuners.lora.layer import Linear as LoraLinear

    lora_linears = [m for m in fused.modules() if type(m) is LoraLinear]
    assert len(lora_linears) == 7 * CONFIG["num_hidden_layers"]  # q k v o gate up down
    assert all(hasattr(m, "_kfrl_peft_forward") for m in lora_linears)
    assert fuse_lora_linears(fused) == 0  # already fused: nothing twice

    plain = lora_model("peft", monkeypatch)
    assert not any(hasattr(m, "_kfrl_peft_forward") for m in plain.modules())
    monkeypatch.setenv("KFRL_LORA_LINEAR", "fast")
    with pytest.raises(ValueError, match="KFRL_LORA_LINEAR"):
        fuse_lora_linears(plain)


@pytest.mark.numerics
def test_fused_equals_peft_in_float64_outputs_and_gradients(monkeypatch, input_ids):
    ours = loss_and_grads(lora_model("fused", monkeypatch), input_ids)
    theirs = loss_and_grads(lora_model("peft", monkeypatch), input_ids)
    tol = float64_sum_tolerance(4 * CONFIG["intermediate_size"]) * 64
    torch.testing.assert_close(ours[1], theirs[1], rtol=tol, atol=tol)  # logits
    torch.testing.assert_close(ours[2], theirs[2], rtol=tol, atol=tol)  # d loss / d input embeddings
    assert ours[3].keys() == theirs[3].keys() and any("lora_A" in k for k in ours[3])
    for name in ours[3]:
        scale = float(theirs[3][name].abs().max()) or 1.0
        torch.testing.assert_close(ours[3][name], theirs[3][name], rtol=tol, atol=tol * scale, msg=name)
    assert any(float(g.abs().max()) > 0 for name, g in ours[3].items() if "lora_A" in name)


@pytest.mark.numerics
def test_fused_bf16_is_close_to_peft_and_saves_less_for_backward(monkeypatch, input_ids):
    """A bf16 base with fp32 adapters under bf16 autocast, as on a GPU: PEFT copies each module's input to
    fp32 and autograd keeps a bf16 copy per module; the fused layer keeps the input it was handed."""

    def saved_bytes(model):
        seen: dict[int, int] = {}

        def pack(tensor):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = loss_and_grads(model, input_ids, torch.bfloat16)
        return sum(seen.values()), result

    ours_bytes, ours = saved_bytes(lora_model("fused", monkeypatch, dtype=torch.bfloat16))
    theirs_bytes, theirs = saved_bytes(lora_model("peft", monkeypatch, dtype=torch.bfloat16))
    assert ours_bytes < theirs_bytes, (ours_bytes, theirs_bytes)
    scale = float(theirs[1].abs().max())
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0.05 * scale)  # logits within bf16 rounding
    for name in ours[3]:
        ref = theirs[3][name].double()
        err = float((ours[3][name].double() - ref).norm() / max(float(ref.norm()), 1e-30))
        assert err < 0.05, f"{name}: relative gradient error {err:.3g}"


def test_disabled_adapters_give_the_base_and_then_the_adapters_again(monkeypatch, input_ids):
    model = lora_model("fused", monkeypatch)
    base = model.get_base_model()
    with torch.no_grad():
        adapted = model(input_ids=input_ids).logits
        with model.disable_adapter():
            off = model(input_ids=input_ids).logits
        again = model(input_ids=input_ids).logits
        for module in base.modules():  # what the base alone computes: drop every adapter's term
            if hasattr(module, "_kfrl_peft_forward"):
                for lora_b in module.lora_B.values():
                    lora_b.weight.zero_()
        base_only = model(input_ids=input_ids).logits
    torch.testing.assert_close(off, base_only, rtol=0, atol=1e-12)
    assert torch.equal(adapted, again)
    assert not torch.allclose(adapted, off)
