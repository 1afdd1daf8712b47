"""FP8 (e4m3) KV pages: the quantised write of K or V rows into their page slots, and the read.

A pool built with ``kv_cache_dtype="fp8"`` (``cache/paged.py``) stores every K/V value as one e4m3
byte and, beside it, one fp32 scale per (page, layer, K/V, kv head): ``scales [layers, 2, pages,
kv_heads]``; a value reads back as ``code * scale``. This op takes one layer's K (or V) half:
``cache [pages, page_size, Hkv, D]`` fp8, ``scale [pages, Hkv]`` fp32, ``slots [T]`` (``page *
page_size + offset``, all >= 0) and the rows ``x [T, Hkv, D]``.

How a page's scale is set (pages are written many times: a dLLM rewrites positions of its canvas
at every step, a few rows of a page at a time):

- a page's scale only grows while its request holds it: a write sets ``scale = max(scale,
  amax(rows) / 448)`` per (page, head), so no value already in the page can overflow;
- when a write grows a page's scale, the page's other entries are **requantised** to the new
  scale (``code * old / new``, rounded to nearest e4m3), then the rows are written: every entry
  of a page always reads back with the page's current scale (one extra rounding per growth,
  bounded by half an e4m3 ulp of the entry each time);
- a scale of 0 means "nothing valid in this page": the runner zeroes the scales of a request's
  fresh pages at admission (``reset_scales``; reused prefix pages keep theirs), and the first write
  zeroes the rest of the page (``old / new = 0``; its bytes were whatever the last owner left,
  NaN codes included), so a page with scale > 0 holds only finite values;
- rows of all-zero values give scale 0 -> ``x / 1`` = 0 codes (never a division by 0).

Error: an entry written with scale ``s`` is off by at most half an e4m3 ulp (2^-4 relative for
normals, ``s * 2^-10`` absolute below the normal range ``s * 2^-6``), and by that again for each
later growth of its page's scale (requantising). Values near a page's head-wise maximum keep ~3
mantissa bits; much smaller values lose relative precision (a per-page scale, not per token).

The reference (PyTorch; the engine's CPU path) syncs with the host to find the pages whose scale
grew. The GPU path (``write``, CUDA) is graph-safe: fixed-shape torch ops (gather, an ``amax``
scatter, ``index_copy_``) plus one Triton launch that requantises the grown pages, each by the
first of the step's rows that lands in it (no host sync, no data-dependent shapes).
"""
from __future__ import annotations

import torch

from flash_dllm.kernels._triton import HAS_TRITON, check, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels.kv_pages_kernels import _fp8_bits, _round_fp32

    @triton.jit
    def _requant_kernel(cache_ptr, page_ptr, leader_ptr, old_ptr, new_ptr, stride_p, stride_s,
                        Hkv, D, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
        # program (t, h): row t's page, head h, when row t is the page's first row of this write
        # and the page's scale grew: every entry * old / new (0 when old is 0: never written)
        t = tl.program_id(0)
        h = tl.program_id(1)
        if tl.load(leader_ptr + t) == 0:
            return
        old = tl.load(old_ptr + t * Hkv + h)
        new = tl.load(new_ptr + t * Hkv + h)
        if old == new:
            return
        page = tl.load(page_ptr + t).to(tl.int64)
        offs_s = tl.arange(0, PAGE_SIZE)
        offs_d = tl.arange(0, BLOCK_D)
        mask = offs_d[None, :] < D
        ptrs = cache_ptr + page * stride_p + offs_s[:, None] * stride_s + h * D + offs_d[None, :]
        code = tl.load(ptrs, mask=mask, other=0)
        x = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        ratio = tl.where(new > 0, tl.math.div_rn(old, tl.where(new > 0, new, 1.0)), 0.0)
        y = tl.where(old > 0, x * ratio, 0.0)
        # rounded to nearest-even e4m3 in fp32 arithmetic (exact under the interpreter too,
        # whose own narrowing cast does not round so): see ``kernels/kv_pages``
        tl.store(ptrs, _fp8_bits(_round_fp32(y, 20, 16384.0, 0.015625)), mask=mask)


def _check(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor
           ) -> tuple[int, int, int, int]:
    check(cache.dim() == 4 and cache.dtype == FP8,
          f"kv_quant: cache must be [pages, page_size, Hkv, D] float8_e4m3fn, got "
          f"{tuple(cache.shape)} {cache.dtype}")
    P, ps, Hkv, D = cache.shape
    check(scale.shape == (P, Hkv) and scale.dtype == torch.float32,
          f"kv_quant: scale must be [{P}, {Hkv}] float32, got {tuple(scale.shape)} {scale.dtype}")
    check(x.dim() == 3 and x.shape[1:] == (Hkv, D) and slots.shape == (x.shape[0],),
          f"kv_quant: rows must be [T, {Hkv}, {D}] with slots [T], got {tuple(x.shape)} and "
          f"{tuple(slots.shape)}")
    return P, ps, Hkv, D


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors are indexed (gather, scatter, ``index_copy_``) as their uint8 bits: not every
    back end implements those ops for float8 (the CPU has no ``index_copy_``)."""
    return t.view(torch.uint8)


def gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``cache[pages]`` of an fp8 cache (a copy)."""
    return _bytes(cache)[pages].view(FP8)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` with ``scale [...]`` (fp32, >= 0) -> e4m3 codes ``x / scale`` (0 where the
    scale is 0), clamped to +-448."""
    s = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 ``codes [..., Hkv, D]`` read with ``scale`` broadcast over ``[..., Hkv]`` -> ``dtype``."""
    return (codes.float() * scale[..., None]).to(dtype)


def read_pages(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Pages ``pages [..., n]`` of ``cache [P, page_size, Hkv, D]`` as ``dtype`` values
    ``[..., n, page_size, Hkv, D]`` (a copy): dequantised when ``scale`` is given (fp8 pool)."""
    if scale is None:
        return cache[pages]
    return dequantize(gather(cache, pages), scale[pages][..., None, :], dtype)


def write_reference(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                    x: torch.Tensor) -> None:
    """Rows ``x [T, Hkv, D]`` into ``cache`` at ``slots``, growing and requantising pages as the
    module docstring says (host syncs: the CPU path)."""
    P, ps, Hkv, D = _check(cache, scale, slots, x)
    if x.shape[0] == 0:
        return
    slots = slots.long()
    page = slots // ps
    pages = torch.unique(page)                                       # [n] (host sync)
    old = scale[pages].clone()                                       # [n, Hkv]
    amax = x.detach().abs().amax(-1).float()                          # [T, Hkv]
    scale.scatter_reduce_(0, page[:, None].expand(-1, Hkv), amax / FP8_MAX, "amax")
    new = scale[pages]
    grown = (new > old).any(-1)
    if bool(grown.any()):
        g, o, n = pages[grown], old[grown], new[grown]
        ratio = torch.where(n > 0, o / torch.where(n > 0, n, torch.ones_like(n)),
                            torch.zeros_like(n))                     # [g, Hkv]
        vals = gather(cache, g).float() * ratio[:, None, :, None]    # [g, ps, Hkv, D]
        vals = torch.where((o > 0)[:, None, :, None], vals, torch.zeros_like(vals))
        _bytes(cache).index_copy_(0, g, _bytes(vals.to(FP8)))
    _bytes(cache).view(-1, Hkv, D).index_copy_(0, slots, _bytes(quantize(x, scale[page])))


def write_graph_safe(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                     x: torch.Tensor) -> None:
    """The same write with no host sync and static shapes (CUDA: the requantising is one Triton
    launch over (rows, heads) in which only each grown page's first row of the write works)."""
    P, ps, Hkv, D = _check(cache, scale, slots, x)
    T = x.shape[0]
    if T == 0:
        return
    slots = slots.long()
    page = slots // ps                                                # [T]
    old = scale[page]                                                 # [T, Hkv] (a copy)
    amax = x.detach().abs().amax(-1).float()
    scale.scatter_reduce_(0, page[:, None].expand(-1, Hkv), amax / FP8_MAX, "amax")
    new = scale[page]
    rows = torch.arange(T, device=x.device)
    first = torch.full((P,), T, dtype=torch.long, device=x.device)
    first.scatter_reduce_(0, page, rows, "amin")
    leader = (first[page] == rows).to(torch.int32)                   # [T]
    _requant_kernel[(T, Hkv)](cache.view(torch.uint8), page, leader, old.contiguous(),
                              new.contiguous(), cache.stride(0), cache.stride(1), Hkv, D,
                              PAGE_SIZE=ps, BLOCK_D=triton.next_power_of_2(D))
    _bytes(cache).view(-1, Hkv, D).index_copy_(0, slots, _bytes(quantize(x, scale[page])))


def write(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor
          ) -> None:
    """Quantised write of ``x [T, Hkv, D]`` at ``slots`` (see the module docstring)."""
    if use_triton(cache, scale, slots, x):
        check(cache.shape[1] & (cache.shape[1] - 1) == 0,
              f"kv_quant: the page size must be a power of two, got {cache.shape[1]}")
        write_graph_safe(cache, scale, slots, x)
    else:
        write_reference(cache, scale, slots, x)


# ---- fp8 pages leaving the pool (tiers): codes and scales travel together, bit-exact ---------
def pack_pages(kv: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
    """fp8 pool ``kv [layers, 2, P, page_size, Hkv, D]`` (scales ``[layers, 2, P, Hkv]``):
    pages ``page_ids [n]`` into ``out [n, layers, 2, page_size, Hkv, D]`` fp8 (may be strided
    over its first three dims) as their exact codes; returns their scales ``[n, layers, 2,
    Hkv]`` fp32 (contiguous). No requantisation: a page comes back exactly as it left."""
    check(kv.dtype == FP8 and kv.dim() == 6 and scales.shape == (*kv.shape[:3], kv.shape[4]),
          f"kv_quant.pack_pages: an fp8 pool [layers, 2, P, S, Hkv, D] and its scales "
          f"[layers, 2, P, Hkv], got {tuple(kv.shape)} {kv.dtype} and {tuple(scales.shape)}")
    ids = page_ids.long()
    _bytes(out).copy_(_bytes(kv)[:, :, ids].permute(2, 0, 1, 3, 4, 5))
    return scales[:, :, ids].permute(2, 0, 1, 3).contiguous()


def unpack_pages(buf: torch.Tensor, buf_scales: torch.Tensor, page_ids: torch.Tensor,
                 kv: torch.Tensor, scales: torch.Tensor) -> None:
    """The inverse of ``pack_pages``: records ``buf`` / ``buf_scales`` into pool pages
    ``page_ids``; an id outside [0, P) (a record that failed its checks) is written nowhere
    (selecting the valid ones is a host sync)."""
    ids = page_ids.long()
    ok = (ids >= 0) & (ids < kv.shape[2])
    if not bool(ok.all()):
        ids, buf, buf_scales = ids[ok], buf[ok], buf_scales[ok]
    _bytes(kv)[:, :, ids] = _bytes(buf).permute(1, 2, 0, 3, 4, 5)
    scales[:, :, ids] = buf_scales.permute(1, 2, 0, 3)
