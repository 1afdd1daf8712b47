"""Paged bidirectional (non-causal) varlen attention, with optional per-key attention mass.

Queries of B requests are packed ``q [T, H, D]`` (``cu_seqlens_q [B+1]``, no padding). Request b
owns the pages ``block_table[b, :ceil(L_b / page_size)]`` of ``k_cache``/``v_cache``
``[num_pages, page_size, Hkv, D]`` and attends to ALL of its ``L_b = seq_lens_k[b]`` keys: the
active block's fresh K/V were already written there by ``rope_cache``, so there is no separate
in-flight K/V operand. GQA: query head h reads kv head ``h // (H / Hkv)``. Scale ``1/sqrt(D)``,
fp32 online softmax, output ``[T, H, D]`` in q's dtype.

``return_mass=True`` also returns ``mass [B, max_pages * page_size]`` fp32: the softmax probability
each key receives summed over the request's queries and heads (Flash-Cache's top-k tracking;
Elastic-Cache's drift tests). Columns >= L_b are 0; each row sums to ``q_len_b * H``.

fp8 pools (``kernels/kv_quant.py``): e4m3 caches with ``k_scale`` / ``v_scale`` [num_pages, Hkv]
fp32; the codes are loaded as bytes and meet q (and the probabilities) in the dots as values, each
key's page scale multiplying its scores and probabilities (no dequantised copy); ``f16`` takes
those dots in fp16 (``paged_attention_triton``).

Split-KV (flash-decoding) for small batches: with few requests the grid has few programs (batch 1
of LLaDA-8B: 32 heads x 1 query tile = 32 programs on 132 SMs), each streaming its request's whole
canvas of keys, so attention ran at ~10 % of the copy bandwidth (1.25 ms of a 6.2 ms step,
``benchmarks/results/step/profile_step_h200.json``). Given a host bound ``max_seqlen_k`` on the key
counts, ``paged_attention_triton`` then splits each request's keys into ``num_splits`` chunks of
``chunk`` keys; program ``(m, h, b * num_splits + s)`` writes chunk s's normalised partial output
and its log2-sum-exp (fp32) to a workspace, and a second kernel merges the chunks per (row,
head). ``split_plan`` picks the split from the host-known grid size only, so it is static for a
CUDA graph. Mass tracking never splits (it needs each row's final normaliser).

Kernel: program ``(m, h, b)`` owns ``BLOCK_M`` queries of request b and one head (GQA with few
queries: ``heads_per_program`` heads of one kv head, as (query, head) rows); it loops over the
request's keys in ``BLOCK_N`` tiles, looking up each key's page in the block table (any page size;
a key row is ``D`` contiguous values, 256 B in bf16, so gathered rows still load as full sectors),
``tl.dot`` for QK^T and PV with fp32 accumulation (fp32 inputs: ``FP32_PRECISION`` products), exp2-based online softmax. Programs past their
request's query count exit at once, so the grid needs only the host-known ``max_seqlen_q`` (no
device->host sync). With mass tracking, a second sweep recomputes QK^T with the final row
max/normaliser (no V reads) and ``atomic_add``s each tile's column sums into the mass row.

NOTE (size): ~480 lines for one op: the kernel, its split merge, the fp8 pages' scale helpers and
fp16 dots, the tile defaults and the PyTorch reference share one layout and are read together.
"""
from __future__ import annotations

import math
import os

import torch

from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    batch_invariant_active,
    check,
    check_device,
    check_dtype,
    env_switch,
    interpreting,
    next_pow2,
    pdl_args,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
FP8 = torch.float8_e4m3fn   # fp8 KV pools (kernels/kv_quant.py)


# float32 inputs: how ``tl.dot`` multiplies. "ieee" (true fp32 products on the CUDA cores) took
# 7.0 ms of a 9.8 ms step at batch 32 of the demo model against 0.06 ms in bf16
# (profile_batch_step_h200.json); "tf32x3" splits each operand into two TF32 parts and runs three
# tensor-core products (~fp32 accuracy); "tf32" is one (10-bit mantissa)
FP32_PRECISION = "tf32x3"

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def _kv_tile(ptr, page, slot, kvh, stride_p, stride_s, stride_h, offs_d, mask, dtype,
                 FP8: tl.constexpr):
        """[BN, BD] key (or value) rows of kv head ``kvh`` at (``page``, ``slot``) [BN] in
        ``dtype``; fp8 pools: the e4m3 codes (loaded as uint8) as values, unscaled (exact in
        any float dtype): their page's scale is applied to the scores / probabilities instead
        (``_kv_scaled``), so a tile costs one conversion per element. (``quant_decode``'s e4m3
        bit recipe instead of ``cvt`` was no faster here: findings/quantization.md.)"""
        x = tl.load(ptr + (page * stride_p + slot * stride_s + kvh * stride_h)[:, None]
                    + offs_d[None, :], mask=mask, other=0)
        if FP8:
            x = x.to(tl.float8e4nv, bitcast=True)
        return x.to(dtype)

    @triton.jit
    def _kv_scaled(x, scale_ptr, page, kvh, stride_sp, n_mask, FP8: tl.constexpr):
        """fp8 pools: ``x`` [BM, BN] (scores, or probabilities before the PV dot) times each
        key's page scale for kv head ``kvh``: q . (code x scale) = (q . code) x scale and
        p . (code x scale) = (p x scale) . code. Other pools: ``x``."""
        if FP8:
            x = x * tl.load(scale_ptr + page * stride_sp + kvh, mask=n_mask, other=0.0)[None, :]
        return x

    @triton.jit
    def _dots_q(q, F16: tl.constexpr):
        """q in the dots' dtype: fp16 with ``F16`` (fp8 pages: e4m3 -> fp16 is one conversion
        per two codes), clamped to its range (a larger q would be inf, the scores NaN)."""
        if F16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        return q

    @triton.jit
    def _pv_dot(p, v, vs_ptr, page, kvh, stride_sp, n_mask, PREC: tl.constexpr,
                FP8: tl.constexpr, F16: tl.constexpr):
        """[BM, BD] fp32: the probabilities ``p`` [BM, BN] (fp8 pages: times each key's v scale)
        times the value tile ``v`` [BN, BD]. ``F16``: each row over its largest term in the tile
        before fp16, the dot scaled back, so what rounds away is below 2^-24 of that term."""
        w = _kv_scaled(p, vs_ptr, page, kvh, stride_sp, n_mask, FP8)
        if F16:
            r = tl.max(w, axis=1)          # (below fp32's normals 1 / r would overflow)
            r = tl.where(r >= 1.1754944e-38, r, 1.0)
            out = tl.dot((w * (1.0 / r)[:, None]).to(v.dtype), v, input_precision=PREC) \
                * r[:, None]
        else:
            out = tl.dot(w.to(v.dtype), v, input_precision=PREC)
        return out

    # NOTE: N_SPLITS is a runtime argument (a constexpr compiled one variant per count, issue
    # 21); HP > 1: rows are (query, head) pairs of HP heads of one kv head
    @triton.jit
    def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, mass_ptr, cu_q_ptr, len_k_ptr, bt_ptr,
                           stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_ks,
                           stride_kh, stride_vp, stride_vs, stride_vh, stride_bt, stride_mass,
                           qk_scale, D, GROUP, CHUNK, part_ptr, lse_ptr, stride_ps, stride_pt,
                           stride_ph, stride_ls, stride_lt, N_SPLITS, ks_ptr, vs_ptr, stride_sp,
                           PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TRACK: tl.constexpr,
                           PREC: tl.constexpr, SPLIT: tl.constexpr, FP8: tl.constexpr,
                           HP: tl.constexpr = 1, PDL: tl.constexpr = False,
                           F16: tl.constexpr = False):
        pdl_wait(PDL)
        pid_m, pid_bs = tl.program_id(0), tl.program_id(2)
        b, split = pid_bs // N_SPLITS, pid_bs % N_SPLITS
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        if pid_m * (BLOCK_M // HP) >= q_len:
            return
        h0 = tl.program_id(1) * HP
        h = h0 + tl.arange(0, BLOCK_M) % HP                 # [BM]: each row's query head
        L = tl.load(len_k_ptr + b)
        n_lo = 0
        if SPLIT:                             # this program's chunk of the keys: [n_lo, L)
            n_lo = split * CHUNK
            L = tl.minimum(L, n_lo + CHUNK)
        kvh = h0 // GROUP
        offs_m = pid_m * (BLOCK_M // HP) + tl.arange(0, BLOCK_M) // HP
        offs_d = tl.arange(0, BLOCK_D)
        m_mask, d_mask = offs_m < q_len, offs_d < D
        rows = (q_start + offs_m).to(tl.int64)
        q = _dots_q(tl.load(q_ptr + rows[:, None] * stride_qt + h[:, None] * stride_qh
                            + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :],
                            other=0.0), F16)                                    # [BM, BD]
        bt_row = bt_ptr + b.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(n_lo, L, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < L
            page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot_in_page = offs_n % PAGE_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = _kv_tile(k_ptr, page, slot_in_page, kvh, stride_kp, stride_ks, stride_kh,
                         offs_d, kv_mask, q.dtype, FP8)                          # [BN, BD]
            s = _kv_scaled(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale, ks_ptr,
                           page, kvh, stride_sp, n_mask, FP8)                   # log2 domain
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _kv_tile(v_ptr, page, slot_in_page, kvh, stride_vp, stride_vs, stride_vh,
                         offs_d, kv_mask, q.dtype, FP8)                          # [BN, BD]
            acc = acc * alpha[:, None] + _pv_dot(p, v, vs_ptr, page, kvh, stride_sp, n_mask,
                                                 PREC, FP8, F16)
            m_i = m_new
        l_safe = tl.where(l_i > 0, l_i, 1.0)                  # L == 0: output zeros, not NaN
        out = acc / l_safe[:, None]
        if SPLIT:                       # partial output + log2-sum-exp; -inf for an empty chunk
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(lse_ptr + split * stride_ls + rows * stride_lt + h, lse, mask=m_mask)
            tl.store(part_ptr + split * stride_ps + rows[:, None] * stride_pt + h[:, None]
                     * stride_ph + offs_d[None, :], out, mask=m_mask[:, None] & d_mask[None, :])
            return
        tl.store(o_ptr + rows[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
        if TRACK:
            lse = m_i + tl.log2(l_safe)                        # per-row log2 normaliser
            mass_row = mass_ptr + b.to(tl.int64) * stride_mass
            for n0 in range(0, L, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < L
                page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
                k = _kv_tile(k_ptr, page, offs_n % PAGE_SIZE, kvh, stride_kp, stride_ks,
                             stride_kh, offs_d, n_mask[:, None] & d_mask[None, :], q.dtype, FP8)
                s = _kv_scaled(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale, ks_ptr,
                               page, kvh, stride_sp, n_mask, FP8)
                p = tl.exp2(s - lse[:, None])
                p = tl.where(m_mask[:, None] & n_mask[None, :], p, 0.0)
                tl.atomic_add(mass_row + offs_n, tl.sum(p, axis=0), mask=n_mask)


    @triton.jit
    def _merge_splits_kernel(part_ptr, lse_ptr, o_ptr, stride_ps, stride_pt, stride_ph,
                             stride_ls, stride_lt, stride_ot, stride_oh, D, SPLITS,
                             BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < SPLITS
        lse = tl.load(lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=s_mask,
                      other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)             # no keys at all: zeros
        w = tl.exp2(lse - m)                                    # 0 for empty chunks
        # NOTE: every split of an existing row writes its partial (zeros for an empty chunk),
        # so this load does not wait for the lse one
        part = tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph
                       + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < D),
                       other=0.0)
        total = tl.sum(w, axis=0)
        out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
                 mask=offs_d < D)


# a grid of fewer programs than this splits the keys (about two waves of 132 SMs)
SPLIT_TARGET_PROGRAMS = 264
MAX_SPLITS = 16
# Key tiles. Split grids (few programs, latency-bound) and fp32 queries take SPLIT_BLOCK_N keys a
# tile; unsplit 16-bit queries take MANY_KEYS_BLOCK_N (128), fp8 pages fp16 dots (``f16``) at
# 128+ keys. H100, batch 64 of the LLaDA-8B dual step, 32 layers (study_attn_fp8_h100.json):
# bf16 pages 12.28 -> 11.83 ms at 128 keys; fp8 pages 14.89 ms at 64 keys, 11.65 with fp16 dots
# at 128 (15.85 at 64: the row scale is paid per tile). Read at import, for
# A/B in one process: FLASH_DLLM_ATTN_BLOCK_N (a power of two, 16-256), FLASH_DLLM_ATTN_FP8_F16=0.
SPLIT_BLOCK_N = 64
MANY_KEYS_BLOCK_N = int(os.environ.get("FLASH_DLLM_ATTN_BLOCK_N", "128"))
check(MANY_KEYS_BLOCK_N in (16, 32, 64, 128, 256),
      f"FLASH_DLLM_ATTN_BLOCK_N must be a power of two from 16 to 256, got {MANY_KEYS_BLOCK_N}")
FP8_F16 = env_switch("FLASH_DLLM_ATTN_FP8_F16", True, "bf16 dots on fp8 pages",
                     "fp16 dots, the default")


def split_plan(programs: int, max_seqlen_k: int | None, block_n: int) -> tuple[int, int]:
    """(num_splits, chunk keys) for a grid of ``programs`` (query tiles x heads x requests) whose
    requests hold at most ``max_seqlen_k`` keys: split only a grid under
    ``SPLIT_TARGET_PROGRAMS``, into chunks of whole ``block_n`` tiles. (1, 0) = no split."""
    if not max_seqlen_k or programs >= SPLIT_TARGET_PROGRAMS // 2:
        return 1, 0
    tiles = -(-max_seqlen_k // block_n)
    want = min(MAX_SPLITS, tiles, -(-SPLIT_TARGET_PROGRAMS // max(programs, 1)))
    if want <= 1:
        return 1, 0
    chunk = -(-tiles // want) * block_n
    return -(-max_seqlen_k // chunk), chunk


def heads_per_program(group: int, max_seqlen_q: int, block_m: int, plain: bool) -> int:
    """How many query heads of one kv head a program packs into its ``block_m`` rows: the
    largest power of 2 dividing the GQA ``group`` whose heads x the (power-of-2-rounded) query
    count fit, so a block of 4 queries with 4 heads per kv head fills a 16-row tile and reads
    each K/V tile once, not four times. 1 with mass tracking or ``plain`` (deterministic)."""
    hp = 1
    while (not plain and group % (2 * hp) == 0
           and next_pow2(max(1, max_seqlen_q)) * 2 * hp <= block_m):
        hp *= 2
    return hp


def seqlen_bound(n: int) -> int:
    """The host bound on key counts the engine passes (``PagedBatch.max_k``): the next power of
    two >= max(n, 256), so that a CUDA graph keyed on it is reused across canvas lengths."""
    return next_pow2(max(int(n), 256))


def _check_common(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_table,
                  k_scale=None, v_scale=None):
    check(q.dim() == 3, f"paged_attention: q must be [T, H, D], got {tuple(q.shape)}")
    T, H, D = q.shape
    check(k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.shape[3] == D,
          f"paged_attention: caches must be [num_pages, page_size, Hkv, {D}], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    Hkv = k_cache.shape[2]
    check(H % Hkv == 0, f"paged_attention: H={H} must be a multiple of Hkv={Hkv}")
    check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1,
          f"paged_attention: cu_seqlens_q must be [B+1], got {tuple(cu_seqlens_q.shape)}")
    B = cu_seqlens_q.shape[0] - 1
    check(seq_lens_k.shape == (B,), f"paged_attention: seq_lens_k must be [{B}], got "
                                    f"{tuple(seq_lens_k.shape)}")
    check(block_table.dim() == 2 and block_table.shape[0] == B,
          f"paged_attention: block_table must be [{B}, max_pages], got {tuple(block_table.shape)}")
    fp8 = k_cache.dtype == FP8
    check(fp8 == (k_scale is not None) == (v_scale is not None) and v_cache.dtype == k_cache.dtype,
          f"paged_attention: float8_e4m3fn caches come with k_scale and v_scale (and only they "
          f"do), got {k_cache.dtype} / {v_cache.dtype} caches, scales given: "
          f"{k_scale is not None} / {v_scale is not None}")
    if fp8:
        want = (k_cache.shape[0], Hkv)
        check(k_scale.shape == want and v_scale.shape == want
              and k_scale.dtype == v_scale.dtype == torch.float32
              and k_scale.stride(1) == 1 and v_scale.stride(1) == 1
              and k_scale.stride(0) == v_scale.stride(0),
              f"paged_attention: k_scale / v_scale must be {list(want)} float32 with the same "
              f"row stride, got {tuple(k_scale.shape)} {k_scale.dtype} / "
              f"{tuple(v_scale.shape)} {v_scale.dtype}")
    return T, H, D, Hkv, B


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                              block_table: torch.Tensor, max_seqlen_q: int | None = None,
                              scale: float | None = None, return_mass: bool = False,
                              k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None):
    """PyTorch reference (a loop over requests; host syncs): same contract as the Triton op.

    Each request is one SDPA call over its gathered pages (the engine's CPU path runs this); the
    mass, when asked for, comes from an explicit float32 softmax on the side. fp8 pages are
    dequantised to q's dtype first (``code * scale`` in fp32, rounded once)."""
    _, H, D, Hkv, B = _check_common(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_table,
                                    k_scale, v_scale)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    page_size = k_cache.shape[1]
    out = torch.zeros_like(q)
    mass = torch.zeros((B, block_table.shape[1] * page_size), dtype=torch.float32,
                       device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for b in range(B):
        q0, q1, L = cu[b], cu[b + 1], lens[b]
        if q1 == q0 or L == 0:
            continue
        pages = block_table[b, :-(-L // page_size)].long()
        # NOTE: the output is always SDPA's, with or without mass, so that asking for the mass
        # (cache="flash" in the batch) never changes any request's numbers
        if k_scale is None:
            kp, vp = k_cache[pages], v_cache[pages]                       # [n, ps, Hkv, D]
        else:                             # (fp8 gathered as bytes: not every back end has it)
            kp = k_cache.view(torch.uint8)[pages].view(FP8)
            vp = v_cache.view(torch.uint8)[pages].view(FP8)
            kp = (kp.float() * k_scale[pages][:, None, :, None]).to(q.dtype)
            vp = (vp.float() * v_scale[pages][:, None, :, None]).to(q.dtype)
        k = kp.flatten(0, 1)[:L].transpose(0, 1)                           # [Hkv, L, D]
        v = vp.flatten(0, 1)[:L].transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1), k, v, scale=scale, enable_gqa=H != Hkv)  # [H, Tq, D]
        out[q0:q1] = o.transpose(0, 1)
        if return_mass:
            kf = k.float().repeat_interleave(H // Hkv, dim=0)              # [H, L, D]
            s = torch.einsum("qhd,hkd->hqk", q[q0:q1].float(), kf) * scale  # [H, Tq, L]
            mass[b, :L] = torch.softmax(s, dim=-1).sum(dim=(0, 1))
    return (out, mass) if return_mass else out


def _kernel_caches(k_cache, v_cache, k_scale, v_scale, dummy):
    """The kernel's operands: fp8 caches as uint8 bits, absent scales as ``dummy``."""
    if k_scale is None:
        return k_cache, v_cache, dummy, dummy
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                           block_table: torch.Tensor, max_seqlen_q: int,
                           scale: float | None = None, return_mass: bool = False,
                           max_seqlen_k: int | None = None, *,
                           block_m: int | None = None, block_n: int | None = None,
                           num_warps: int = 4,
                           num_stages: int = 2, num_splits: int | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, f16: bool | None = None):
    """q [T, H, D]; k/v_cache [num_pages, page_size, Hkv, D]; cu_seqlens_q [B+1], seq_lens_k [B],
    block_table [B, max_pages] int32 on q's device; ``max_seqlen_q`` a host int >= every request's
    query count -> out [T, H, D] (and mass [B, max_pages * page_size] fp32 if ``return_mass``).

    ``max_seqlen_k``: a host int >= every ``seq_lens_k`` (None: unknown, no split-KV); keys
    beyond it are never read when the keys are split. ``num_splits`` forces a split (tests).
    fp8 caches (``float8_e4m3fn``) come with ``k_scale`` / ``v_scale`` [num_pages, Hkv] fp32:
    the codes meet q in the dots and the page scales multiply the scores and probabilities.
    ``f16`` (fp8 pages, 16-bit q; default ``FP8_F16`` at 128+ keys a tile): fp16 dots, q in fp16
    (exact for |q| in [2^-14, 65504]; clamped to 65504: a larger q gives a wrong answer, not NaN)
    and the codes converted to it (exact; one conversion per two codes against bf16's two per
    code); each row's probabilities times the keys' v scales, over the row's largest in the
    tile, meet V in fp16 and the dot is scaled back (what fp16 drops is below 2^-24 of the
    row's largest term in the tile, whatever the pages' scales). ``block_n``:
    keys a tile (default: ``SPLIT_BLOCK_N`` split, ``MANY_KEYS_BLOCK_N`` unsplit)."""
    check(HAS_TRITON, "paged_attention_triton: triton is not importable")
    T, H, D, Hkv, B = _check_common(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_table,
                                    k_scale, v_scale)
    check_dtype("paged_attention: q", q, FLOAT_DTYPES)
    fp8 = k_scale is not None
    check(not f16 or (fp8 and q.dtype in (torch.bfloat16, torch.float16)),
          f"paged_attention: f16 (fp16 dots) reads fp8 pages with bf16 / fp16 queries, got "
          f"{k_cache.dtype} pages and {q.dtype} queries")
    check(fp8 or (k_cache.dtype == q.dtype and v_cache.dtype == q.dtype),
          f"paged_attention: cache dtypes {k_cache.dtype}/{v_cache.dtype} != q dtype {q.dtype}")
    check(q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1,
          f"paged_attention: head_dim must be contiguous, strides q {q.stride()} k "
          f"{k_cache.stride()} v {v_cache.stride()}")
    check(cu_seqlens_q.dtype == torch.int32 and seq_lens_k.dtype == torch.int32
          and block_table.dtype == torch.int32,
          f"paged_attention: cu_seqlens_q / seq_lens_k / block_table must be int32, got "
          f"{cu_seqlens_q.dtype} / {seq_lens_k.dtype} / {block_table.dtype}")
    check(cu_seqlens_q.is_contiguous() and seq_lens_k.is_contiguous()
          and block_table.stride(1) == 1, "paged_attention: index tensors must be contiguous")
    check(isinstance(max_seqlen_q, int) and max_seqlen_q >= 0,
          f"paged_attention: max_seqlen_q must be a host int, got {max_seqlen_q!r}")
    check(max_seqlen_k is None or (isinstance(max_seqlen_k, int) and max_seqlen_k >= 0),
          f"paged_attention: max_seqlen_k must be None or a host int, got {max_seqlen_k!r}")
    check_device("paged_attention", INTERPRET, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k,
                 block_table, *((k_scale, v_scale) if fp8 else ()))
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    page_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)              # [T, H, D]
    if return_mass:                                      # atomically accumulated: starts at 0
        mass = torch.zeros((B, block_table.shape[1] * page_size), dtype=torch.float32,
                           device=q.device)
    else:                                                # never touched (TRACK=False)
        mass = torch.empty((1, 1), dtype=torch.float32, device=q.device)
    if T > 0 and B > 0 and max_seqlen_q > 0:
        invariant = batch_invariant_active()      # deterministic: nothing follows the batch
        split_n = block_n or SPLIT_BLOCK_N       # the tile the split plan counts in
        if block_m is None:
            block_m = 32 if invariant else (
                16 if max_seqlen_q <= 16 else (32 if max_seqlen_q <= 32 else 64))
        hp = heads_per_program(H // Hkv, max_seqlen_q, block_m,
                               bool(return_mass) or invariant)
        m_tiles = -(-max_seqlen_q // (block_m // hp))
        splits, chunk = 1, 0
        if not return_mass:
            check(num_splits is None or num_splits <= MAX_SPLITS,
                  f"paged_attention: num_splits must be <= {MAX_SPLITS}, got {num_splits}")
            if num_splits is not None and num_splits > 1 and max_seqlen_k:
                chunk = -(-max_seqlen_k // (num_splits * split_n)) * split_n
                splits = -(-max_seqlen_k // chunk)
            elif num_splits is None and not invariant:
                splits, chunk = split_plan(m_tiles * (H // hp) * B, max_seqlen_k, split_n)
        block_n = block_n or (MANY_KEYS_BLOCK_N if splits == 1 and q.element_size() == 2
                              else split_n)            # (unsplit 16-bit q: the wide tile)
        if f16 is None:     # the default: fp16 dots where they pay (the key tiles' comment)
            f16 = FP8_F16 and fp8 and q.element_size() == 2 and block_n >= 128
        block_d = max(16, next_pow2(D))
        if splits > 1:
            part = torch.empty((splits, T, H, D), dtype=torch.float32, device=q.device)
            lse = torch.empty((splits, T, H), dtype=torch.float32, device=q.device)
        else:
            part = lse = mass                                   # never touched
        kq, vq, ks, vs = _kernel_caches(k_cache, v_cache, k_scale, v_scale, mass)
        pdl = pdl_args(q)
        _paged_attn_kernel[(m_tiles, H // hp, B * splits)](
            q, kq, vq, out, mass, cu_seqlens_q, seq_lens_k, block_table,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0), mass.stride(0), scale * 1.4426950408889634, D, H // Hkv,
            chunk, part, lse, part.stride(0), part.stride(1) if splits > 1 else 0,
            part.stride(2) if splits > 1 else 0, lse.stride(0),
            lse.stride(1) if splits > 1 else 0, splits, ks, vs, ks.stride(0) if fp8 else 0,
            PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, TRACK=bool(return_mass),
            # fp32 inputs: FP32_PRECISION (tf32x3: ~fp32 error; plain TF32 is ~1e-3 off)
            PREC=FP32_PRECISION if q.dtype == torch.float32 else "tf32", SPLIT=splits > 1,
            FP8=fp8, HP=hp, F16=bool(f16),
            num_warps=num_warps, num_stages=num_stages, **pdl)
        if splits > 1:
            # NOTE: rows of requests with fewer queries than max_seqlen_q are written by their
            # own programs only; every row t < T belongs to some request, so all are merged
            _merge_splits_kernel[(T, H)](
                part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                lse.stride(1), out.stride(0), out.stride(1), D, splits,
                BLOCK_S=MAX_SPLITS, BLOCK_D=block_d, num_warps=4,   # one variant for any count
                **pdl)
    elif T > 0:
        out.zero_()
    return (out, mass) if return_mass else out


def op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
       seq_lens_k: torch.Tensor, block_table: torch.Tensor, max_seqlen_q: int,
       scale: float | None = None, return_mass: bool = False,
       max_seqlen_k: int | None = None, k_scale: torch.Tensor | None = None,
       v_scale: torch.Tensor | None = None):
    """out [T, H, D] (, mass [B, max_pages * page_size]); Triton on CUDA, else the reference.
    fp8 caches take their ``k_scale`` / ``v_scale`` [num_pages, Hkv]."""
    if use_triton(q, k_cache, v_cache):
        return paged_attention_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_table,
                                      max_seqlen_q, scale, return_mass, max_seqlen_k,
                                      k_scale=k_scale, v_scale=v_scale)
    return paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_table,
                                     max_seqlen_q, scale, return_mass, k_scale, v_scale)
