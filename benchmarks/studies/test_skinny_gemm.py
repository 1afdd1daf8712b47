"""The skinny (few-row) GEMM study kernel against its reference, under the interpreter."""
from __future__ import annotations

import pytest
import torch

import skinny_gemm
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and skinny_gemm.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _rand(*shape, seed, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("M,N,K,split", [(1, 40, 64, 1), (7, 96, 200, 1), (32, 64, 256, 2),
                                         (33, 50, 300, 4), (64, 32, 128, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_gemm_matches_reference(M, N, K, split, dtype):
    x = _rand(M, K, seed=1, dtype=dtype)
    w = _rand(N, K, seed=2, dtype=dtype) * 0.1
    y = skinny_gemm.skinny_gemm(x, w, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=split))
    ref = skinny_gemm.skinny_gemm_reference(x.float(), w.float())
    assert y.shape == (M, N) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


@needs_interpreter
def test_skinny_gemm_strided_rows():
    x = _rand(5, 80, seed=3, dtype=torch.float32)[:, :64]      # row stride 80
    w = _rand(48, 64, seed=4, dtype=torch.float32)
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w, dict(BLOCK_K=32)), x @ w.T,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_skinny_gemm_refuses_bad_layouts():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="M must be in"):
        skinny_gemm.skinny_gemm(torch.zeros(skinny_gemm.MAX_ROWS + 1, 16), w)
    with pytest.raises(ValueError, match="weight"):
        skinny_gemm.skinny_gemm(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm.skinny_gemm(torch.zeros(16, 2).T, w)


def test_op_uses_reference_on_cpu():
    x, w = _rand(3, 4, 16, seed=5, dtype=torch.float32), _rand(8, 16, seed=6, dtype=torch.float32)
    torch.testing.assert_close(skinny_gemm.op(x, w), x @ w.T)
