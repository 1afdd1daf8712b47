"""FP8 (e4m3) GEMM with per-output-channel weight scales and dynamic activation scales:
``out = (q(x) * sx) @ (q(W) * sw)^T + bias``.

Layout: ``qweight`` float8_e4m3fn ``[N, K]``, ``wscale`` float32 ``[N]`` (``W[n] ~ q(W)[n] *
wscale[n]``, ``wscale = absmax(W[n]) / 448``). At each call ``x`` is quantized with scales of
its own: no calibration, an outlier costs only its own row's (or block's) resolution.

Two products, chosen by the rows of the call (the same rule on every device, so the CPU's
emulation measures what the GPU runs):

- Fewer than ``W8A8_MIN_ROWS`` rows (a small batch's step, bound by reading the weights): x
  quantized in blocks of 128 values with power-of-two scales inside the GEMM kernel, FP8 tensor
  cores on the e4m3 weights as stored (``kernels/fp8_skinny.py``: no pass over x before the GEMM,
  no decode of the weights); elsewhere its ``reference`` (fp32).
- From ``W8A8_MIN_ROWS`` rows (compute-bound): x quantized per token by a kernel of its own, the
  product cuBLAS's:

Paths of the W8A8 product (the same math):

- CUDA with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper): ``torch._scaled_mm`` on
  the e4m3 operands with row-wise scales (cuBLASLt), bf16/fp16 out; rows padded to a multiple of
  16 (the kernel's alignment). ``supported(device)`` says whether a card has them; the layer
  refuses ``fp8`` on one that does not (``layers/quant.py``).
- Everywhere else (the CPU, tests): ``fp8_reference`` emulates it exactly as the tensor cores
  compute it up to the accumulation order: quantize x per token to e4m3, dequantize both operands
  to fp32, matmul in fp32, scale, add the bias, round once to x's dtype. The CPU measures the
  accuracy of the format this way.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from flash_dllm.kernels import fp8_skinny
from flash_dllm.kernels._triton import HAS_TRITON, check, describe, next_pow2, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                       # torch.finfo(torch.float8_e4m3fn).max
MIN_CAPABILITY = (8, 9)
_INV_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))   # 1/448 rounded to fp32

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, INV_MAX: tl.constexpr,
                           BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        """One row: its absmax (first sweep), then the e4m3 codes of ``x / scale`` (second
        sweep, from L2): ``quantize_rows``'s arithmetic (the scale a product with the float32
        ``1 / 448``, the codes an IEEE division, round to nearest). ``ONE_PASS`` (the row fits
        ``BLOCK``): the row is read once and kept in registers."""
        row = tl.program_id(0).to(tl.int64)
        x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
        if ONE_PASS:
            ks = tl.arange(0, BLOCK)
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) * INV_MAX, 1e-12)
            tl.store(s_ptr + row, scale)
            y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_row + ks, y.to(tl.float8e4nv), mask=ks < K)
            return
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) * INV_MAX, 1e-12)   # (quantize_rows' product)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_row + ks, y.to(tl.float8e4nv), mask=ks < K)


def supported(device: torch.device) -> bool:
    """Whether ``device`` runs FP8 GEMMs on tensor cores (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and _capability(device.index) >= MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    # (asked once per card: the layer's forward asks at every call)
    return torch.cuda.get_device_capability(index)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (e4m3 ``[..., N, K]``, float32 scales ``[..., N]``), per output row."""
    wf = w.float()
    scale = (wf.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)              # [..., N]
    q = (wf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization: ``x [M, K]`` -> (e4m3 ``[M, K]``, float32 ``[M, 1]``)."""
    xf = x.float()
    # NOTE: the scale is amax times float32(1 / 448), not amax / 448: torch divides by a scalar
    # exactly on the CPU but multiplies by its reciprocal on CUDA; the product is one answer on
    # every device, and the kernel's (quantize_rows_triton) bit for bit.
    scale = (xf.abs().amax(-1, keepdim=True) * _INV_MAX).clamp_min(1e-12)  # [M, 1]
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# rows up to this many values are read once and kept in registers: on an H100 (2048 rows, in
# graphs) 7.7 us against 9.7 for two passes at 4096 values; at 12288, 48-66 us against 45
# (benchmarks/results/step/sweep_quant_rows_h100.log)
ONE_PASS_MAX = 4096


def quantize_rows_triton(x: torch.Tensor, one_pass: bool | None = None,
                         num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in one kernel: a row up to ``ONE_PASS_MAX`` values read once, a longer
    one twice (the scale, then the codes from L2); the PyTorch chain makes six passes over an
    fp32 copy (~100 us per GEMM at 2048 x 4096). ``one_pass`` / ``num_warps``: forced (the
    sweep, tests)."""
    check(x.dim() == 2 and x.stride(1) == 1,
          f"fp8_gemm.quantize_rows_triton: x must be [M, K] with contiguous rows, got "
          f"{describe(x)} strides {x.stride()}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M and K:
        block = next_pow2(K)
        one_pass = block <= ONE_PASS_MAX if one_pass is None else one_pass
        block = max(block, 1024) if one_pass else 1024
        warps = num_warps or (max(4, min(16, block // 1024)) if one_pass else 4)
        _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), INV_MAX=_INV_MAX,
                                 BLOCK=block, ONE_PASS=one_pass, num_warps=warps)
    return q, s


def dequantize(qweight: torch.Tensor, wscale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * wscale.float().unsqueeze(-1)).to(dtype)


def fp8_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the FP8 GEMM emulated in fp32 (see the module)."""
    lead = x.shape[:-1]
    xq, xs = quantize_rows(x.reshape(-1, x.shape[-1]))
    # NOTE: the scales are applied to the fp32 product, as the tensor cores' epilogue does
    acc = F.linear(xq.float(), qweight.float()) * xs * wscale.float()    # [M, N]
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).view(*lead, -1)


def fp8_scaled_mm(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """The CUDA path: ``torch._scaled_mm`` with row-wise scales (x bf16 / fp16)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    pad = -M % 16
    if pad:                                   # the kernel wants rows in multiples of 16
        x2 = torch.cat([x2, x2.new_zeros(pad, K)])
    xq, xs = quantize_rows_triton(x2) if use_triton(x2) else quantize_rows(x2)
    # (row-wise scaling wants a bf16 output; fp16 activations are cast back below)
    out = torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=wscale.view(1, -1),
                           out_dtype=torch.bfloat16)
    out = out[:M]
    if bias is not None:
        out = (out.float() + bias.float()).to(out.dtype)
    return out.to(x.dtype).view(*lead, -1)


# NOTE: the rows from which x is quantized per token by a kernel of its own and cuBLAS runs the
# FP8 product; below, reading the weights is the whole cost and ``fp8_skinny`` quantizes x's blocks
# inside its GEMM (no extra launch: a separate quantization kernel costs ~10 us per GEMM in a
# batch-1 step on an H100). On an H200, LLaDA-8B dual steps: at 32 rows a call ``fp8_skinny``'s
# step is 4.15 ms; at 64 rows both take 5.6 ms; at 128 / 256 rows cuBLAS's 5.98 / 7.32 ms against
# 8.99 / 14.13 (``fp8_skinny`` streams the weights once per 64 rows and re-quantizes x's tile in
# every program: benchmarks/findings/quantization.md).
W8A8_MIN_ROWS = 64


def op(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
       bias: torch.Tensor | None) -> torch.Tensor:
    """The module's rule: below ``W8A8_MIN_ROWS`` rows ``fp8_skinny`` (its kernel where the
    device has FP8 tensor cores, its reference elsewhere), else cuBLAS's row-wise FP8 product
    where the device has them and its emulation elsewhere."""
    rows = x.numel() // max(1, x.shape[-1])
    fp8_cores = x.is_cuda and supported(x.device)
    if rows < W8A8_MIN_ROWS:
        if fp8_cores:
            return fp8_skinny.op(x, qweight, wscale, bias)
        return fp8_skinny.reference(x, qweight, wscale, bias)
    if fp8_cores and x.dtype != torch.float32:
        return fp8_scaled_mm(x, qweight, wscale, bias)
    return fp8_reference(x, qweight, wscale, bias)
