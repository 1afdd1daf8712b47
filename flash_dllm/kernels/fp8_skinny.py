"""FP8 x FP8 GEMM for few rows (a small batch's step) on FP8 tensor cores, the activations
quantized inside the kernel: ``out = (q(x) * sx) @ (q(W) * sw)^T + bias``.

Layout: ``qweight`` float8_e4m3fn ``[N, K]`` with one float32 scale per output row ``wscale``
``[N]`` (``fp8_gemm.quantize_weight``, unchanged). ``x`` [M, K] (bf16 / fp16) is quantized in
blocks of ``ACT_BLOCK`` = 128 consecutive values of a row, each block with its own power-of-two
scale (``quantize_blocks``):

- ``sx`` = the smallest power of two with ``absmax(block) * fp32(1 / 448) <= sx`` (taken on the
  float32 bits: round the product's mantissa up), at least 2^-126;
- the codes are ``round_e4m3(clamp(x * (1 / sx), -448, 448))``, round to nearest even. ``1 / sx``
  and ``x * (1 / sx)`` are exact (powers of two), so for finite x the codes are one answer on
  every device and in the kernel, bit for bit; the GEMM differs in its order of accumulation and,
  on the tensor cores, in their FP8 accumulation inside each 128-value dot (promoted to fp32
  after it).

Why blocks of 128 and powers of two: a block's codes need its scale only, which a program
streaming that K tile computes from the tile it already holds (no pass over the row before the
GEMM, no extra launch); e4m3 is a float, so a power-of-two scale costs no mantissa bits (a block's
largest value lands in [224, 448] instead of at 448: at most one binade less room below, where
e4m3 turns subnormal), and blocks of 128 give an outlier only its own block's resolution (finer
than one scale per token, ``fp8_gemm.quantize_rows``).

Kernel: a grid of (``BLOCK_N`` weight rows, ``SPLIT_K`` slices of K, ``BLOCK_M`` rows of x). Per
K tile of 128 a program loads the e4m3 weight tile (no decode: it meets the tensor cores as it
is), loads x's tile, quantizes it per row, and takes ``W @ q(x)^T`` on FP8 tensor cores (Hopper's
wgmma: the weight tile the 64-row M side, x's few rows the narrow N side) into a fresh fp32 tile,
scaled per row of x and added to the fp32 accumulator (the tensor cores' FP8 accumulation is
promoted to fp32 every 128 values). Split-K slices finish as ``quant_gemm``'s do (the tile's last
slice adds the partials in slice order: one launch, deterministic).

The PyTorch reference ``reference`` (the CPU's path) computes the same codes and products in
fp32: ``x`` block-quantized and dequantized exactly, ``F.linear`` against the e4m3 weights,
``wscale`` after, the bias, one rounding.
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from flash_dllm.kernels import quant_gemm, tuned_configs
from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check,
    check_device,
    check_dtype,
    describe,
    interpreting,
    next_pow2,
    split_slices,
    use_triton,
)

INTERPRET = interpreting()
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ACT_BLOCK = 128                                   # activation values sharing a scale
SMEM_BUDGET = 160 * 1024                          # bytes the pipeline's stages may take
_INV_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))
_MIN_SCALE_BITS = 1 << 23                          # 2^-126, the smallest normal float32
_MANT = (1 << 23) - 1
_EXP = 0x7F800000


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (e4m3 codes ``[M, K]``, float32 power-of-two scales ``[M, ceil(K / 128)]``):
    the module's block quantization (a last, shorter block has its own scale)."""
    M, K = x.shape
    nb = -(-K // ACT_BLOCK)
    xf = x.float()
    pad = nb * ACT_BLOCK - K
    xb = F.pad(xf, (0, pad)).view(M, nb, ACT_BLOCK)
    t = xb.abs().amax(-1) * _INV_MAX                                   # [M, nb]
    bits = t.view(torch.int32)
    e = ((bits + _MANT) & _EXP).clamp_min(_MIN_SCALE_BITS)             # ceil to a power of two
    scale = e.view(torch.float32)
    inv = (0x7F000000 - e.clamp_max(0x7F000000)).view(torch.float32)   # 1 / scale, exact
    q = (xb * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, nb * ACT_BLOCK)[:, :K], scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The codes times their block's scale, float32 (exact)."""
    K = q.shape[-1]
    s = scale.repeat_interleave(ACT_BLOCK, dim=-1)[..., :K]
    return q.float() * s


def reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: the kernel's product in fp32 (see the module)."""
    lead, K = x.shape[:-1], x.shape[-1]
    q, s = quantize_blocks(x.reshape(-1, K))
    acc = F.linear(dequantize_blocks(q, s), qweight.float()) * wscale.float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype).view(*lead, qweight.shape[0])     # (N, not -1: 0 rows)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels.quant_gemm import finish_tile

    @triton.jit
    def _quant_tile(x, INV_MAX: tl.constexpr, UPCAST: tl.constexpr):
        """x [BM, 128] -> (its codes [BM, 128], its rows' scales [BM] float32): the module's
        block quantization of one K tile (``quantize_blocks``'s arithmetic)."""
        xf = x.to(tl.float32)
        t = tl.max(tl.abs(xf), axis=1) * INV_MAX
        e = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        e = tl.maximum(e, 0x800000)
        scale = e.to(tl.float32, bitcast=True)
        inv = (0x7F000000 - tl.minimum(e, 0x7F000000)).to(tl.float32, bitcast=True)
        y = xf * inv[:, None]
        if UPCAST:     # (the interpreter: the codes' values in fp32, as exact)
            q = _round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        else:          # (the conversion saturates: cvt.rn.satfinite, the clamp's answer)
            q = y.to(tl.float8e4nv)
        return q, scale

    @triton.jit
    def _round_e4m3(y):
        """fp32 ``y`` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, as float32:
        the interpreter's own conversion rounds values just below a power of two down a binade
        (Triton 3.9), so the CPU tests take this one. Normal range (|y| >= 2^-6): the mantissa's
        20 low bits rounded off on the bits; below it a multiple of 2^-9 (adding and subtracting
        1.5 * 2^14 rounds there)."""
        b = y.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        sub = (y + 24576.0) - 24576.0
        return tl.where(tl.abs(y) >= 0.015625, r, sub)

    @triton.jit
    def _fp8_skinny_kernel(x_ptr, q_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
                           K_PER_SPLIT, stride_xm, stride_qn, stride_om, stride_pm, stride_ps,
                           INV_MAX: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                           UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        q_rows = q_ptr + cols[:, None].to(tl.int64) * stride_qn
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)            # W @ x^T
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:     # (every tile whole: no K mask)
                x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
                w = tl.load(q_rows + ks[None, :], mask=col_ok[:, None], other=0)
            else:
                k_ok = ks < k_end
                x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w = tl.load(q_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                            other=0)
            qx, sx = _quant_tile(x, INV_MAX, UPCAST)
            if UPCAST:
                w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                w = w.to(tl.float8e4nv, bitcast=True)
            acc += tl.dot(w, tl.trans(qx)) * sx[None, :]
        acc = tl.trans(acc)                                              # [BM, BN]
        acc = acc * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
        finish_tile(acc, part_ptr, cnt_ptr, b_ptr, out_ptr, rows, cols, row_ok, col_ok,
                    stride_om, stride_pm, stride_ps, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def default_config(M: int, N: int, K: int, num_sms: int = 132) -> dict:
    """BLOCK_M covers the rows (16-64), BLOCK_N 128, BLOCK_K the activation block; SPLIT_K grows
    until the grid holds ~one wave of ``num_sms`` programs (90 %), keeping 4 K tiles a slice.
    These are the tiles an H200's sweep chose at LLaDA-8B's four shapes, 32 rows
    (``configs/fp8_skinny``; benchmarks/findings/quantization.md)."""
    block_m = min(64, max(16, next_pow2(M)))
    tiles = -(-N // 128) * -(-M // block_m)
    split = 1
    while tiles * split * 10 < 9 * num_sms and K // (split * 2) >= 4 * ACT_BLOCK:
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "SPLIT_K": split, "num_warps": 4,
            "num_stages": 4}


TILES = {"BLOCK_M": (16, 32, 64), "BLOCK_N": (64, 128, 256), "SPLIT_K": (1, 2, 4, 8, 16),
         "num_warps": (4, 8), "num_stages": (2, 3, 4, 5, 6)}


def check_tile(cfg: dict, where: str) -> dict:
    """``cfg`` if every name is a tile of this kernel with a value it launches, else a
    ValueError naming ``where``, the name and the value."""
    for name, v in cfg.items():
        if name not in TILES or v not in TILES[name]:
            raise ValueError(f"{where}: tile {name}={v!r} is not one of "
                             f"{ {k: list(c) for k, c in TILES.items()} }")
    return cfg


def problem_key(N: int, K: int) -> str:
    return f"fp8_N{N}_K{K}"


def tuned_config(M: int, N: int, K: int, device: torch.device) -> dict | None:
    """The tiles a sweep measured for this GEMM on this device (``configs/fp8_skinny/``), or
    None: ``default_config`` then applies. BLOCK_M is always the default's (the rows of the call:
    a file measured at 32 rows must not split 256 into eight re-reads of the weights)."""
    if device.type != "cuda":
        return None
    cfg = _tuned(quant_gemm._device_name(device), problem_key(N, K), M,
                 os.environ.get(tuned_configs.ENV))
    return None if cfg is None else {k: v for k, v in cfg.items() if k != "BLOCK_M"}


@functools.lru_cache(maxsize=4096)
def _tuned(device_name: str, key: str, M: int, env_dir: str | None) -> dict | None:
    cfg = tuned_configs.lookup("fp8_skinny", device_name, key, M)
    return None if cfg is None else check_tile(cfg, f"tuned fp8_skinny tiles for {key}")


@functools.lru_cache(maxsize=4096)
def _launch_config(M: int, N: int, K: int, device: torch.device, env_dir: str | None) -> dict:
    """The tiles of one call shape, worked out once (``env_dir`` keys the cache only)."""
    return check_tile({**default_config(M, N, K, quant_gemm._num_sms(device)),
                       **(tuned_config(M, N, K, device) or {})}, "fp8_skinny tiles")


def fp8_skinny(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
               bias: torch.Tensor | None, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous; bf16, fp16 or fp32) -> [M, N] in x's dtype, as ``reference``."""
    check(HAS_TRITON, "fp8_skinny: triton is not importable")
    check(x.dim() == 2 and x.stride(1) == 1,
          f"fp8_skinny: x must be [M, K] with contiguous rows, got {describe(x)}")
    check_dtype("fp8_skinny: x", x, FLOAT_DTYPES)
    M, K = x.shape
    N = qweight.shape[0]
    check(qweight.dtype == FP8 and qweight.dim() == 2 and qweight.shape[1] == K
          and qweight.is_contiguous(),
          f"fp8_skinny: qweight must be a contiguous float8_e4m3fn [N, {K}], got "
          f"{describe(qweight)}")
    check(wscale.numel() == N and wscale.dtype == torch.float32 and wscale.is_contiguous(),
          f"fp8_skinny: wscale must be float32 [{N}], got {describe(wscale)}")
    check(bias is None or (bias.shape == (N,) and bias.is_contiguous()),
          f"fp8_skinny: bias must be None or [N={N}], got {describe(bias)}")
    check_device("fp8_skinny", INTERPRET, x, qweight, wscale,
                 *(() if bias is None else (bias,)))
    cfg = (_launch_config(M, N, K, x.device, os.environ.get(tuned_configs.ENV)) if not config
           else check_tile({**default_config(M, N, K, quant_gemm._num_sms(x.device)), **config},
                           "fp8_skinny tiles"))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    # (tiles tuned at few rows meet more rows here: the stages' tiles stay within shared memory)
    stage = cfg["BLOCK_M"] * ACT_BLOCK * x.element_size() + cfg["BLOCK_N"] * ACT_BLOCK
    stages = max(2, min(cfg["num_stages"], SMEM_BUDGET // stage))
    tiles = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    cnt = (quant_gemm.split_counters(x.device, tiles[0] * tiles[1]) if cfg["SPLIT_K"] > 1
           else None)
    split = cfg["SPLIT_K"] if cnt is not None else 1
    per, split = split_slices(K, split, ACT_BLOCK)      # (slices start on an activation block)
    part = (torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1
            else out)
    _fp8_skinny_kernel[(tiles[0], split, tiles[1])](
        x, qweight.view(torch.uint8), wscale, bias if bias is not None else wscale, out, part,
        out if cnt is None else cnt, M, N, K, per, x.stride(0), qweight.stride(0),
        out.stride(0), part.stride(-2), part.stride(0) if split > 1 else 0,
        INV_MAX=_INV_MAX, HAS_BIAS=bias is not None, SPLIT=split, UPCAST=INTERPRET,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=ACT_BLOCK,
        EVEN_K=K % ACT_BLOCK == 0, num_warps=cfg["num_warps"], num_stages=stages)
    return out


def op(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
       bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N]: the kernel on CUDA, the reference elsewhere."""
    if not use_triton(x, qweight):
        return reference(x, qweight, wscale, bias)
    lead, N = x.shape[:-1], qweight.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return fp8_skinny(x2, qweight, wscale, bias).view(*lead, N)
