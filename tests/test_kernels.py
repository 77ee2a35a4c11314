"""The decoder's Triton kernels against their PyTorch references.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported, hence a fresh Python process); on CUDA they run for real.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

CHECKS = textwrap.dedent(r"""
    import os

    import torch
    from kfrl.engines import kernels

    import math

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    assert kernels.triton_enabled(torch.empty(1, device=device))
    g = torch.Generator().manual_seed(0)
    # Error model (tests/numerics.py): a float32 sum of n terms, in any order, is within gamma(n) *
    # sum|terms| of the exact one, gamma(n) = n u / (1 - n u), u = 2^-24; a few elementwise steps add a
    # few u (relative). The kernel (Triton's interpreter on CPU) and its PyTorch reference each stay
    # within that of the exact result, so within twice that of each other. In bf16 (CUDA) inputs and
    # outputs are rounded to 8 bits: two float32 results a hair apart can round to neighbouring bf16
    # values, one ulp apart, and an ulp of a value of magnitude m is at most 2^-7 m.
    u = 2.0 ** -24

    def gamma(n):
        return n * u / (1 - n * u)

    def bf16_tol(scale):
        return max(2e-2, 2.0 ** -7 * float(scale))

    def tol(n, scale, steps=4):  # two evaluations of one n-term reduction whose sum|terms| <= scale
        return bf16_tol(scale) if dtype == torch.bfloat16 else 2 * (gamma(n) + steps * u) * float(scale)

    def lp_tol(logits):  # two float32 log-softmax routines on the same float32 scores (tests/numerics.py)
        vocab, top = logits.shape[-1], float(logits.float().abs().max())
        return 2 * (gamma(vocab + 2) + 4 * u * (2 * top + math.log(vocab))) + 2 * u * top

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    # add_rms_norm, with and without the residual add
    x, delta, w = rand(5, 96), rand(5, 96), rand(96)
    ref_x, ref_h = kernels.add_rms_norm_ref(x.clone(), delta, w, 1e-6)
    got_x, got_h = kernels.add_rms_norm(x.clone(), delta, w, 1e-6)
    # x + delta: one rounding, the same in both; h = w x rsqrt(mean(x^2)): relative error gamma(96) + 4u.
    assert torch.allclose(got_x, ref_x, atol=tol(1, ref_x.abs().max()), rtol=0), "add_rms_norm x"
    assert torch.allclose(got_h, ref_h, atol=tol(96, ref_h.abs().max()), rtol=0), "add_rms_norm"
    _, ref_h = kernels.add_rms_norm_ref(x, None, w, 1e-6)
    assert torch.allclose(kernels.add_rms_norm(x.clone(), None, w, 1e-6)[1], ref_h, atol=tol(96, ref_h.abs().max()),
                          rtol=0), "rms_norm"

    # rope_attention: rotary, the K/V write and attention in one kernel; the step's own column from
    # registers, the columns after it ignored whatever their bias says. Split over the columns too: 4
    # splits of 64 columns leave the last split empty and row 1's second split wholly masked; twice,
    # because the last program of each pair resets its arrival counter for the next call.
    for heads, kv, head_dim, with_norm, splits in ((14, 2, 64, False, 1), (4, 2, 24, True, 1),
                                                   (14, 2, 64, False, 4), (4, 2, 24, True, 4),
                                                   (4, 2, 24, True, 4)):
        kernels.ATTENTION_SPLITS = splits
        rows, columns, at = 3, 150, 129
        qkv = rand(rows, (heads + 2 * kv) * head_dim)
        positions = torch.tensor([at, 60, 100], device=device)
        angles = torch.rand(200, head_dim // 2, generator=g).to(device) * 6
        cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
        qn, kn = (rand(head_dim), rand(head_dim)) if with_norm else (None, None)
        column = torch.tensor([at], device=device)
        before = rand(2, rows, kv, columns, head_dim)
        caches = [before.clone(), before.clone()]
        bias = torch.zeros(rows, columns, device=device, dtype=dtype)
        bias[0, :70] = float("-inf")
        bias[2, 100:at] = float("-inf")
        bias[1, 64:128] = float("-inf")
        ref = kernels.rope_attention_ref(qkv, positions, cos, sin, qn, kn, 1e-6, caches[0][0], caches[0][1], column,
                                         bias, heads, kv, head_dim)
        got = kernels.rope_attention(qkv, positions, cos, sin, qn, kn, 1e-6, caches[1][0], caches[1][1], column,
                                     bias, heads, kv, head_dim)
        normed = (head_dim ** 0.5 * max(float(qn.abs().max()), float(kn.abs().max())) if with_norm
                  else float(qkv.abs().max()))
        rope_tol = (bf16_tol(caches[0].float().abs().max()) if dtype == torch.bfloat16
                    else tol(head_dim if with_norm else 1, 2 * normed, steps=8))
        assert torch.allclose(caches[1], caches[0], atol=rope_tol, rtol=0), ("fused cache write", head_dim, splits,
                                                                            (caches[1] - caches[0]).abs().max())
        assert torch.equal(caches[1][:, :, :, :at], before[:, :, :, :at]), "fused: earlier columns untouched"
        # Scores q.k / sqrt(hd): each within e_s = (gamma(hd) + 2u) max sum_i |q_i k_i| / sqrt(hd), plus the
        # rotated q and k's own error; the softmax weights then within a relative 2 e_s + gamma(L) + 4u,
        # and the output sum over L columns adds gamma(L): per side (2 e_s + 2 gamma(L) + 4u) max|v|,
        # between the two twice that.
        scratch = [before[0].clone(), before[1].clone()]
        q_rot = kernels.rope_to_cache_ref(qkv, positions, cos, sin, qn, kn, 1e-6, scratch[0], scratch[1], column,
                                          heads, kv, head_dim).float().abs().unflatten(1, (kv, heads // kv))
        keys_abs = caches[0][0].float().abs()[:, :, :at + 1]
        qk = torch.einsum("bkgd,bkcd->bkgc", q_rot, keys_abs).max() / head_dim ** 0.5
        e_s = ((gamma(head_dim) + 2 * u) * float(qk)
               + head_dim ** 0.5 * rope_tol * (float(q_rot.max()) + float(keys_abs.max())))
        vmax = float(caches[0][1].float().abs()[:, :, :at + 1].max())
        fused_tol = bf16_tol(vmax) if dtype == torch.bfloat16 else 2 * (2 * e_s + 2 * gamma(at + 1) + 4 * u) * vmax
        assert torch.allclose(got, ref, atol=fused_tol, rtol=0), ("rope_attention", heads, splits,
                                                                  (got - ref).abs().max())
    kernels.ATTENTION_SPLITS = 1

    # With the prompts held once (PromptCache): the same result, and the same cache write, as with every
    # sequence holding its prompt's columns, in the kernel and in the reference alike (the same values
    # in the same order: equal, not close); the splits straddle the prompt's end.
    heads, kv, head_dim, rows, prompt_length, columns, at = 14, 2, 64, 4, 70, 150, 129
    qkv = rand(rows, (heads + 2 * kv) * head_dim)
    positions = torch.tensor([at, 60, 100, 90], device=device)
    angles = torch.rand(200, head_dim // 2, generator=g).to(device) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    prompt_kv = rand(2, 2, kv, prompt_length, head_dim)  # (K/V, prompts, kv heads, columns, hd)
    prompt_of = torch.tensor([1, 0, 1, 0], device=device)
    own = rand(2, rows, kv, columns - prompt_length, head_dim)
    column = torch.tensor([at], device=device)
    bias = torch.zeros(rows, columns, device=device, dtype=dtype)
    bias[0, :20] = float("-inf")
    bias[3, 100:at] = float("-inf")
    for splits in (1, 4):
        kernels.ATTENTION_SPLITS = splits
        for attend in (kernels.rope_attention_ref, kernels.rope_attention):
            whole = torch.cat([prompt_kv[:, prompt_of], own], dim=3)
            expected = attend(qkv, positions, cos, sin, None, None, 1e-6, whole[0], whole[1], column, bias,
                              heads, kv, head_dim)
            mine = own.clone()
            got = attend(qkv, positions, cos, sin, None, None, 1e-6, mine[0], mine[1], column, bias, heads, kv,
                         head_dim, (prompt_kv[0], prompt_kv[1], prompt_of, prompt_length))
            assert torch.equal(got, expected), ("shared prompts", attend.__name__, splits, (got - expected).abs().max())
            assert torch.equal(mine, whole[:, :, :, prompt_length:]), ("shared prompts: cache write", attend.__name__)
    kernels.ATTENTION_SPLITS = 1

    gate_up = rand(4, 2 * 1100)
    ref = kernels.silu_mul_ref(gate_up)  # elementwise: exp, add, divide, two products (~8 u relative)
    assert torch.allclose(kernels.silu_mul(gate_up), ref, atol=tol(1, ref.abs().max(), steps=8), rtol=0), "silu_mul"

    # sample_and_record: bookkeeping, greedy choice and log-prob, sampling frequencies
    def run(logits, greedy, temperature=1.0, finished=None, seed=0):
        rows, vocab = logits.shape
        state = dict(finished=finished if finished is not None else torch.zeros(rows, dtype=torch.bool, device=device),
                     sequence=torch.arange(rows, device=device), tokens=torch.zeros(rows, dtype=torch.long, device=device),
                     positions=torch.full((rows,), 5, device=device), eos_table=torch.zeros(vocab, dtype=torch.bool, device=device),
                     out_tokens=torch.full((rows + 1, 4), -1, dtype=torch.long, device=device),
                     out_logprobs=torch.zeros(rows + 1, 4, device=device), column=torch.tensor([12], device=device),
                     longest=10, pad_id=0)
        state["eos_table"][3] = True
        kernels.sample_and_record(logits, temperature=temperature, greedy=greedy,
                                  seed=torch.tensor([seed], device=device), **state)
        return state

    logits = rand(6, 5000, scale=3.0)
    done = torch.tensor([False, True, False, False, False, False], device=device)
    st = run(logits, greedy=True, finished=done)
    expect = logits.float().argmax(-1)
    expect[1] = 0
    assert torch.equal(st["out_tokens"][:6, 3], expect) and torch.equal(st["tokens"], expect), "greedy tokens"
    # References in float64 (exact for these float32 scores): a float32 one carries its own error, and
    # PyTorch's CPU logsumexp was seen ~16 ulp off now and then on one AVX-512 machine.
    lp = torch.log_softmax(logits.double(), -1).gather(-1, expect[:, None]).squeeze(-1)
    lp[1] = 0
    assert torch.allclose(st["out_logprobs"][:6, 3].double(), lp, atol=lp_tol(logits), rtol=0), "greedy logprob"
    assert (st["out_tokens"][:, :3] == -1).all() and (st["positions"] == 6).all()
    assert st["finished"].tolist() == [False, True, False, False, False, False]

    base = torch.randn(16, generator=g) * 1.5
    draws = 600
    st = run(base.to(device=device, dtype=dtype).expand(draws, -1).contiguous(), greedy=False, temperature=0.7, seed=4)
    tokens = st["out_tokens"][:draws, 3].cpu()
    observed = torch.bincount(tokens, minlength=16).double() / draws
    expected = torch.softmax(base.to(dtype).double() / 0.7, -1)
    chi2 = float((draws * (observed - expected) ** 2 / expected).sum())
    # 15 degrees of freedom: mean 15, standard deviation sqrt(30); 5 of them and 10 more is a false
    # alarm rate below 1e-6 whatever the random stream.
    assert chi2 < 15 + 5 * (2 * 15) ** 0.5 + 10, ("sampling chi2", chi2)
    lp = torch.log_softmax(base.to(dtype).float().double() / 0.7, -1)[tokens]
    assert torch.allclose(st["out_logprobs"][:draws, 3].cpu().double(), lp, atol=lp_tol(base / 0.7), rtol=0), "sampled logprob"
    assert torch.equal(st["finished"].cpu(), tokens == 3), "EOS marks the row finished"
    again = run(base.to(device=device, dtype=dtype).expand(draws, -1).contiguous(), greedy=False, temperature=0.7, seed=4)
    assert torch.equal(again["out_tokens"], st["out_tokens"]), "same seed, same samples"

    # Sampling over several vocabulary slices (4 of 4096 here): the mass sits on 12 tokens spread over
    # all of them, so finding the slice and then the token within it are both exercised.
    vocab = 3 * 4096 + 100
    hot = torch.tensor([5, 900, 4095, 4096, 5000, 8000, 8191, 8192, 9000, 12287, 12288, vocab - 1])
    spread = torch.full((vocab,), -30.0)
    spread[hot] = torch.randn(len(hot), generator=g)
    # At 600 rows the default SAMPLE_PROGRAMS gives 4 slices of one block; 600, one slice of 4 blocks.
    default_programs = kernels.SAMPLE_PROGRAMS
    for programs in (default_programs, 600):
        kernels.SAMPLE_PROGRAMS = programs
        st = run(spread.to(device=device, dtype=dtype).expand(draws, -1).contiguous(), greedy=False, temperature=0.9, seed=7)
        tokens = st["out_tokens"][:draws, 3].cpu()
        assert torch.isin(tokens, hot).all(), "a token of negligible probability was drawn"
        probabilities = torch.softmax(spread.to(dtype).double() / 0.9, -1)
        expected = probabilities[hot] / probabilities[hot].sum()
        observed = (tokens[:, None] == hot[None, :]).double().mean(0)
        chi2 = float((draws * (observed - expected) ** 2 / expected).sum())
        assert chi2 < 11 + 5 * (2 * 11) ** 0.5 + 10, ("sampling chi2 over slices", programs, chi2)  # 11 degrees of freedom
        lp = torch.log_softmax(spread.to(dtype).double() / 0.9, -1)[tokens]
        assert torch.allclose(st["out_logprobs"][:draws, 3].cpu().double(), lp, atol=lp_tol(spread / 0.9), rtol=0), \
            "sampled logprob over slices"
        st = run(spread.to(device=device, dtype=dtype).expand(3, -1).contiguous(), greedy=True)
        assert (st["out_tokens"][:3, 3].cpu() == hot[spread[hot].argmax()]).all(), "greedy over slices"
    kernels.SAMPLE_PROGRAMS = default_programs

    # A vocabulary of 38 slices and a bit (the combine kernel's slice axis padded to 64): greedy finds the
    # maximum in a far slice, sampling stays on the few tokens that carry the mass.
    vocab = 38 * 4096 + 5
    hot = torch.tensor([7, 40000, 100001, vocab - 1])
    wide = torch.full((4, vocab), -40.0)
    wide[:, hot] = torch.tensor([0.5, 1.0, 2.0, 1.5])
    st = run(wide.to(device=device, dtype=dtype), greedy=True)
    assert (st["out_tokens"][:4, 3].cpu() == 100001).all(), "greedy over 39 slices"
    st = run(wide.to(device=device, dtype=dtype), greedy=False, seed=3)
    assert torch.isin(st["out_tokens"][:4, 3].cpu(), hot).all(), "sampling over 39 slices"
    print("kernels ok")
""")


@pytest.mark.numerics
def test_kernels_match_their_references():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "kernels ok" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
