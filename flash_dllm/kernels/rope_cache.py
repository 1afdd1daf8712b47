"""Fused RoPE + paged K/V cache write (Flash-Cache).

Given the projected ``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` (usually zero-copy views of one
``qkv [T, (H + 2 Hkv) D]`` projection, see ``split_qkv``), integer ``positions [T]`` and a
``slot_mapping [T]`` (``slot = page * page_size + offset``; a negative slot skips the write, e.g.
padding rows of a CUDA-graph bucket), the kernel

- RMS-normalises q and k per head first when given their norms (``qk_norm``: Qwen3 / SDAR,
  LLaDA-MoE; ``kernels/rmsnorm``'s arithmetic),
- rotates q and k (rotate-half RoPE, ``angle = position * inv_freq`` in fp32; ``rotary_dim``: only
  the first values of each head, up to half of it, the rest passed through: LLaDA2),
- stores rotated k and raw v straight into their page slots of ``k_cache``/``v_cache``
  (``[num_pages, page_size, Hkv, D]``, see ``flash_dllm.cache.paged``): no intermediate K/V tensor,
- returns rotated q ``[T, H, D]`` (contiguous, ready for the attention kernel).

``apply_in_fp32=True`` (LLaDA/OLMo) rotates in fp32 and casts once; ``False`` (Qwen2/Dream) mirrors
the activation-dtype math of ``layers.rotary.Rotary`` (cos/sin and every product rounded).
``inv_freq`` is passed in (``inv_freq()`` below or ``Rotary._freqs``) so the kernel and the model
share bit-identical frequencies.

Kernel: per token, ``Q_SPLIT`` programs for q's heads (each a ``[heads / Q_SPLIT, D/2]`` register
tile per half) and one for k and v (its K and V slot rows, ``Hkv * D`` contiguous values each,
written once). ``Q_SPLIT`` is 1 from ~64 tokens; below, q's heads are spread over more programs so
a few-token step (SDAR's block of 4) is not a handful of programs each looping over 32 heads.
Duplicate slots in one call are undefined (last writer wins in either path).
"""
from __future__ import annotations

import torch

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
QKNorm = tuple  # (q norm weight [D], k norm weight [D], eps): per-head RMSNorm before the RoPE
# Launch options of every kernel that rotates in the activation dtype's math: no FMA contraction,
# so each product is rounded on its own as torch's elementwise kernels round it (contracted, ~20 %
# of bf16 rotated values came out one ulp off torch's on an H100: findings/moe.md, LLaDA2).
EXACT_ROUNDING = {"enable_fp_fusion": False}

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def rotated(src, stride_src_h, n_heads, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_HALF: tl.constexpr, ROTATE: tl.constexpr, FP32_MATH: tl.constexpr,
                w_ptr=None, eps=0.0, NORM: tl.constexpr = False, ROT: tl.constexpr = 0):
        """A row's heads as their two ``[BLOCK_H, BLOCK_HALF]`` halves in the activation dtype,
        RMS-normed per head first (``NORM``: weight ``w_ptr [D]``, ``rmsnorm``'s arithmetic),
        rotated (``ROTATE``) or as read; masked lanes are 0. Also ``rope_cache_fp8``'s.
        ``ROT`` > 0 (partial rotary, ``2 ROT <= HALF``): only the first ``2 ROT`` values of a
        head rotate, column i with its partner ``i +- ROT`` (read again, normed alike) and the
        angle of ``angles``' column i; the rest pass through."""
        offs_h = tl.arange(0, BLOCK_H)
        offs_i = tl.arange(0, BLOCK_HALF)
        mask = (offs_h[:, None] < n_heads) & (offs_i[None, :] < HALF)
        src_1 = src + offs_h[:, None] * stride_src_h + offs_i[None, :]
        x1 = tl.load(src_1, mask=mask, other=0.0)
        x2 = tl.load(src_1 + HALF, mask=mask, other=0.0)
        if NORM:          # as kernels/rmsnorm: fp32 mean square, cast before the weight
            dt = x1.dtype
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
            var = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF)
            r = tl.rsqrt(var + eps)[:, None]
            w1 = tl.load(w_ptr + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + offs_i, mask=offs_i < HALF,
                         other=0.0).to(tl.float32)[None, :]
            x1 = (w1 * (a1 * r).to(dt).to(tl.float32)).to(dt)
            x2 = (w2 * (a2 * r).to(dt).to(tl.float32)).to(dt)
        if ROTATE and ROT > 0:
            dt = x1.dtype
            part = tl.where(offs_i < ROT, offs_i + ROT, offs_i - ROT)          # the partner
            rot_mask = mask & (offs_i[None, :] < 2 * ROT)
            p = tl.load(src + offs_h[:, None] * stride_src_h + part[None, :], mask=rot_mask,
                        other=0.0)
            if NORM:
                wp = tl.load(w_ptr + part, mask=offs_i < 2 * ROT, other=0.0)
                p = (wp.to(tl.float32)[None, :] * (p.to(tl.float32) * r).to(dt).to(tl.float32)
                     ).to(dt)
            pf = p.to(tl.float32)                # (negated in fp32: exact, as in any dtype)
            pf = tl.where(offs_i[None, :] < ROT, -pf, pf)      # rotate-half's (-x2, x1)
            if FP32_MATH:
                y = (x1.to(tl.float32) * c[None, :] + pf * s[None, :]).to(dt)
            else:
                cr = c.to(dt).to(tl.float32)[None, :]
                sr = s.to(dt).to(tl.float32)[None, :]
                y = ((x1.to(tl.float32) * cr).to(dt).to(tl.float32)
                     + (pf * sr).to(dt).to(tl.float32)).to(dt)
            y1 = tl.where(offs_i[None, :] < 2 * ROT, y, x1)
            y2 = x2
        elif ROTATE:
            dt = x1.dtype
            if FP32_MATH:
                a1 = x1.to(tl.float32)
                a2 = x2.to(tl.float32)
                y1 = (a1 * c[None, :] - a2 * s[None, :]).to(dt)
                y2 = (a2 * c[None, :] + a1 * s[None, :]).to(dt)
            else:
                # every op rounded to the activation dtype, as torch's bf16 elementwise math
                cr = c.to(dt).to(tl.float32)[None, :]
                sr = s.to(dt).to(tl.float32)[None, :]
                a1 = x1.to(tl.float32)
                a2 = x2.to(tl.float32)
                y1 = ((a1 * cr).to(dt).to(tl.float32) - (a2 * sr).to(dt).to(tl.float32)).to(dt)
                y2 = ((a2 * cr).to(dt).to(tl.float32) + (a1 * sr).to(dt).to(tl.float32)).to(dt)
        else:
            y1 = x1
            y2 = x2
        return y1, y2

    @triton.jit
    def _rotate_store(src, dst, stride_src_h, stride_dst_h, n_heads, c, s,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                      ROTATE: tl.constexpr, FP32_MATH: tl.constexpr, w_ptr=None, eps=0.0,
                      NORM: tl.constexpr = False, ROT: tl.constexpr = 0):
        y1, y2 = rotated(src, stride_src_h, n_heads, c, s, HALF, BLOCK_H, BLOCK_HALF, ROTATE,
                         FP32_MATH, w_ptr, eps, NORM, ROT)
        offs_h = tl.arange(0, BLOCK_H)
        offs_i = tl.arange(0, BLOCK_HALF)
        mask = (offs_h[:, None] < n_heads) & (offs_i[None, :] < HALF)
        dst_1 = dst + offs_h[:, None] * stride_dst_h + offs_i[None, :]
        tl.store(dst_1, y1.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst_1 + HALF, y2.to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def angles(pos_ptr, inv_freq_ptr, t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               ROT: tl.constexpr = 0):
        """cos / sin ``[BLOCK_HALF]`` of row ``t``'s angles ``position * inv_freq`` (fp32);
        ``ROT`` > 0 (partial rotary, ``inv_freq [ROT]``): column i's is ``inv_freq[i % ROT]``
        for the ``2 ROT`` rotating columns."""
        offs_i = tl.arange(0, BLOCK_HALF)
        if ROT > 0:
            inv = tl.load(inv_freq_ptr + offs_i % ROT, mask=offs_i < 2 * ROT, other=0.0)
        else:
            inv = tl.load(inv_freq_ptr + offs_i, mask=offs_i < HALF, other=0.0)
        ang = tl.load(pos_ptr + t).to(tl.float32) * inv                      # [D/2]
        return tl.cos(ang), tl.sin(ang)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, inv_freq_ptr, qo_ptr, kc_ptr,
                           vc_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                           stride_vh, stride_qot, stride_qoh, stride_kcp, stride_kcs,
                           stride_kch, stride_vcp, stride_vcs, stride_vch, H, HKV, qn_ptr,
                           kn_ptr, eps, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_HKV: tl.constexpr, FP32_MATH: tl.constexpr,
                           NORM: tl.constexpr, Q_SPLIT: tl.constexpr, PDL: tl.constexpr,
                           ROT: tl.constexpr = 0):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)                  # < Q_SPLIT: a share of q's heads; else k and v
        c, s = angles(pos_ptr, inv_freq_ptr, t, HALF, BLOCK_HALF, ROT)
        if j < Q_SPLIT:
            h0 = j * (BLOCK_H // Q_SPLIT)
            _rotate_store(q_ptr + t * stride_qt + h0 * stride_qh,
                          qo_ptr + t * stride_qot + h0 * stride_qoh, stride_qh, stride_qoh,
                          H - h0, c, s, HALF, BLOCK_H // Q_SPLIT, BLOCK_HALF, True, FP32_MATH,
                          qn_ptr, eps, NORM, ROT)
            return
        slot = tl.load(slot_ptr + t).to(tl.int64)
        valid = slot >= 0
        n_kv = tl.where(valid, HKV, 0)                  # a padding row (slot < 0) stores nothing
        slot = tl.where(valid, slot, 0)
        page = slot // PAGE_SIZE
        off = slot % PAGE_SIZE
        _rotate_store(k_ptr + t * stride_kt, kc_ptr + page * stride_kcp + off * stride_kcs,
                      stride_kh, stride_kch, n_kv, c, s, HALF, BLOCK_HKV, BLOCK_HALF, True,
                      FP32_MATH, kn_ptr, eps, NORM, ROT)
        _rotate_store(v_ptr + t * stride_vt, vc_ptr + page * stride_vcp + off * stride_vcs,
                      stride_vh, stride_vch, n_kv, c, s, HALF, BLOCK_HKV, BLOCK_HALF, False,
                      FP32_MATH, kn_ptr, eps, False)


def inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[D/2] fp32 ``1 / theta^(2i/D)``, the same expression as ``layers.rotary.Rotary``."""
    return (1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            ).to(device)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) D] -> zero-copy views q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]."""
    T = qkv.shape[0]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    check(qkv.dim() == 2 and qkv.shape[1] == (H + 2 * Hkv) * D,
          f"split_qkv: qkv must be [T, {(H + 2 * Hkv) * D}] for H={H} Hkv={Hkv} D={D}, got "
          f"{tuple(qkv.shape)}")
    q = qkv[:, :H * D].view(T, H, D)                           # [T, H, D]
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)            # [T, Hkv, D]
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)                 # [T, Hkv, D]
    return q, k, v


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, apply_in_fp32: bool
          ) -> torch.Tensor:
    # x [T, heads, D]; cos/sin [T, 1, D] fp32
    x1, x2 = x.chunk(2, dim=-1)
    if apply_in_fp32:
        xf = x.float()
        rot = torch.cat((-x2, x1), dim=-1).float()
        return (xf * cos + rot * sin).to(x.dtype)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


def rope_cache_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, inv_freq: torch.Tensor,
                         apply_in_fp32: bool = True, qk_norm: QKNorm | None = None,
                         rotary_dim: int | None = None) -> torch.Tensor:
    """PyTorch reference: same contract as ``rope_cache_triton`` (writes the caches in place)."""
    if qk_norm is not None:                    # per head, ``layers.norm.RMSNorm``'s arithmetic
        from flash_dllm.kernels.rmsnorm import rmsnorm_reference
        q = rmsnorm_reference(q, qk_norm[0], qk_norm[2])[0]
        k = rmsnorm_reference(k, qk_norm[1], qk_norm[2])[0]
    R = q.shape[-1] if rotary_dim is None else rotary_dim
    freqs = positions.float()[:, None] * inv_freq.float()       # [T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]          # [T, 1, R]
    cos, sin = emb.cos(), emb.sin()
    q_rot = torch.cat([_rope(q[..., :R], cos, sin, apply_in_fp32), q[..., R:]], dim=-1)
    k_rot = torch.cat([_rope(k[..., :R], cos, sin, apply_in_fp32), k[..., R:]], dim=-1)
    page_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // page_size, slots % page_size] = k_rot[keep].to(k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = v[keep].to(v_cache.dtype)
    return q_rot.contiguous()


def rope_cache_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      inv_freq: torch.Tensor, apply_in_fp32: bool = True,
                      qk_norm: QKNorm | None = None, rotary_dim: int | None = None
                      ) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D], positions/slot_mapping [T] int, k/v_cache
    [num_pages, page_size, Hkv, D], inv_freq [R/2] fp32 -> rotated q [T, H, D] (caches written).
    ``qk_norm`` (q weight [D], k weight [D], eps): q and k RMS-normed per head first;
    ``rotary_dim`` R (None: D): only the first R values of a head rotate (``takes_rotary``)."""
    check(HAS_TRITON, "rope_cache_triton: triton is not importable")
    check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
          f"rope_cache: q/k/v must be [T, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
          f"{tuple(v.shape)}")
    T, H, D = q.shape
    Hkv = k.shape[1]
    check(k.shape == (T, Hkv, D) and v.shape == (T, Hkv, D),
          f"rope_cache: k and v must both be [{T}, Hkv, {D}], got {tuple(k.shape)} and "
          f"{tuple(v.shape)}")
    check(D % 2 == 0, f"rope_cache: head_dim must be even, got {D}")
    R = D if rotary_dim is None else rotary_dim
    check(takes_rotary(R, D), f"rope_cache: rotary_dim must be head_dim ({D}) or even and at "
                              f"most head_dim / 2, got {R}")
    check(k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, D) and v_cache.shape == k_cache.shape,
          f"rope_cache: caches must be [num_pages, page_size, {Hkv}, {D}], got "
          f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dtype(f"rope_cache: {name}", t, FLOAT_DTYPES)
        check(t.dtype == q.dtype, f"rope_cache: {name} dtype {t.dtype} != q dtype {q.dtype}")
        check(t.stride(2) == 1, f"rope_cache: {name}'s head_dim must be contiguous, strides "
                                f"{t.stride()}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check(t.dtype == q.dtype, f"rope_cache: {name} dtype {t.dtype} != activations {q.dtype}")
        check(t.stride(3) == 1, f"rope_cache: {name}'s head_dim must be contiguous, strides "
                                f"{t.stride()}")
    check(positions.shape == (T,) and slot_mapping.shape == (T,),
          f"rope_cache: positions and slot_mapping must be [{T}], got {tuple(positions.shape)} "
          f"and {tuple(slot_mapping.shape)}")
    check_dtype("rope_cache: positions", positions, INT_DTYPES)
    check_dtype("rope_cache: slot_mapping", slot_mapping, INT_DTYPES)
    check(inv_freq.shape == (R // 2,) and inv_freq.dtype == torch.float32
          and inv_freq.is_contiguous(),
          f"rope_cache: inv_freq must be contiguous fp32 [{R // 2}], got {inv_freq.dtype} "
          f"{tuple(inv_freq.shape)}")
    check_device("rope_cache", INTERPRET, q, k, v, positions, k_cache, v_cache, slot_mapping,
                 inv_freq)
    if qk_norm is not None:
        for name, w in (("q", qk_norm[0]), ("k", qk_norm[1])):
            check(w.shape == (D,) and w.dtype == q.dtype and w.is_contiguous()
                  and w.device == q.device, f"rope_cache: the {name} norm weight must be a "
                  f"contiguous [{D}] {q.dtype} on {q.device}, got {w.dtype} {tuple(w.shape)}")
    q_out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    q_split = q_programs(T, H)
    _rope_cache_kernel[(T, q_split + 1)](
        q, k, v, positions, slot_mapping, inv_freq, q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), H, Hkv,
        qk_norm[0] if qk_norm else q, qk_norm[1] if qk_norm else q,
        float(qk_norm[2]) if qk_norm else 0.0,
        PAGE_SIZE=k_cache.shape[1], HALF=D // 2, BLOCK_HALF=next_pow2(D // 2),
        BLOCK_H=next_pow2(H), BLOCK_HKV=next_pow2(Hkv), FP32_MATH=bool(apply_in_fp32),
        NORM=qk_norm is not None, Q_SPLIT=q_split, ROT=0 if R == D else R // 2, num_warps=4,
        **EXACT_ROUNDING, **pdl_args(q))
    return q_out


def takes_rotary(rotary_dim: int, head_dim: int) -> bool:
    """Whether the kernel rotates ``rotary_dim`` of ``head_dim`` values: all of them, or an even
    number up to half of them (each pair then lies in the head's first half; LLaDA2's 0.5)."""
    return rotary_dim == head_dim or (rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim // 2)


def q_programs(T: int, H: int, target: int = 64) -> int:
    """Programs per token for q's heads: a power of 2 with ``T * it`` near ``target`` (1 from
    ``target`` tokens), at most half of ``next_pow2(H)`` (each program two heads or more)."""
    n = 1
    while T * n < target and n * 4 <= next_pow2(H):
        n *= 2
    return n


def op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
       inv_freq: torch.Tensor, apply_in_fp32: bool = True, qk_norm: QKNorm | None = None,
       rotary_dim: int | None = None) -> torch.Tensor:
    """Rotated q [T, H, D]; k (rotated) and v land in their cache slots. Triton on CUDA.
    ``qk_norm``: q and k RMS-normed per head before the rotation (SDAR, LLaDA-MoE, LLaDA2);
    ``rotary_dim``: only the first ``rotary_dim`` values of a head rotate (LLaDA2)."""
    if use_triton(q, k, v, k_cache):
        return rope_cache_triton(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq,
                                 apply_in_fp32, qk_norm, rotary_dim)
    return rope_cache_reference(q, k, v, positions, k_cache, v_cache, slot_mapping, inv_freq,
                                apply_in_fp32, qk_norm, rotary_dim)
