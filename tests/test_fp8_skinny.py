"""The FP8 x FP8 few-row GEMM (``kernels/fp8_skinny``): its block quantization of activations
(power-of-two scales, the codes one answer everywhere), the kernel against its reference under
the interpreter, and the e4m3 rounding the interpreter's kernels take."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import fp8_gemm, fp8_skinny
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and fp8_skinny.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_block_scales_are_the_smallest_powers_of_two_that_fit():
    x = _rand(6, 300, seed=0)
    x[1, :128] *= 1e-30                         # a block near the bottom of float32
    x[2, 128:256] = 0                           # an empty block
    x[3, 5] = 3e4                               # an outlier: only its own block coarser
    q, s = fp8_skinny.quantize_blocks(x)
    assert q.dtype == fp8_skinny.FP8 and q.shape == x.shape and s.shape == (6, 3)
    mant, exp = torch.frexp(s)
    assert (mant == 0.5).all()                                       # powers of two
    assert s.min() >= 2.0 ** -126
    xb = torch.nn.functional.pad(x, (0, 84)).view(6, 3, 128)
    t = xb.abs().amax(-1) * fp8_skinny._INV_MAX
    assert (s >= t).all() and ((s / 2 < t) | (s == 2.0 ** -126)).all()
    # the codes are the values scaled exactly and rounded once; their size bounded by 448
    deq = fp8_skinny.dequantize_blocks(q, s)
    plain = x[[0, 4, 5]]                        # (rows with no outlier nor tiny block)
    assert (deq[[0, 4, 5]] / plain).sub(1).abs()[plain.abs() > 1e-3].max() <= 2 ** -4
    assert abs(deq[3, 5] / 3e4 - 1) <= 2 ** -4
    assert q.float().abs().max() <= 448
    assert deq[3, 128:].equal(fp8_skinny.dequantize_blocks(*fp8_skinny.quantize_blocks(
        x[3:4, 128:]))[0])                      # the outlier's block is its own
    assert deq[2, 128:256].eq(0).all()


def test_block_quantization_error_close_to_per_token():
    x = _rand(16, 1024, seed=1).to(torch.bfloat16)
    w = _rand(64, 1024, seed=2, scale=0.02)
    qw, ws = fp8_gemm.quantize_weight(w)
    exact = torch.nn.functional.linear(x.float(), w)

    def err(out):
        return ((out.float() - exact).norm() / exact.norm()).item()

    block = err(fp8_skinny.reference(x, qw, ws, None))
    token = err(fp8_gemm.fp8_reference(x, qw, ws, None))
    assert block < 1.1 * token and block < 0.05


@needs_interpreter
def test_interpreter_e4m3_rounding_matches_torch():
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, y_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y_ptr + o, fp8_skinny._round_e4m3(tl.load(x_ptr + o)))

    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(3000, generator=g) * 896 - 448,
                   torch.randn(3000, generator=g) * 0.01,
                   torch.tensor([0.0, 448.0, -448.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6,
                                 2.0 ** -6 - 2.0 ** -10, 31.5, 30.0, 17.0, 19.0])])
    x = torch.cat([x, torch.zeros(8192 - x.numel())])
    # every e4m3 value, and the midpoints between neighbours (ties to even)
    vals = torch.arange(256, dtype=torch.uint8).view(fp8_skinny.FP8).float()
    vals = vals[vals.isfinite()].sort().values.unique()
    x[6100:6100 + vals.numel()] = vals
    mids = (vals[1:] + vals[:-1]) / 2
    x[6500:6500 + mids.numel()] = mids
    y = torch.empty_like(x)
    _k[(1,)](x, y, N=8192)
    assert y.equal(x.to(fp8_skinny.FP8).float())


@needs_interpreter
@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 64, 128, None), (5, 96, 384, {"SPLIT_K": 1, "BLOCK_N": 64, "BLOCK_M": 16}),
    (32, 128, 512, {"SPLIT_K": 2, "BLOCK_N": 64, "BLOCK_M": 32}),
    (17, 80, 1024, {"SPLIT_K": 4, "BLOCK_N": 64, "BLOCK_M": 16}),
    (3, 64, 200, None)])                        # K not a multiple of the block: masked
def test_kernel_matches_reference(M, N, K, cfg):
    x = _rand(M, K, seed=M + K).to(torch.bfloat16)
    x[0, 3] = 40.0
    qw, ws = fp8_gemm.quantize_weight(_rand(N, K, seed=N, scale=0.05))
    bias = _rand(N, seed=5).to(torch.bfloat16)
    for b in (None, bias):
        ref = fp8_skinny.reference(x, qw, ws, b)
        got = fp8_skinny.fp8_skinny(x, qw, ws, b, cfg)
        assert got.dtype == x.dtype and got.shape == (M, N)
        # the same codes; the fp32 sums' order differs: the output's last place
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@needs_interpreter
def test_kernel_rejects_bad_operands():
    x = torch.randn(4, 128).to(torch.bfloat16)
    qw, ws = fp8_gemm.quantize_weight(torch.randn(64, 128))
    with pytest.raises(ValueError, match="qweight"):
        fp8_skinny.fp8_skinny(x, qw.float(), ws, None)
    with pytest.raises(ValueError, match="wscale"):
        fp8_skinny.fp8_skinny(x, qw, ws[:10], None)
    with pytest.raises(ValueError, match="x must be"):
        fp8_skinny.fp8_skinny(x.t(), qw, ws, None)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("K,split", [(256, 1), (200, 2), (384, 4)])   # (384 / 4: 3 slices)
def test_kernel_codes_are_the_references_bit_for_bit(dtype, K, split):
    """With the identity as weight each output is one code times its scale, exact: the kernel's
    codes and scales equal ``quantize_blocks``' (zero rows, tiny blocks, ties, an outlier)."""
    x = _rand(9, K, seed=K).to(dtype)
    x[1] = 0
    x[2, :128] *= 2.0 ** -20
    x[3, 7] = 200.0
    x[4, :3] = torch.tensor([0.3125, 0.34375, 9.0])   # (e4m3 ties once scaled)
    eye = torch.eye(K).to(fp8_skinny.FP8)
    got = fp8_skinny.fp8_skinny(x, eye, torch.ones(K), None,
                                {"SPLIT_K": split, "BLOCK_N": 64, "BLOCK_M": 16})
    want = fp8_skinny.dequantize_blocks(*fp8_skinny.quantize_blocks(x)).to(dtype)
    assert torch.equal(got, want)


@needs_interpreter
def test_no_rows_and_no_columns():
    qw, ws = fp8_gemm.quantize_weight(torch.randn(64, 128))
    x = torch.empty(0, 128).to(torch.bfloat16)
    assert fp8_skinny.fp8_skinny(x, qw, ws, None).shape == (0, 64)
    assert fp8_skinny.reference(x.view(0, 0, 128), qw, ws, None).shape == (0, 0, 64)
    assert fp8_gemm.op(x, qw, ws, None).shape == (0, 64)
