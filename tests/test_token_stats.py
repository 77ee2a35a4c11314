"""The fused LM-head pass (log-probs and entropies, kfrl.engines.token_stats) against plain autograd:
values and gradients, in float64 for the algebra, and its Triton kernels against their references."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kfrl.engines.token_stats import linear_token_stats


def plain(hidden, weight, targets, temperature):
    z = (hidden @ weight.t()) / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [3, 64])
def test_values_and_gradients_equal_autograd(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (10,), generator=g)
    g_logp, g_ent = torch.randn(10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)

    logp, ent = linear_token_stats(hidden, weight, targets, 0.7, torch.float64, chunk)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    fused = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = plain(hidden, weight, targets, 0.7)
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    for got, want in zip(fused, (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad)):
        assert torch.allclose(got, want, atol=1e-10, rtol=1e-9)


def test_log_probs_alone_need_no_entropy_gradient():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=g)
    logp, _ = linear_token_stats(hidden, weight, targets, 1.0, torch.float64, 4)
    logp.sum().backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    plain(hidden, weight, targets, 1.0)[0].sum().backward()
    assert torch.allclose(grad, hidden.grad, atol=1e-10)


KERNEL_CHECKS = textwrap.dedent(r"""
    import torch
    from kfrl.engines import token_stats as ts

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    for vocab in (1000, 5000):  # one partial block; two blocks, the second partial
        logits = (torch.randn(5, vocab, generator=g) * 3).to(device)
        targets = torch.randint(0, vocab, (5,), generator=g).to(device)
        got = ts._fwd(logits, targets, 0.8)
        want = ts.stats_fwd_ref(logits, targets, 0.8)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-5), (vocab, a, b)
        lse, _, ent = want
        g_logp, g_ent = torch.randn(5, generator=g).to(device), torch.randn(5, generator=g).to(device)
        for with_ent in (True, False):
            a, b = logits.clone(), logits.clone()
            ts._bwd(a, targets, lse, ent, g_logp, g_ent if with_ent else None, 0.8)
            ts.stats_bwd_ref(b, targets, lse, ent, g_logp, g_ent if with_ent else None, 0.8)
            assert torch.allclose(a, b, atol=1e-5), (vocab, with_ent, (a - b).abs().max())
    print("kernels ok")
""")


def test_kernels_match_their_references():
    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECKS], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "kernels ok" in done.stdout, done.stderr[-3000:]


def test_update_and_log_prob_passes_leave_cudnn_attention_out_on_cuda(monkeypatch):
    """cuDNN's attention builds a plan per new shape (1-2 s each on an H200, bench/sdpa_first_call.py),
    and the update's micro-batches keep changing shape: the passes run with it switched off."""
    import contextlib

    from kfrl.engines import inference

    flags = torch.backends.cuda
    before = (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled())
    with inference.attention_kernels("cuda"):
        assert not flags.cudnn_sdp_enabled()
        assert flags.flash_sdp_enabled() and flags.mem_efficient_sdp_enabled() and flags.math_sdp_enabled()
    assert (flags.cudnn_sdp_enabled(), flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled()) == before
    monkeypatch.setattr(inference, "AVOID_CUDNN_ATTENTION", False)
    with inference.attention_kernels("cuda"):
        assert flags.cudnn_sdp_enabled() == before[0]

    from kfrl.models.hf_io import load_causal_lm
    from kfrl.models.tiny import materialize_builtin
    from kfrl.trajectory import Trajectories

    seen = []

    def recorded(device_type):
        seen.append(device_type)
        return contextlib.nullcontext()

    monkeypatch.setattr(inference, "attention_kernels", recorded)
    model = load_causal_lm(materialize_builtin("builtin:tiny-qwen2-arith"))
    batch = Trajectories.from_lists([[5, 6, 7]], [[8, 9]], pad_id=0)
    inference.forward_token_stats(model, batch, 1.0, with_entropy=True)
    assert seen == ["cpu"]
    from kfrl.engines.critic import forward_values
    from kfrl.models.hf_io import load_value_model

    forward_values(load_value_model(materialize_builtin("builtin:tiny-qwen2-arith")), batch)
    assert seen == ["cpu", "cpu"]
