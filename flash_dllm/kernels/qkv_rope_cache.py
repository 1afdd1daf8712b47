"""Fused QKV projection + RoPE + paged K/V cache write, for few-row (bandwidth-bound) steps.

One launch replaces ``qkv = F.linear(x, W, b)`` followed by ``rope_cache``: given hidden rows
``x [T, hidden]``, the concatenated projection ``weight [(H + 2 Hkv) D, hidden]`` (``[q; k; v]``
rows, the ``nn.Linear.weight`` layout of ``Attention.qkv_proj``) with an optional ``bias``,
integer ``positions [T]`` and a ``slot_mapping [T]`` (``slot = page * page_size + offset``; a
negative slot skips the K/V write), the kernel

- computes the projection in fp32 (+ bias) and rounds it to the activation dtype, as the GEMM does,
- rotates the q and k heads exactly as ``rope_cache`` does (``apply_in_fp32`` chooses the fp32 or
  the activation-dtype rounding, see there),
- stores rotated k and raw v straight into their page slots of ``k_cache``/``v_cache``
  (``[num_pages, page_size, Hkv, D]``) and returns rotated q ``[T, H, D]``: the
  ``[T, (H + 2 Hkv) D]`` projection never reaches memory.

Tiling: rotate-half RoPE pairs column ``c`` of a head with column ``c + D/2`` of the same head, so a
program owns, for one head and a chunk of ``BLOCK_C`` columns of its first half, both column sets
``{c}`` and ``{c + D/2}``: two fp32 accumulators fed by two contiguous ``[BLOCK_C, hidden]`` row
ranges of ``weight``, streamed over ``hidden`` in ``BLOCK_K`` steps (the tile idea of ``benchmarks/studies/skinny_gemm.py``).
Every rotated pair is then complete in registers and the epilogue needs no exchange between
programs. Grid: ``(cdiv(T, BLOCK_M), (H + 2 Hkv) * (D/2) / BLOCK_C)``.

Meant for few rows (a batch-1 dLLM step has ~32): there the projection is the time to stream
``weight`` from HBM and the fused epilogue is free. For many rows the GEMM is compute-bound and
cuBLAS + the separate ``rope_cache`` kernel win: ``op`` takes Triton for ``T <= MAX_ROWS`` only
and the reference otherwise (callers with many rows should run the projection and ``rope_cache.op``
themselves). ``qkv_rope_cache_reference`` is the exact contract (the kernel matches it up to GEMM
accumulation order). Duplicate slots in one call are undefined, as in ``rope_cache``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from flash_dllm.kernels import rope_cache
from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    INT_DTYPES,
    check,
    check_device,
    check_dtype,
    interpreting,
    next_pow2,
    pdl_args,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
MAX_ROWS = 64               # above this the GEMM is compute-bound: cuBLAS + rope_cache win
# FLASH_DLLM_FUSED_QKV=0: the model keeps cuBLAS + rope_cache at every size (A/B measurements)
ENABLED = os.environ.get("FLASH_DLLM_FUSED_QKV", "1") == "1"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def _rope_pair(y1, y2, c, s, FP32_MATH: tl.constexpr):
        """Rotate-half RoPE of a (first half, second half) pair of tiles in the activation dtype,
        with ``rope_cache._rotate_store``'s rounding for either ``FP32_MATH``."""
        dt = y1.dtype
        a1 = y1.to(tl.float32)
        a2 = y2.to(tl.float32)
        if FP32_MATH:
            r1 = (a1 * c - a2 * s).to(dt)
            r2 = (a2 * c + a1 * s).to(dt)
        else:
            # every op rounded to the activation dtype, as torch's bf16 elementwise math
            cr = c.to(dt).to(tl.float32)
            sr = s.to(dt).to(tl.float32)
            r1 = ((a1 * cr).to(dt).to(tl.float32) - (a2 * sr).to(dt).to(tl.float32)).to(dt)
            r2 = ((a2 * cr).to(dt).to(tl.float32) + (a1 * sr).to(dt).to(tl.float32)).to(dt)
        return r1, r2

    @triton.jit
    def _qkv_rope_cache_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, slot_ptr, inv_freq_ptr, qo_ptr,
                               kc_ptr, vc_ptr, T, K, stride_xt, stride_wn, stride_pos, stride_slot,
                               stride_qot, stride_qoh, stride_kcp, stride_kcs, stride_kch,
                               stride_vcp, stride_vcs, stride_vch, H, HKV,
                               PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                               HAS_BIAS: tl.constexpr, FP32_MATH: tl.constexpr,
                               UPCAST: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        HALF: tl.constexpr = HEAD_DIM // 2
        CHUNKS: tl.constexpr = HALF // BLOCK_C
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        h = pid_n // CHUNKS                      # q heads, then k heads, then v heads
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rc = (pid_n % CHUNKS) * BLOCK_C + tl.arange(0, BLOCK_C)   # columns of the first half
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < T

        # GEMM: acc1 = x @ W[h*D + rc]^T, acc2 = x @ W[h*D + D/2 + rc]^T (no column mask needed:
        # the launcher checks that BLOCK_C divides D/2)
        n1 = h * HEAD_DIM + rc
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xt + rk[None, :]
        w1_ptrs = w_ptr + n1[:, None].to(tl.int64) * stride_wn + rk[None, :]
        w2_ptrs = w1_ptrs + HALF * stride_wn
        acc1 = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = (k + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w1 = tl.load(w1_ptrs, mask=k_ok[None, :], other=0.0)
            w2 = tl.load(w2_ptrs, mask=k_ok[None, :], other=0.0)
            if UPCAST:     # the interpreter's half-precision tl.dot is wrong (Triton 3.9)
                x = x.to(tl.float32)
                w1 = w1.to(tl.float32)
                w2 = w2.to(tl.float32)
            acc1 += tl.dot(x, tl.trans(w1))
            acc2 += tl.dot(x, tl.trans(w2))
            x_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K
            w2_ptrs += BLOCK_K

        # epilogue: bias in fp32, then the GEMM's output rounding to the activation dtype
        if HAS_BIAS:
            acc1 += tl.load(b_ptr + n1).to(tl.float32)[None, :]
            acc2 += tl.load(b_ptr + n1 + HALF).to(tl.float32)[None, :]
        dt = x_ptr.dtype.element_ty
        y1 = acc1.to(dt)
        y2 = acc2.to(dt)
        if h < H + HKV:                          # q and k heads are rotated, v heads are not
            pos = tl.load(pos_ptr + rm * stride_pos, mask=m_ok, other=0).to(tl.float32)
            ang = pos[:, None] * tl.load(inv_freq_ptr + rc)[None, :]       # [BLOCK_M, BLOCK_C]
            y1, y2 = _rope_pair(y1, y2, tl.cos(ang), tl.sin(ang), FP32_MATH)

        # destination row of each token: q_out[t, h], or its K/V page slot for kv heads
        if h < H:
            dst = qo_ptr + rm.to(tl.int64) * stride_qot + h * stride_qoh
            ok = m_ok
        else:
            slot = tl.load(slot_ptr + rm * stride_slot, mask=m_ok, other=-1).to(tl.int64)
            ok = slot >= 0                       # padding rows (and rows >= T) store nothing
            slot = tl.maximum(slot, 0)
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            if h < H + HKV:
                dst = kc_ptr + page * stride_kcp + off * stride_kcs + (h - H) * stride_kch
            else:
                dst = vc_ptr + page * stride_vcp + off * stride_vcs + (h - H - HKV) * stride_vch
        dst = dst[:, None] + rc[None, :]
        tl.store(dst, y1, mask=ok[:, None])
        tl.store(dst + HALF, y2, mask=ok[:, None])


def qkv_rope_cache_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             positions: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                             inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int,
                             apply_in_fp32: bool = True) -> torch.Tensor:
    """PyTorch reference: the projection, then ``rope_cache`` (writes the caches in place)."""
    qkv = F.linear(x, weight, bias)                              # [T, (H + 2 Hkv) D]
    q, k, v = rope_cache.split_qkv(qkv, num_heads, num_kv_heads, k_cache.shape[-1])
    return rope_cache.rope_cache_reference(q, k, v, positions, k_cache, v_cache, slot_mapping,
                                           inv_freq, apply_in_fp32)


def default_config(T: int, N: int, K: int, head_dim: int = 128, num_sms: int = 132) -> dict:
    """Tiles for a bandwidth-bound shape (``N = (H + 2 Hkv) * head_dim`` output columns).

    BLOCK_M covers the few rows in one tile. BLOCK_C starts at the largest power of two <= 64
    dividing ``head_dim / 2`` and halves (down to 16, ``tl.dot``'s minimum) until there are
    ~2 programs per SM: no split-K is possible (RoPE needs the complete sum), so the column tiles
    alone must keep every SM streaming. LLaDA-8B (N 12288) and Dream-7B (N 4608) both get
    BLOCK_C = 16, i.e. 32 weight rows per program, as the skinny-GEMM study's tiles."""
    half = head_dim // 2
    block_m = min(64, max(16, next_pow2(T)))
    block_c = min(64, half & -half)              # largest power of two dividing half
    row_tiles = -(-T // block_m)
    while block_c > 16 and row_tiles * (N // head_dim) * (half // block_c) < 2 * num_sms:
        block_c //= 2
    # BLOCK_K 256, 3 stages: best of 24 tiles for LLaDA-8B at 32 rows on the H200, inside a CUDA
    # graph (``benchmarks/step/sweep_qkv_rope.py``, results/step/sweep_qkv_rope_h200.json): 1.015 ms
    # for
    # 32 layers, as fast as cuBLAS + rope_cache (1.010); BLOCK_K 128 / 4 stages took 1.056
    return dict(BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_K=256, num_warps=4, num_stages=3)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def qkv_rope_cache_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, inv_freq: torch.Tensor, num_heads: int,
                          num_kv_heads: int, apply_in_fp32: bool = True,
                          config: dict | None = None) -> torch.Tensor:
    """x [T, hidden], weight [(H + 2 Hkv) D, hidden], bias None or [(H + 2 Hkv) D],
    positions/slot_mapping [T] int, k/v_cache [num_pages, page_size, Hkv, D], inv_freq [D/2] fp32
    -> rotated q [T, H, D] (caches written). ``config``: BLOCK_M, BLOCK_C, BLOCK_K, num_warps,
    num_stages (defaults from ``default_config``)."""
    check(HAS_TRITON, "qkv_rope_cache_triton: triton is not importable")
    H, Hkv = int(num_heads), int(num_kv_heads)
    check(H >= 1 and Hkv >= 1, f"qkv_rope_cache: need >= 1 q and kv head, got H={H} Hkv={Hkv}")
    check(x.dim() == 2 and weight.dim() == 2,
          f"qkv_rope_cache: x must be [T, hidden] and weight [N, hidden], got {tuple(x.shape)} "
          f"and {tuple(weight.shape)}")
    T, hidden = x.shape
    check(weight.shape[1] == hidden,
          f"qkv_rope_cache: weight's hidden size {weight.shape[1]} != x's {hidden}")
    check(k_cache.dim() == 4 and k_cache.shape[2] == Hkv and v_cache.shape == k_cache.shape,
          f"qkv_rope_cache: caches must both be [num_pages, page_size, {Hkv}, D], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    D = k_cache.shape[3]
    check(D % 2 == 0, f"qkv_rope_cache: head_dim must be even, got {D}")
    N = (H + 2 * Hkv) * D
    check(weight.shape[0] == N,
          f"qkv_rope_cache: weight must have (H + 2 Hkv) * D = {N} rows for H={H} Hkv={Hkv} "
          f"D={D}, got {weight.shape[0]}")
    check(bias is None or (bias.shape == (N,) and bias.stride(0) == 1),
          f"qkv_rope_cache: bias must be None or contiguous [{N}], got "
          f"{None if bias is None else tuple(bias.shape)}")
    check_dtype("qkv_rope_cache: x", x, FLOAT_DTYPES)
    named = [("weight", weight), ("k_cache", k_cache), ("v_cache", v_cache)]
    if bias is not None:
        named.append(("bias", bias))
    for name, t in named:
        check(t.dtype == x.dtype, f"qkv_rope_cache: {name} dtype {t.dtype} != x dtype {x.dtype}")
    check(x.stride(1) == 1 and weight.stride(1) == 1,
          f"qkv_rope_cache: x and weight rows must be contiguous, strides {x.stride()} and "
          f"{weight.stride()}")
    check(k_cache.stride(3) == 1 and v_cache.stride(3) == 1,
          f"qkv_rope_cache: the caches' head_dim must be contiguous, strides {k_cache.stride()} "
          f"and {v_cache.stride()}")
    check(positions.shape == (T,) and slot_mapping.shape == (T,),
          f"qkv_rope_cache: positions and slot_mapping must be [{T}], got "
          f"{tuple(positions.shape)} and {tuple(slot_mapping.shape)}")
    check_dtype("qkv_rope_cache: positions", positions, INT_DTYPES)
    check_dtype("qkv_rope_cache: slot_mapping", slot_mapping, INT_DTYPES)
    check(inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32
          and inv_freq.is_contiguous(),
          f"qkv_rope_cache: inv_freq must be contiguous fp32 [{D // 2}], got {inv_freq.dtype} "
          f"{tuple(inv_freq.shape)}")
    check_device("qkv_rope_cache", INTERPRET, x, weight, positions, k_cache, v_cache,
                 slot_mapping, inv_freq, *([bias] if bias is not None else []))
    q_out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return q_out
    cfg = default_config(T, N, hidden, D)
    cfg.update(config or {})
    block_m, block_c, block_k = cfg["BLOCK_M"], cfg["BLOCK_C"], cfg["BLOCK_K"]
    check(all(_is_pow2(b) for b in (block_m, block_c, block_k)),
          f"qkv_rope_cache: BLOCK_M/BLOCK_C/BLOCK_K must be powers of two, got {block_m}, "
          f"{block_c}, {block_k}")
    check((D // 2) % block_c == 0,
          f"qkv_rope_cache: BLOCK_C={block_c} must divide head_dim / 2 = {D // 2}")
    check(INTERPRET or min(block_m, block_c, block_k) >= 16,
          f"qkv_rope_cache: tl.dot needs tiles of >= 16 on the GPU, got BLOCK_M={block_m} "
          f"BLOCK_C={block_c} BLOCK_K={block_k}")
    grid = (triton.cdiv(T, block_m), (H + 2 * Hkv) * (D // 2 // block_c))
    _qkv_rope_cache_kernel[grid](
        x, weight, bias if bias is not None else weight, positions, slot_mapping, inv_freq, q_out,
        k_cache, v_cache, T, hidden, x.stride(0), weight.stride(0), positions.stride(0),
        slot_mapping.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H, Hkv, PAGE_SIZE=k_cache.shape[1], HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_C=block_c, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        FP32_MATH=bool(apply_in_fp32), UPCAST=INTERPRET, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **rope_cache.EXACT_ROUNDING, **pdl_args(x))
    return q_out


def takes_triton(x: torch.Tensor, weight: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Would ``op`` launch the kernel: CUDA, 1..MAX_ROWS half-precision rows, head_dim / 2 a
    multiple of 16 (``tl.dot``'s minimum tile)."""
    return (use_triton(x, weight, k_cache) and 1 <= x.shape[0] <= MAX_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and k_cache.shape[-1] % 32 == 0)


def op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
       inv_freq: torch.Tensor, num_heads: int, num_kv_heads: int,
       apply_in_fp32: bool = True) -> torch.Tensor:
    """Rotated q [T, H, D]; k (rotated) and v land in their cache slots. Triton on CUDA for
    1..MAX_ROWS half-precision rows whose head_dim / 2 is a multiple of 16 (``tl.dot``'s minimum
    tile), else the reference (cuBLAS + ``rope_cache``'s reference)."""
    if takes_triton(x, weight, k_cache):
        return qkv_rope_cache_triton(x, weight, bias, positions, k_cache, v_cache, slot_mapping,
                                     inv_freq, num_heads, num_kv_heads, apply_in_fp32)
    return qkv_rope_cache_reference(x, weight, bias, positions, k_cache, v_cache, slot_mapping,
                                    inv_freq, num_heads, num_kv_heads, apply_in_fp32)
