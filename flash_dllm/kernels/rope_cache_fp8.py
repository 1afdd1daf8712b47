"""RoPE + quantising K/V page write for fp8 pools: ``rope_cache`` for pages of e4m3 codes.

The same contract as ``kernels/rope_cache`` (rotate q and k, rotate-half RoPE; k rotated and v
raw into their page slots; rotated q returned; a negative slot writes nothing), for caches of
e4m3 codes with one fp32 scale per (page, kv head) beside them, written as
``kernels/kv_quant.write`` writes: a page's scale grows to ``amax(rows) / 448`` over every row
of the step that lands in it, a page whose scale grew is requantised to it first (``code * old /
new``; a page of scale 0 held nothing valid: zeroed), then the rows are quantised with the
page's final scale. The reference is exactly that composition (``rope_cache``'s rotation, then
``kv_quant.write_reference`` for K and for V): codes and scales equal it bit for bit.

Why: an fp8 pool otherwise takes PyTorch's rotary (a dozen elementwise kernels for q and k) and
``kv_quant.write_graph_safe`` (gathers, scatters, ``index_copy_``: another dozen), ~25 kernels
per layer that cost a batch-64 LLaDA-8B step 27 ms on an H100 (``findings/quantization.md``).
Here: four launches per layer, no host sync, static shapes (CUDA graphs):

1. ``_snapshot``: each row's page scales before the step (K and V);
2. ``_rotate_amax``: q rotated and stored; k rotated and v read, their per-head absmax / 448
   ``atomic_max``-ed into the page scales (now final);
3. ``_requant``: one program per (row, K/V) claims its page with an ``atomic_xchg`` on a flag;
   the first one requantises the page's heads whose scale grew (the others return; it compares
   the heads' scales in one vector load first and returns when none grew, as in most steps);
4. ``_quant_store``: k rotated again (the same arithmetic: the same values), k and v quantised
   with the final scales, codes stored; the flags reset for the next layer.

Rounding: the scales ``amax / 448`` and the codes ``x / scale`` are IEEE divisions
(``div_rn``), the codes rounded to nearest-even e4m3 in fp32 arithmetic (``kv_pages_kernels``):
as torch's on the CPU.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels import kv_quant, rope_cache
from flash_dllm.kernels._triton import (
    HAS_TRITON,
    check,
    check_device,
    env_switch,
    next_pow2,
    pdl_args,
    use_triton,
)

INTERPRET = rope_cache.INTERPRET
# The codes' rounding: in software (``_round_fp32``, then an exact cast: what the interpreter
# needs, its cast is not round-to-nearest-even) or by the cast alone, which on sm_89+ compiles to
# ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even; the values are clamped to +-448 first):
# the same codes in 23 % fewer instructions a value in ``_quant_store`` (53 -> 41, sm_90 SASS).
# On by default since an H100 ran the bit-exact test (every e4m3 value, midpoint and nudge) and
# timed it: ``_quant_store`` 1.60 -> 1.17 ms a batch-64 step (findings/quantization.md);
# FLASH_DLLM_KV_FP8_HW_ROUND=0 brings the software round back (A/B). Off under the interpreter.
HW_ROUND = env_switch("FLASH_DLLM_KV_FP8_HW_ROUND", True, "the codes rounded in software",
                      "by the e4m3 cast, the default") and not INTERPRET

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait
    from flash_dllm.kernels.kv_pages_kernels import _fp8_bits, _round_fp32
    from flash_dllm.kernels.rope_cache import _rotate_store, angles, rotated

    @triton.jit
    def _rotated(src, stride_h, n_heads, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr, FP32_MATH: tl.constexpr):
        """``rope_cache.rotated`` (the activation dtype's values) in fp32."""
        y1, y2 = rotated(src, stride_h, n_heads, c, s, HALF, BLOCK_H, BLOCK_HALF, ROTATE,
                         FP32_MATH)
        return y1.to(tl.float32), y2.to(tl.float32)

    @triton.jit
    def _snapshot(slot_ptr, ks_ptr, vs_ptr, old_ptr, T, HKV, PAGE_SIZE: tl.constexpr,
                  BLOCK_HKV: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = tl.where(slot >= 0, slot, 0) // PAGE_SIZE
        h = tl.arange(0, BLOCK_HKV)
        m = h < HKV
        tl.store(old_ptr + t * HKV + h, tl.load(ks_ptr + page * HKV + h, mask=m), mask=m)
        tl.store(old_ptr + (T + t) * HKV + h, tl.load(vs_ptr + page * HKV + h, mask=m), mask=m)

    @triton.jit
    def _rotate_amax(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr, qo_ptr, ks_ptr,
                     vs_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_qot, stride_qoh, H, HKV, PAGE_SIZE: tl.constexpr,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HKV: tl.constexpr, FP32_MATH: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        c, s = angles(pos_ptr, inv_freq_ptr, t, HALF, BLOCK_HALF)
        _rotate_store(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, H,
                      c, s, HALF, BLOCK_H, BLOCK_HALF, True, FP32_MATH)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            h = tl.arange(0, BLOCK_HKV)
            m = h < HKV
            k1, k2 = _rotated(k_ptr + t * stride_kt, stride_kh, HKV, c, s, HALF, BLOCK_HKV,
                              BLOCK_HALF, True, FP32_MATH)
            ak = tl.maximum(tl.max(tl.abs(k1), axis=1), tl.max(tl.abs(k2), axis=1))
            lim = tl.full((BLOCK_HKV,), 448.0, tl.float32)               # (kv_quant.FP8_MAX)
            tl.atomic_max(ks_ptr + page * HKV + h, tl.math.div_rn(ak, lim), mask=m)
            v1, v2 = _rotated(v_ptr + t * stride_vt, stride_vh, HKV, c, s, HALF, BLOCK_HKV,
                              BLOCK_HALF, False, FP32_MATH)
            av = tl.maximum(tl.max(tl.abs(v1), axis=1), tl.max(tl.abs(v2), axis=1))
            tl.atomic_max(vs_ptr + page * HKV + h, tl.math.div_rn(av, lim), mask=m)

    @triton.jit
    def _requant_page(cache, scale, old_row, page, HKV, D, stride_cp, stride_cs, stride_ch,
                      PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_HKV: tl.constexpr):
        """Every head of ``page`` whose scale grew from ``old_row[h]``: codes * old / new (0
        when old is 0: the page held nothing valid). The heads' scales are compared in one
        vector first: a step whose rows grew no scale of the page (most steps rewrite a block
        of values like the last ones) returns without the loop's two dependent loads a head."""
        hv = tl.arange(0, BLOCK_HKV)
        hm = hv < HKV
        grew = tl.load(old_row + hv, mask=hm, other=0.0) != tl.load(scale + page * HKV + hv,
                                                                    mask=hm, other=0.0)
        offs_s = tl.arange(0, PAGE_SIZE)
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_d[None, :] < D
        n_heads = tl.where(tl.max(grew.to(tl.int32), axis=0) > 0, HKV, 0)
        for h in range(0, n_heads):
            old = tl.load(old_row + h)
            new = tl.load(scale + page * HKV + h)
            if old != new:
                ptrs = (cache + page * stride_cp + offs_s[:, None] * stride_cs + h * stride_ch
                        + offs_d[None, :])
                x = tl.load(ptrs, mask=mask, other=0).to(tl.float8e4nv,
                                                         bitcast=True).to(tl.float32)
                ratio = tl.where(new > 0, tl.math.div_rn(old, tl.where(new > 0, new, 1.0)),
                                 0.0)
                y = tl.where(old > 0, x * ratio, 0.0)
                tl.store(ptrs, _fp8_bits(_round_fp32(y, 20, 16384.0, 0.015625)), mask=mask)

    @triton.jit
    def _requant(slot_ptr, old_ptr, flag_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, T, P, HKV, D,
                 stride_cp, stride_cs, stride_ch, PAGE_SIZE: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_HKV: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        half = tl.program_id(1)                                    # 0: K, 1: V
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            if tl.atomic_xchg(flag_ptr + half * P + page, 1) == 0:     # the page's first row
                old_row = old_ptr + (half * T + t) * HKV
                if half == 0:
                    _requant_page(kc_ptr, ks_ptr, old_row, page, HKV, D, stride_cp, stride_cs,
                                  stride_ch, PAGE_SIZE, BLOCK_D, BLOCK_HKV)
                else:
                    _requant_page(vc_ptr, vs_ptr, old_row, page, HKV, D, stride_cp, stride_cs,
                                  stride_ch, PAGE_SIZE, BLOCK_D, BLOCK_HKV)

    @triton.jit
    def _codes(y, scale, HW_ROUND: tl.constexpr):
        """fp32 values ``y [BH, BHALF]`` with their heads' scales ``[BH]`` -> e4m3 codes."""
        sc = tl.where(scale > 0, scale, 1.0)[:, None]
        z = tl.minimum(tl.maximum(tl.math.div_rn(y, sc), -448.0), 448.0)     # (kv_quant.FP8_MAX)
        if HW_ROUND:             # (HW_ROUND above: the cast rounds to nearest even itself)
            return _fp8_bits(z)
        return _fp8_bits(_round_fp32(z, 20, 16384.0, 0.015625))

    @triton.jit
    def _quant_store(k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr, kc_ptr, vc_ptr, ks_ptr,
                     vs_ptr, flag_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cp,
                     stride_cs, stride_ch, P, HKV, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_HKV: tl.constexpr,
                     FP32_MATH: tl.constexpr, HW_ROUND: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE_SIZE
            off = slot % PAGE_SIZE
            c, s = angles(pos_ptr, inv_freq_ptr, t, HALF, BLOCK_HALF)
            h = tl.arange(0, BLOCK_HKV)
            i = tl.arange(0, BLOCK_HALF)
            m = (h[:, None] < HKV) & (i[None, :] < HALF)
            dst = page * stride_cp + off * stride_cs + h[:, None] * stride_ch + i[None, :]
            k1, k2 = _rotated(k_ptr + t * stride_kt, stride_kh, HKV, c, s, HALF, BLOCK_HKV,
                              BLOCK_HALF, True, FP32_MATH)
            sk = tl.load(ks_ptr + page * HKV + h, mask=h < HKV, other=1.0)
            tl.store(kc_ptr + dst, _codes(k1, sk, HW_ROUND), mask=m)
            tl.store(kc_ptr + dst + HALF, _codes(k2, sk, HW_ROUND), mask=m)
            v1, v2 = _rotated(v_ptr + t * stride_vt, stride_vh, HKV, c, s, HALF, BLOCK_HKV,
                              BLOCK_HALF, False, FP32_MATH)
            sv = tl.load(vs_ptr + page * HKV + h, mask=h < HKV, other=1.0)
            tl.store(vc_ptr + dst, _codes(v1, sv, HW_ROUND), mask=m)
            tl.store(vc_ptr + dst + HALF, _codes(v2, sv, HW_ROUND), mask=m)
            tl.store(flag_ptr + page, 0)                   # (every row of the page: all 0)
            tl.store(flag_ptr + P + page, 0)


def rope_cache_fp8_reference(q, k, v, positions, k_cache, v_cache, k_scale, v_scale,
                             slot_mapping, inv_freq, apply_in_fp32: bool = True) -> torch.Tensor:
    """``rope_cache``'s rotation, then ``kv_quant.write_reference`` for K and V (host syncs)."""
    freqs = positions.float()[:, None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    q_rot = rope_cache._rope(q, cos, sin, apply_in_fp32)
    k_rot = rope_cache._rope(k, cos, sin, apply_in_fp32)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    kv_quant.write_reference(k_cache, k_scale, slots, k_rot[keep])
    kv_quant.write_reference(v_cache, v_scale, slots, v[keep])
    return q_rot.contiguous()


def _check(q, k, v, positions, k_cache, v_cache, k_scale, v_scale, slot_mapping, inv_freq):
    T, H, D = q.shape
    Hkv = k.shape[1]
    check(k.shape == (T, Hkv, D) and v.shape == (T, Hkv, D) and D % 2 == 0,
          f"rope_cache_fp8: q [T, H, D] and k / v [T, Hkv, D] with D even, got "
          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    check(all(t.stride(2) == 1 for t in (q, k, v)) and k.dtype == q.dtype == v.dtype,
          "rope_cache_fp8: q / k / v of one dtype with contiguous heads")
    P, ps = k_cache.shape[:2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(c.dtype == kv_quant.FP8 and c.shape == (P, ps, Hkv, D) and c.stride(3) == 1
              and c.stride() == k_cache.stride(),
              f"rope_cache_fp8: {name} must be float8_e4m3fn [{P}, {ps}, {Hkv}, {D}] laid out as "
              f"k_cache, got {c.dtype} {tuple(c.shape)} strides {c.stride()}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(s.dtype == torch.float32 and s.shape == (P, Hkv) and s.is_contiguous(),
              f"rope_cache_fp8: {name} must be contiguous float32 [{P}, {Hkv}], got "
              f"{s.dtype} {tuple(s.shape)}")
    check(ps & (ps - 1) == 0, f"rope_cache_fp8: the page size must be a power of two, got {ps}")
    check(positions.shape == (T,) and slot_mapping.shape == (T,)
          and inv_freq.shape == (D // 2,) and inv_freq.dtype == torch.float32,
          f"rope_cache_fp8: positions / slot_mapping [{T}], inv_freq fp32 [{D // 2}]")
    return T, H, Hkv, D, P, ps


def rope_cache_fp8_triton(q, k, v, positions, k_cache, v_cache, k_scale, v_scale, slot_mapping,
                          inv_freq, apply_in_fp32: bool = True) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hkv, D]; e4m3 caches [P, page_size, Hkv, D] and their fp32 scales
    [P, Hkv] (written in place) -> rotated q [T, H, D]. Duplicate slots in one call: undefined."""
    check(HAS_TRITON, "rope_cache_fp8: triton is not importable")
    T, H, Hkv, D, P, ps = _check(q, k, v, positions, k_cache, v_cache, k_scale, v_scale,
                                 slot_mapping, inv_freq)
    check_device("rope_cache_fp8", INTERPRET, q, k, v, positions, k_cache, v_cache, k_scale,
                 v_scale, slot_mapping, inv_freq)
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    half, bh, bkv = D // 2, next_pow2(D // 2), next_pow2(Hkv)
    kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    old = torch.empty((2, T, Hkv), dtype=torch.float32, device=q.device)
    flags = torch.zeros((2 * P,), dtype=torch.int32, device=q.device)
    pdl = pdl_args(q)
    _snapshot[(T,)](slot_mapping, k_scale, v_scale, old, T, Hkv, PAGE_SIZE=ps, BLOCK_HKV=bkv,
                    **pdl)
    _rotate_amax[(T,)](q, k, v, positions, slot_mapping, inv_freq, q_out, k_scale, v_scale,
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
                       v.stride(1), q_out.stride(0), q_out.stride(1), H, Hkv, PAGE_SIZE=ps,
                       HALF=half, BLOCK_HALF=bh, BLOCK_H=next_pow2(H), BLOCK_HKV=bkv,
                       FP32_MATH=bool(apply_in_fp32), num_warps=4,
                       **rope_cache.EXACT_ROUNDING, **pdl)
    _requant[(T, 2)](slot_mapping, old, flags, kc, vc, k_scale, v_scale, T, P, Hkv, D,
                     kc.stride(0), kc.stride(1), kc.stride(2), PAGE_SIZE=ps,
                     BLOCK_D=next_pow2(D), BLOCK_HKV=bkv, num_warps=4, **pdl)
    _quant_store[(T,)](k, v, positions, slot_mapping, inv_freq, kc, vc, k_scale, v_scale, flags,
                       k.stride(0), k.stride(1), v.stride(0), v.stride(1), kc.stride(0),
                       kc.stride(1), kc.stride(2), P, Hkv, PAGE_SIZE=ps, HALF=half,
                       BLOCK_HALF=bh, BLOCK_HKV=bkv, FP32_MATH=bool(apply_in_fp32),
                       HW_ROUND=HW_ROUND, num_warps=4, **rope_cache.EXACT_ROUNDING, **pdl)
    return q_out


def op(q, k, v, positions, k_cache, v_cache, k_scale, v_scale, slot_mapping, inv_freq,
       apply_in_fp32: bool = True) -> torch.Tensor:
    """Rotated q; k (rotated) and v quantised into their fp8 page slots. Triton on CUDA."""
    if use_triton(q, k, v, k_cache):
        return rope_cache_fp8_triton(q, k, v, positions, k_cache, v_cache, k_scale, v_scale,
                                     slot_mapping, inv_freq, apply_in_fp32)
    return rope_cache_fp8_reference(q, k, v, positions, k_cache, v_cache, k_scale, v_scale,
                                    slot_mapping, inv_freq, apply_in_fp32)
