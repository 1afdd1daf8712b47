"""Batch-invariant launches for ``deterministic`` on a GPU (issue 44), under the Triton
interpreter: the fixed-tile GEMM against ``F.linear`` and a row's result alone equal to the same
row inside any batch; what ``batch_invariant()`` switches on and off; the dispatchers' choices while
it is on (paged attention without a key split, one fused-MoE config, the quantized GEMM's one
path and one tile). Whether the GPU's answers are bitwise batch-invariant is
``tests/gpu/test_deterministic_gpu.py``'s."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels import fixed_gemm, fused_moe, paged_attention, quant_gemm
from flash_dllm.kernels._triton import (HAS_TRITON, batch_invariant_active,
                                        batch_invariant_launches)
from flash_dllm.layers.batch_invariant import batch_invariant

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and fixed_gemm.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_interpreter
@pytest.mark.parametrize("M,N,K", [(1, 40, 96), (37, 64, 200), (70, 130, 64)])
def test_fixed_gemm_equals_f_linear(M, N, K):
    x, w, b = _rand(M, K, seed=1), _rand(N, K, seed=2), _rand(N, seed=3)
    for bias in (None, b):
        torch.testing.assert_close(fixed_gemm.fixed_gemm_triton(x, w, bias), F.linear(x, w, bias),
                                   rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_a_rows_result_does_not_depend_on_the_batch():
    """The rows of a launch are independent: the same rows alone or among others, in any
    number, give the same bits. (The interpreter's ``tl.dot`` is numpy's matmul, whose order can
    follow a row's position inside the tile, so here each slice keeps its rows' positions: it
    starts on a BLOCK_M boundary. On a GPU every row of an MMA tile sums in the same order;
    ``tests/gpu/test_deterministic_gpu.py`` checks arbitrary offsets.)"""
    bm = fixed_gemm.TILE["BLOCK_M"]
    w = _rand(72, 160, seed=4)
    x = _rand(70, 160, seed=5)
    full = fixed_gemm.fixed_gemm_triton(x, w)
    for lo, hi in [(0, 1), (0, 5), (bm, bm + 2), (bm, 70), (2 * bm, 70)]:
        assert torch.equal(fixed_gemm.fixed_gemm_triton(x[lo:hi].contiguous(), w), full[lo:hi])


@needs_interpreter
def test_zero_rows_keep_their_shape(monkeypatch):
    """An empty batch of rows (e.g. an LM head over no masked slot) is [0, N], as F.linear's."""
    monkeypatch.setattr(fixed_gemm, "use_triton", lambda *t: True)
    w = _rand(24, 32, seed=13)
    assert fixed_gemm.op(torch.empty(0, 32), w).shape == (0, 24)
    assert fixed_gemm.op(torch.empty(2, 0, 32), w).shape == (2, 0, 24)


def test_the_mode_sets_the_launch_flag_and_nests():
    assert not batch_invariant_active()
    with batch_invariant():
        assert batch_invariant_active()
        with batch_invariant_launches():
            assert batch_invariant_active()
        assert batch_invariant_active()
    assert not batch_invariant_active()
    with pytest.raises(RuntimeError):
        with batch_invariant():
            raise RuntimeError("a failed step")
    assert not batch_invariant_active()           # reset on the way out of a failure


def test_the_cpu_path_still_pads_rows():
    x, w = _rand(5, 32, seed=6), _rand(8, 32, seed=7)
    with batch_invariant():
        got = F.linear(x, w)
    torch.testing.assert_close(got, F.linear(x, w))


def test_fused_moe_takes_one_config_for_every_batch():
    with batch_invariant_launches():
        cfgs = {tuple(fused_moe._resolve_config(T, 8, 64, None).items()) for T in (1, 32, 4096)}
    assert len(cfgs) == 1 and dict(cfgs.pop()) == fused_moe.INVARIANT_CONFIG
    assert fused_moe._resolve_config(4096, 8, 64, None) != fused_moe._resolve_config(1, 8, 64,
                                                                                       None)


@needs_interpreter
def test_quantized_gemm_takes_one_path_and_one_tile(monkeypatch):
    monkeypatch.setattr(quant_gemm, "use_triton", lambda *t: True)
    monkeypatch.setattr(quant_gemm, "DEQUANT_MIN_ROWS", 4)
    seen = []
    real = quant_gemm.weight_only_triton
    monkeypatch.setattr(quant_gemm, "weight_only_triton",
                        lambda *a: seen.append(a[5]) or real(*a))
    monkeypatch.setattr(quant_gemm, "dequantize_triton",
                        lambda *a: pytest.fail("the many-rows path under batch invariance"))
    q, s = quant_gemm.quantize(_rand(48, 128, seed=8) * 0.05, 8, 64)
    x = _rand(40, 128, seed=9)
    with batch_invariant_launches():
        full = quant_gemm.op(x, q, s, None, 8)
        part = quant_gemm.op(x[32:35], q, s, None, 8)        # (positions kept: see above)
    assert seen[0] == seen[1] and seen[0]["BLOCK_M"] == 32
    assert torch.equal(part, full[32:35])


@needs_interpreter
def test_paged_attention_splits_no_keys_and_is_batch_invariant():
    P, ps, Hkv, D, H = 12, 16, 2, 32, 4
    kc, vc = _rand(P, ps, Hkv, D, seed=10), _rand(P, ps, Hkv, D, seed=11)
    table = torch.arange(P, dtype=torch.int32).view(3, 4)
    lens = torch.tensor([64, 50, 9], dtype=torch.int32)
    q = _rand(12, H, D, seed=12)
    cu = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    with batch_invariant_launches():
        full = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 4,
                                                      max_seqlen_k=64, block_n=16)
        one = paged_attention.paged_attention_triton(
            q[4:8].contiguous(), kc, vc, torch.tensor([0, 4], dtype=torch.int32), lens[1:2],
            table[1:2].contiguous(), 4, max_seqlen_k=64, block_n=16)
    assert torch.equal(one, full[4:8])
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)
    torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-5)
