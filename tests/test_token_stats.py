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


@pytest.mark.numerics
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


@pytest.mark.numerics
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_gemms_sum_the_weight_gradient_over_chunks_in_place(weight_dtype):
    """bf16 GEMMs with fp32 weights (fp32 master) or bf16 weights (bf16 master): the weight gradient,
    summed over 8 chunks in place, is the float64 one within bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 32, generator=g, dtype=torch.float64) / 4
    targets = torch.randint(0, 50, (64,), generator=g)
    h, w = hidden.to(weight_dtype).requires_grad_(), weight.to(weight_dtype).requires_grad_()
    logp, _ = linear_token_stats(h, w, targets, 1.0, torch.bfloat16, 8)
    logp.sum().backward()
    assert w.grad.dtype == weight_dtype
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    plain(h64, w64, targets, 1.0)[0].sum().backward()
    assert (w.grad.double() - w64.grad).norm() / w64.grad.norm() < 2e-2


@pytest.mark.numerics
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


@pytest.mark.numerics
@pytest.mark.parametrize("gemm_dtype", [torch.float64, torch.float32])
def test_a_tied_head_adds_its_gradient_straight_into_the_parameter_over_micro_batches(gemm_dtype):
    """An embedding that is also the LM head (Qwen2.5-0.5B/1.5B), two micro-batches accumulated: the
    fused pass writes the head's part of the gradient into ``.grad`` (no head-sized gradient held by
    autograd through the body's backward) and the sum equals plain autograd's."""
    g = torch.Generator().manual_seed(3)
    vocab, width = 29, 12
    start_embed = torch.randn(vocab, width, generator=g, dtype=torch.float64)
    start_mix = torch.randn(width, width, generator=g, dtype=torch.float64) / 3
    batches = [(torch.randint(0, vocab, (7,), generator=g), torch.randint(0, vocab, (7,), generator=g))
               for _ in range(2)]

    def run(fused: bool):
        embed = torch.nn.Parameter(start_embed.to(gemm_dtype).clone())
        mix = torch.nn.Parameter(start_mix.to(gemm_dtype).clone())
        for ids, targets in batches:
            hidden = torch.tanh(torch.nn.functional.embedding(ids, embed) @ mix)
            if fused:
                logp, ent = linear_token_stats(hidden, embed, targets, 0.9, gemm_dtype, 3)
            else:
                logp, ent = plain(hidden, embed, targets, 0.9)
            (logp.sum() + 0.1 * ent.sum()).backward()
        return embed.grad, mix.grad

    fused_embed, fused_mix = run(True)
    plain_embed, plain_mix = run(False)
    tolerance = 1e-10 if gemm_dtype == torch.float64 else 1e-4
    assert torch.allclose(fused_embed, plain_embed, atol=tolerance, rtol=tolerance)
    assert torch.allclose(fused_mix, plain_mix, atol=tolerance, rtol=tolerance)


def test_only_a_plain_unhooked_parameter_takes_its_gradient_outside_autograd():
    from kfrl.engines.token_stats import accumulates_into_grad

    weight = torch.nn.Parameter(torch.zeros(4, 3))
    assert accumulates_into_grad(weight)
    assert not accumulates_into_grad(torch.zeros(4, 3, requires_grad=True))  # not a parameter
    assert not accumulates_into_grad(torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False))
    seen = []
    hooked = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    hooked.register_hook(lambda grad: seen.append(grad.shape))
    assert not accumulates_into_grad(hooked)
    hidden = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    logp, _ = linear_token_stats(hidden, hooked, torch.tensor([0, 1, 2, 3]), 1.0, torch.float64, 2)
    logp.sum().backward()
    assert seen == [torch.Size([5, 3])] and hooked.grad is not None  # the hook saw the gradient


KERNEL_CHECKS = textwrap.dedent(r"""
    import torch
    from kfrl.engines import token_stats as ts

    import math

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(2)
    # Each kernel (float32) against its reference evaluated in float64, i.e. against the exact value: a
    # float32 reference carries errors of its own, and PyTorch's CPU logsumexp was seen 3.2e-5 (~16 ulp)
    # off at vocab 1000 on one AVX-512 machine now and then, failing a float32-vs-float32 check.
    # Error model of the kernel (tests/numerics.py): its forward sums over the vocabulary (of
    # exp(z - max) and of p z) are blocked (>= 8 independent accumulators combined by a tree: numpy's
    # pairwise sums under Triton's interpreter, Triton's block reductions on CUDA), so each is within
    # gamma(V/8 + 3) of exact relative to its sum of |terms|; exp and log add a few u. The backward is
    # elementwise given lse and H: a few u of each term.
    u = 2.0 ** -24

    def gamma(n):
        return n * u / (1 - n * u)

    for vocab in (1000, 5000):  # one partial block; two blocks, the second partial
        logits = (torch.randn(5, vocab, generator=g) * 3).to(device)
        targets = torch.randint(0, vocab, (5,), generator=g).to(device)
        got = ts._fwd(logits, targets, 0.8)
        exact = ts.stats_fwd_ref(logits.double(), targets, 0.8)
        lse, _, ent = got
        zmax, lse_max = float((logits / 0.8).abs().max()), float(exact[0].abs().max())
        e_sum = gamma(math.ceil(vocab / 8) + 3) + 2 * u
        tol_lse = e_sum + 2 * u * lse_max                   # log of a sum: its relative error, absolute
        tol_logp = tol_lse + 2 * u * (zmax + lse_max)       # z_target - lse
        tol_ent = tol_lse + 2 * (2 * e_sum + 2 * u) * zmax  # lse - sum(p z) / sum(p), |p z| summing <= max|z|
        for name, a, b, tol in zip(("lse", "logp", "entropy"), got, exact, (tol_lse, tol_logp, tol_ent)):
            assert torch.allclose(a.double(), b, atol=tol, rtol=0), (vocab, name, (a.double() - b).abs().max(), tol)
        g_logp, g_ent = torch.randn(5, generator=g).to(device), torch.randn(5, generator=g).to(device)
        for with_ent in (True, False):
            a, b = logits.clone(), logits.double()
            ts._bwd(a, targets, lse, ent, g_logp, g_ent if with_ent else None, 0.8)
            ts.stats_bwd_ref(b, targets, lse.double(), ent.double(), g_logp.double(),
                             g_ent.double() if with_ent else None, 0.8)
            # g_logp (1[j = t] - p) - g_H p (z - lse + H), / T: p = exp(z - lse) within ~(2 + |z - lse|) u
            # relative, and p |z - lse| <= 1/e, p |z| <= max|z|: within 8 u (|g_logp| + |g_H| (2 + |H| +
            # max|z|)) / T of the exact value for the same lse and H.
            scale = float(g_logp.abs().max()) + (float(g_ent.abs().max()) * (2 + float(ent.abs().max()) + zmax)
                                                  if with_ent else 0.0)
            tol_bwd = 8 * u * scale / 0.8
            assert torch.allclose(a.double(), b, atol=tol_bwd, rtol=0), (vocab, with_ent, (a.double() - b).abs().max(), tol_bwd)
    print("kernels ok")
""")



@pytest.mark.numerics
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

    # Built (and trained, on a fresh cache) before the recording starts: building runs passes of its own.
    model_dir = materialize_builtin("builtin:tiny-qwen2-arith")
    seen = []

    def recorded(device_type):
        seen.append(device_type)
        return contextlib.nullcontext()

    monkeypatch.setattr(inference, "attention_kernels", recorded)
    model = load_causal_lm(model_dir)
    batch = Trajectories.from_lists([[5, 6, 7]], [[8, 9]], pad_id=0)
    inference.forward_token_stats(model, batch, 1.0, with_entropy=True)
    assert seen == ["cpu"]
    from kfrl.engines.critic import forward_values
    from kfrl.models.hf_io import load_value_model

    forward_values(load_value_model(model_dir), batch)
    assert seen == ["cpu", "cpu"]
