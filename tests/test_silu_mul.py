"""The fused SiLU-mul kernel against its reference (``F.silu(gate) * up``), under the interpreter."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import silu_mul
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and silu_mul.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _rand(*shape, seed, dtype):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("T,inter,block", [(1, 8, 8), (5, 40, 16), (3, 96, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_matches_reference(T, inter, block, dtype):
    x = _rand(T, 2 * inter, seed=T + inter, dtype=dtype)
    got = silu_mul.silu_mul_triton(x, block)
    ref = silu_mul.silu_mul_reference(x)
    assert got.shape == (T, inter) and got.dtype == dtype
    # the same roundings as the reference; exp may differ in the last bit, which can move the
    # rounded silu by one unit in the last place: bf16 has 8 bits of mantissa (2 ulp < 1.6 %)
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@needs_interpreter
def test_silu_mul_strided_rows_and_empty():
    x = _rand(4, 50, seed=1, dtype=torch.float32)[:, :32]         # row stride 50
    torch.testing.assert_close(silu_mul.silu_mul_triton(x, 8), silu_mul.silu_mul_reference(x))
    assert silu_mul.silu_mul_triton(torch.zeros(0, 16), 8).shape == (0, 8)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_silu_mul_refuses_bad_layouts():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        silu_mul.silu_mul_triton(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul.silu_mul_triton(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="power of 2"):
        silu_mul.silu_mul_triton(torch.zeros(2, 8), block=6)


def test_op_on_cpu_is_the_reference():
    x = _rand(2, 3, 16, seed=2, dtype=torch.float32)
    torch.testing.assert_close(silu_mul.op(x), silu_mul.silu_mul_reference(x))
    assert silu_mul.op(x).shape == (2, 3, 8)
