"""Pack / unpack KV pages between the layer-major pool and a page-first buffer (tiers, transfer).

The pool (``cache.paged``) is ``kv [layers, 2, pages, page_size, kv_heads, head_dim]``, so one page
is ``2 * layers`` fragments of ``page_size * kv_heads * head_dim`` contiguous values (LLaDA-8B:
64 x 128 KiB in bf16; Dream-7B: 56 x 16 KiB). Whenever pages leave the GPU they travel
**page-first**, ``buf [n, layers, 2, page_size, kv_heads, head_dim]`` (FlowKV's ``(blocks, layers,
2, hidden)``): one contiguous span per group of pages, so a tier or a transport moves them with
one copy instead of one per fragment (tens of thousands of 16-128 KiB copies per 10K-token
prompt: launch-bound, what made other engines' offload 4-10x slower than the bytes need).

- ``pack_pages(kv, page_ids, out, out_dtype, layers) -> (buf, scales)`` gathers pages
  ``page_ids`` (any order, may repeat) into ``buf``; ``unpack_pages(buf, page_ids, kv, scales,
  layers)`` scatters them back (duplicate ids in one unpack: last writer wins, undefined which).
- ``layers=(l0, l1)`` moves a layer group only (``buf [n, l1 - l0, 2, ...]``), so prefill can send
  early layers while later ones still compute.
- ``out_dtype`` = the pool dtype: a bit-exact copy. ``float8_e4m3fn`` / ``int8``: symmetric
  quantisation with one fp32 scale per (page, layer, k/v, kv head), ``scales [n, layers, 2,
  kv_heads]``: ``amax`` over that head's ``page_size x head_dim`` values, ``scale = amax / QMAX``
  (448 for e4m3, 127 for int8; 1 when ``amax`` is 0), ``q = round(clamp(x / scale, -QMAX, QMAX))``
  with round-to-nearest, **ties to even** (torch's ``.round()`` and fp8 cast). Unpack writes
  ``q * scale`` rounded (to nearest even) to the pool dtype. ``scale`` is ``amax / QMAX`` correctly
  rounded (a true fp32 division, on every device: see ``pack_pages_reference``).
- Non-finite values (kernel == reference): ``amax`` propagates NaN, and ``amax > 0`` is false for
  NaN, so a head holding a NaN gets scale 1: its NaNs stay NaN (fp8 NaN; int8 has none, so code 0)
  and its other values are quantised with scale 1 (clamped to +-QMAX). A head holding +-inf (and
  no NaN) gets scale inf: finite values quantise to +-0 and the infinities to NaN, so the whole
  head unpacks as NaN (0 * inf). The sign bit of a NaN code is unspecified.

NOTE: exact agreement with the reference, on the GPU and under the interpreter:
- ``x / scale`` uses ``tl.math.div_rn`` (Triton's ``/`` on fp32 is the approximate ``div.full``);
- narrowing casts (fp32 -> fp8 / bf16 / fp16) are done by ``_round_fp32`` in integer/fp32
  arithmetic that both back ends execute identically; the final cast then only drops zero bits
  (the interpreter's own narrowing casts do not round to nearest-even);
- the plain copy moves the raw bits (the pool viewed as an integer dtype).

Grid (bandwidth): the copy runs one program per (fragment, ``BLOCK`` chunk) with the chunk
fastest, so neighbouring programs stream one fragment; each moves ``BLOCK`` contiguous elements
(16 KiB by default, 16-byte vector accesses) with int64 offsets (a LLaDA-8B pool passes 2^31
elements at 512 pages). Quantising needs a reduction per head, whose ``page_size x head_dim``
values are strided by ``kv_heads * head_dim`` between tokens: one program per (page, layer, k/v,
group of ``BLOCK_H`` heads) streams ``[BLOCK_S, BLOCK_H, head_dim]`` tiles of its page twice:
amax per head, then the scaled values (the second read hits L1/L2). Dequantising is the chunked
copy over ``[BLOCK_R, head_dim]`` row tiles, each row (one token's head) scaled by its head's
scale. fp8 codes are written and read as uint8 bits (``_fp8_bits`` / ``_fp8_value``), so NaN
codes are exactly torch's on every back end (the interpreter's fp8 casts have no NaN).

Layouts: the pool may be any view whose pages are contiguous ``[page_size, kv_heads, head_dim]``;
``out`` (pack) and ``buf`` (unpack) may be strided over their (page, layer, k/v) dims, e.g. the
payload columns of a batch of page records (``cache/io/kv_offload``) or a view of a larger staging
buffer; scales are contiguous. The kernel runs when every tensor is on the GPU; an ``out``
in host memory takes the reference path (a gather, then a copy): tiers should pack into a device
staging buffer and copy that to pinned memory in one ``copy_``.

Page ids out of range: raising on them would be a host sync, so the kernels mask them instead
(each program compares its id with the pool's page count P): an id outside [0, P) is never read
or written (pack writes that record as zeros with scale 1; unpack writes it nowhere), and, when the
caller passes ``bad`` (an int32 [1] device counter), is counted into it once per occurrence, to
be checked later off the hot path. The reference raises ValueError on them, or mirrors the
kernels when ``bad`` is given.

NOTE (size): one file over ~400 lines because pack and unpack are one op pair sharing the layout
checks, the quantisation math (fp8 / int8 with their exact roundings) and the references that
the Triton kernels are tested against; the ``@triton.jit`` functions themselves live in
``kernels/kv_pages_kernels.py``.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels._triton import (FLOAT_DTYPES, HAS_TRITON, INT_DTYPES, check, check_device,
                                        check_dtype, describe, interpreting, next_pow2, use_triton)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported

FP8 = torch.float8_e4m3fn
QUANT_DTYPES = (FP8, torch.int8)
QMAX = {FP8: 448.0, torch.int8: 127.0}
# (mantissa bits, exponent of the smallest normal) of each narrow float: see _round_fp32
_NARROW = {FP8: (3, -6), torch.bfloat16: (7, -126), torch.float16: (10, -14)}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COPY_BYTES = 16384        # bytes per copy program
_TILE = 4096               # values per quantising program

if HAS_TRITON:
    from flash_dllm.kernels.kv_pages_kernels import _copy_kernel, _dequant_kernel, _quant_kernel


# ---- layouts -----------------------------------------------------------------------------------
def _layer_range(fn: str, layers: tuple[int, int] | None, num_layers: int) -> tuple[int, int]:
    if layers is None:
        return 0, num_layers
    check(len(layers) == 2 and 0 <= layers[0] < layers[1] <= num_layers,
          f"{fn}: layers must be a range (l0, l1) with 0 <= l0 < l1 <= {num_layers}, got "
          f"{layers}")
    return int(layers[0]), int(layers[1])


def _pages_contiguous(t: torch.Tensor) -> bool:
    """Is every [page_size, kv_heads, head_dim] fragment (the last three dims) contiguous?"""
    S, H, D = t.shape[-3:]
    return all(size == 1 or stride == want for size, stride, want
               in zip((S, H, D), t.stride()[-3:], (H * D, D, 1)))


def _check_pool(fn: str, kv: torch.Tensor) -> None:
    check(kv.dim() == 6 and kv.shape[1] == 2,
          f"{fn}: kv must be [layers, 2, pages, page_size, kv_heads, head_dim], got "
          f"{tuple(kv.shape)}")
    check_dtype(f"{fn}: kv", kv, FLOAT_DTYPES)
    check(_pages_contiguous(kv), f"{fn}: kv's pages must be contiguous [page_size, kv_heads, "
                                 f"head_dim], strides {kv.stride()}")


def _check_ids(fn: str, page_ids: torch.Tensor) -> None:
    check(page_ids.dim() == 1, f"{fn}: page_ids must be [n], got {tuple(page_ids.shape)}")
    check_dtype(f"{fn}: page_ids", page_ids, INT_DTYPES)


def _check_ids_in_range(fn: str, page_ids: torch.Tensor, num_pages: int) -> None:
    if page_ids.numel():                                     # a host sync: reference path only
        lo, hi = int(page_ids.min()), int(page_ids.max())
        check(0 <= lo and hi < num_pages,
              f"{fn}: page_ids must lie in [0, {num_pages}), got [{lo}, {hi}]")


def packed_shape(layout_or_shape, n: int, layers: tuple[int, int] | None = None
                 ) -> tuple[int, ...]:
    """``[n, l1 - l0, 2, page_size, kv_heads, head_dim]`` for a pool layout (``PagedKVLayout``,
    a pool tensor or its 6-d shape)."""
    shape = tuple(getattr(layout_or_shape, "shape", layout_or_shape))
    check(len(shape) == 6 and shape[1] == 2,
          f"packed_shape: layout_or_shape must be [layers, 2, pages, page_size, kv_heads, "
          f"head_dim], got {shape}")
    l0, l1 = _layer_range("packed_shape", layers, shape[0])
    return (int(n), l1 - l0, 2, *shape[3:])


def packed_bytes(layout_or_shape, n: int, dtype: torch.dtype | None = None,
                 layers: tuple[int, int] | None = None) -> int:
    """Bytes that travel for ``n`` pages packed as ``dtype`` (default: the layout's dtype): the
    values plus, for fp8/int8, the fp32 scales ``[n, l1 - l0, 2, kv_heads]``."""
    dtype = dtype if dtype is not None else getattr(layout_or_shape, "dtype", None)
    check(isinstance(dtype, torch.dtype), "packed_bytes: dtype is required with a plain shape")
    shape = packed_shape(layout_or_shape, n, layers)
    values = shape[0] * shape[1] * shape[2] * shape[3] * shape[4] * shape[5]
    out = values * torch.empty((), dtype=dtype).element_size()
    if dtype in QUANT_DTYPES:
        out += shape[0] * shape[1] * 2 * shape[4] * 4
    return out


def _check_pack(fn, kv, page_ids, out, out_dtype, layers, out_scales):
    _check_pool(fn, kv)
    _check_ids(fn, page_ids)
    l0, l1 = _layer_range(fn, layers, kv.shape[0])
    dtype = out_dtype if out_dtype is not None else (out.dtype if out is not None else kv.dtype)
    check(dtype == kv.dtype or dtype in QUANT_DTYPES,
          f"{fn}: {'out dtype' if out_dtype is None else 'out_dtype'} must be kv's dtype "
          f"{kv.dtype} or one of {QUANT_DTYPES}, got {dtype}")
    shape = packed_shape(kv, page_ids.shape[0], (l0, l1))
    if out is not None:
        check(out.dtype == dtype, f"{fn}: out dtype {out.dtype} != out_dtype {dtype}")
        check(tuple(out.shape) == shape, f"{fn}: out must be {list(shape)}, got "
                                         f"{tuple(out.shape)}")
        check(_pages_contiguous(out), f"{fn}: out's pages must be contiguous [page_size, "
                                      f"kv_heads, head_dim], strides {out.stride()}")
    if out_scales is not None:
        check(dtype in QUANT_DTYPES, f"{fn}: out_scales given for an unquantised {dtype} pack")
        want = (*shape[:3], shape[4])
        check(out_scales.dtype == torch.float32 and tuple(out_scales.shape) == want
              and out_scales.is_contiguous(),
              f"{fn}: out_scales must be contiguous fp32 {list(want)}, got {out_scales.dtype} "
              f"{tuple(out_scales.shape)} strides {out_scales.stride()}")
    return l0, l1, dtype, shape


def _check_unpack(fn, buf, page_ids, kv, scales, layers):
    _check_pool(fn, kv)
    _check_ids(fn, page_ids)
    l0, l1 = _layer_range(fn, layers, kv.shape[0])
    shape = packed_shape(kv, page_ids.shape[0], (l0, l1))
    check(buf.dim() == 6 and tuple(buf.shape) == shape,
          f"{fn}: buf must be {list(shape)}, got {tuple(buf.shape)}")
    check(_pages_contiguous(buf), f"{fn}: buf's pages must be contiguous [page_size, kv_heads, "
                                  f"head_dim], strides {buf.stride()}")
    if scales is None:
        check(buf.dtype == kv.dtype, f"{fn}: buf dtype {buf.dtype} != kv dtype {kv.dtype} "
                                     "(quantised pages need their scales)")
    else:
        check(buf.dtype in QUANT_DTYPES, f"{fn}: buf must be one of {QUANT_DTYPES} when scales "
                                         f"are given, got {buf.dtype}")
        want = (*shape[:3], shape[4])
        check(scales.dtype == torch.float32 and tuple(scales.shape) == want
              and scales.is_contiguous(),
              f"{fn}: scales must be contiguous fp32 {list(want)}, got {scales.dtype} "
              f"{tuple(scales.shape)} strides {scales.stride()}")
    return l0, l1


# ---- reference ---------------------------------------------------------------------------------
def pack_pages_reference(kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None,
                         layers: tuple[int, int] | None = None,
                         out_scales: torch.Tensor | None = None,
                         bad: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch reference: same contract as ``pack_pages`` (``out`` may be on another device)."""
    l0, l1, dtype, _ = _check_pack("pack_pages", kv, page_ids, out, out_dtype, layers,
                                   out_scales)
    _check_bad("pack_pages", bad)
    idx, ok = _ids_or_count_bad("pack_pages", page_ids, kv, bad)
    pages = kv[l0:l1].index_select(2, idx).permute(2, 0, 1, 3, 4, 5)  # [n, Lr, 2, S, Hkv, D]
    if ok is not None:                                   # bad ids: zeros (select: bits kept)
        pages = pages.masked_fill(~ok.view(-1, 1, 1, 1, 1, 1), 0)
    scales = None
    if dtype != kv.dtype:
        qmax = QMAX[dtype]
        x = pages.float()
        amax = x.abs().amax(dim=(3, 5))                                  # [n, Lr, 2, Hkv]
        # NOTE: divide by a tensor, not the Python scalar: on CUDA, torch computes `t / scalar`
        # as `t * fl32(1 / scalar)` (not correctly rounded: about 1 scale in 4 differs by an
        # ulp), while the CPU and the kernel's div_rn divide. A tensor divisor divides on both.
        scales = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
        y = (x / scales[:, :, :, None, :, None]).clamp(-qmax, qmax)
        if dtype == torch.int8:                          # no int8 NaN: a NaN's code is 0
            pages = torch.where(y.isnan(), 0.0, y.round()).to(dtype)
        else:
            pages = y.to(dtype)
        if out_scales is not None:
            scales = out_scales.copy_(scales)
    if out is None:
        return pages.contiguous(), scales
    return out.copy_(pages), scales


def unpack_pages_reference(buf: torch.Tensor, page_ids: torch.Tensor, kv: torch.Tensor,
                           scales: torch.Tensor | None = None,
                           layers: tuple[int, int] | None = None,
                           bad: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference: same contract as ``unpack_pages``."""
    l0, l1 = _check_unpack("unpack_pages", buf, page_ids, kv, scales, layers)
    _check_bad("unpack_pages", bad)
    idx, ok = _ids_or_count_bad("unpack_pages", page_ids, kv, bad)
    vals = buf.to(kv.device)
    if scales is not None:
        vals = (vals.float() * scales.to(kv.device)[:, :, :, None, :, None]).to(kv.dtype)
    if ok is not None:                                   # bad ids: written nowhere (a sync)
        idx, vals = idx[ok], vals[ok]
    kv[l0:l1, :, idx] = vals.permute(1, 2, 0, 3, 4, 5)              # [Lr, 2, n, S, Hkv, D]
    return kv


def _ids_or_count_bad(fn: str, page_ids: torch.Tensor, kv: torch.Tensor,
                      bad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (long ids on kv's device, in-range mask or None). Without ``bad``, ids out of range
    raise; with it they are counted into ``bad`` and mapped to page 0 (masked by the caller)."""
    idx = page_ids.to(device=kv.device, dtype=torch.long)
    if bad is None:
        _check_ids_in_range(fn, page_ids, kv.shape[2])
        return idx, None
    ok = (idx >= 0) & (idx < kv.shape[2])
    bad += (~ok).sum().to(device=bad.device, dtype=torch.int32)
    return torch.where(ok, idx, 0), ok


# ---- Triton ------------------------------------------------------------------------------------
def _round_args(dtype: torch.dtype) -> dict:
    """``_round_fp32``'s constants for a narrow float: MAGIC = 2^(EMIN - MANT + 23), TINY =
    2^EMIN (adding MAGIC to a value below TINY rounds it to a multiple of the subnormal step)."""
    if dtype not in _NARROW:
        return dict(DROP=1, MAGIC=1.0, TINY=1.0)
    mant, emin = _NARROW[dtype]
    return dict(DROP=23 - mant, MAGIC=float(2.0 ** (emin - mant + 23)), TINY=float(2.0 ** emin))


def _copy_grid(frag: int, itemsize: int, block: int | None, programs: int) -> tuple[int, int]:
    block = block if block is not None else min(next_pow2(frag), _COPY_BYTES // itemsize)
    check(block > 0 and block & (block - 1) == 0, f"kv_pages: block must be a power of 2, got "
                                                  f"{block}")
    chunks = -(-frag // block)
    check(programs * chunks < 2 ** 31, f"kv_pages: {programs * chunks} programs exceed the grid")
    return block, chunks


def _check_bad(fn: str, bad: torch.Tensor | None) -> None:
    if bad is not None:
        check(isinstance(bad, torch.Tensor) and bad.dtype == torch.int32 and bad.numel() == 1,
              f"{fn}: bad must be a one-element int32 tensor (a counter), got {describe(bad)}")


def _args(kv, buf, l0, page_ids, bad):
    """The kernels' shared arguments: ids (stride, number of pages, the ``bad`` counter or a
    stand-in pointer), layer range and the pool's / buffer's strides; then HAS_BAD."""
    return (page_ids.stride(0), kv.shape[2], bad if bad is not None else page_ids, l0,
            buf.shape[1], kv.stride(0), kv.stride(1), kv.stride(2), buf.stride(0), buf.stride(1),
            buf.stride(2)), bad is not None


def pack_pages_triton(kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None,
                      layers: tuple[int, int] | None = None,
                      out_scales: torch.Tensor | None = None, block: int | None = None,
                      bad: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """kv [L, 2, P, S, Hkv, D], page_ids [n] int -> (buf [n, Lr, 2, S, Hkv, D], scales
    [n, Lr, 2, Hkv] fp32 or None). ``block``: values per program (copy) or per tile (quantise).
    ``bad``: int32 [1] counter on the device, incremented once per id outside [0, P) (whose
    record is written as zeros, scale 1); no host sync."""
    check(HAS_TRITON, "pack_pages_triton: triton is not importable")
    l0, _, dtype, shape = _check_pack("pack_pages", kv, page_ids, out, out_dtype, layers,
                                      out_scales)
    _check_bad("pack_pages", bad)
    buf = out if out is not None else torch.empty(shape, dtype=dtype, device=kv.device)
    scales = None
    if dtype in QUANT_DTYPES:
        scales = out_scales if out_scales is not None else torch.empty(
            (*shape[:3], shape[4]), dtype=torch.float32, device=kv.device)
    check_device("pack_pages", INTERPRET, kv, page_ids, buf,
                 *(t for t in (scales, bad) if t is not None))
    n, Lr, _, S, H, D = shape
    if n == 0:
        return buf, scales
    args, has_bad = _args(kv, buf, l0, page_ids, bad)
    if scales is None:
        bits = _BITS[kv.element_size()]                    # raw bits: bit-exact for any value
        blk, chunks = _copy_grid(S * H * D, kv.element_size(), block, n * Lr * 2)
        _copy_kernel[(n * Lr * 2 * chunks,)](
            kv.view(bits), buf.view(bits), page_ids, *args, FRAG=S * H * D, BLOCK=blk,
            CHUNKS=chunks, PACK=True, HAS_BAD=has_bad,
            num_warps=4 if blk * kv.element_size() <= 8192 else 8)
        return buf, scales
    tile = block if block is not None else _TILE
    block_d = next_pow2(D)
    block_s = min(next_pow2(S), max(1, tile // block_d))
    block_h = min(next_pow2(H), max(1, tile // (block_s * block_d)))
    hgroups = -(-H // block_h)
    _quant_kernel[(n * Lr * 2 * hgroups,)](   # fp8 written as its codes: see _fp8_bits
        kv, buf.view(torch.uint8) if dtype == FP8 else buf, scales, page_ids, *args, S=S, H=H,
        D=D, BLOCK_S=block_s, BLOCK_H=block_h,
        BLOCK_D=block_d, HGROUPS=hgroups, QMAX=QMAX[dtype], INT8=dtype == torch.int8,
        HAS_BAD=has_bad, num_warps=4, **_round_args(dtype))
    return buf, scales


def unpack_pages_triton(buf: torch.Tensor, page_ids: torch.Tensor, kv: torch.Tensor,
                        scales: torch.Tensor | None = None,
                        layers: tuple[int, int] | None = None, block: int | None = None,
                        bad: torch.Tensor | None = None) -> torch.Tensor:
    """buf [n, Lr, 2, S, Hkv, D] (+ scales [n, Lr, 2, Hkv] fp32 when fp8/int8) -> pages
    ``page_ids`` of kv's layers ``layers`` (written in place; returns kv). ``bad``: int32 [1]
    counter on the device, incremented once per id outside [0, P) (whose record is not written
    anywhere); no host sync."""
    check(HAS_TRITON, "unpack_pages_triton: triton is not importable")
    l0, _ = _check_unpack("unpack_pages", buf, page_ids, kv, scales, layers)
    _check_bad("unpack_pages", bad)
    check_device("unpack_pages", INTERPRET, kv, page_ids, buf,
                 *(t for t in (scales, bad) if t is not None))
    n, Lr, _, S, H, D = buf.shape
    if n == 0:
        return kv
    args, has_bad = _args(kv, buf, l0, page_ids, bad)
    frag = S * H * D
    if scales is None:
        bits = _BITS[kv.element_size()]
        blk, chunks = _copy_grid(frag, kv.element_size(), block, n * Lr * 2)
        _copy_kernel[(n * Lr * 2 * chunks,)](
            kv.view(bits), buf.view(bits), page_ids, *args, FRAG=frag, BLOCK=blk, CHUNKS=chunks,
            PACK=False, HAS_BAD=has_bad, num_warps=4 if blk * kv.element_size() <= 8192 else 8)
        return kv
    block_d = next_pow2(D)                                  # one program: BLOCK_R rows of D
    per = (block if block is not None else _COPY_BYTES // kv.element_size()) // block_d
    block_r, chunks = _copy_grid(S * H, 1, min(next_pow2(S * H), next_pow2(max(1, per))),
                                 n * Lr * 2)
    fp8 = buf.dtype == FP8                                  # read as codes: see _fp8_value
    _dequant_kernel[(n * Lr * 2 * chunks,)](
        kv, buf.view(torch.uint8) if fp8 else buf, scales, page_ids, *args, H=H, D=D,
        ROWS=S * H, BLOCK_R=block_r, BLOCK_D=block_d, CHUNKS=chunks, FP8_BITS=fp8,
        ROUND=kv.dtype in _NARROW, HAS_BAD=has_bad,
        num_warps=4 if block_r * block_d * kv.element_size() <= 8192 else 8,
        **_round_args(kv.dtype))
    return kv


# ---- dispatch ----------------------------------------------------------------------------------
def pack_pages(kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, layers: tuple[int, int] | None = None,
               out_scales: torch.Tensor | None = None, bad: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pages ``page_ids`` of ``kv [L, 2, P, S, Hkv, D]`` (layers ``l0:l1`` when ``layers``) ->
    ``(buf [n, l1 - l0, 2, S, Hkv, D], scales)``: a bit-exact copy (``scales`` None) when
    ``out_dtype`` is None or kv's dtype; fp8 e4m3 / int8 with fp32 ``scales [n, l1 - l0, 2, Hkv]``
    otherwise. ``out`` / ``out_scales``: preallocated destinations (``out``'s pages contiguous, e.g.
    the payload columns of a batch of records; scales contiguous). Triton when every tensor is on CUDA, the reference otherwise.

    Page ids outside [0, P): the kernel never reads or writes out of bounds (that record is
    written as zeros, scale 1) and does not sync to say so; pass ``bad`` (int32 [1] on the
    device, e.g. zeros) to have them counted into it and check it whenever convenient. The
    reference raises ValueError on them unless ``bad`` is given (then it behaves as the kernel)."""
    tensors = [t for t in (kv, page_ids, out, out_scales, bad) if t is not None]
    if use_triton(*tensors):
        return pack_pages_triton(kv, page_ids, out, out_dtype, layers, out_scales, bad=bad)
    return pack_pages_reference(kv, page_ids, out, out_dtype, layers, out_scales, bad=bad)


def unpack_pages(buf: torch.Tensor, page_ids: torch.Tensor, kv: torch.Tensor,
                 scales: torch.Tensor | None = None, layers: tuple[int, int] | None = None,
                 bad: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of ``pack_pages``: writes ``buf [n, l1 - l0, 2, S, Hkv, D]`` into pages
    ``page_ids`` of kv (dequantised with ``scales`` when ``buf`` is fp8/int8); returns kv.
    Triton when every tensor is on CUDA, the reference otherwise. Page ids outside [0, P) are
    written nowhere; ``bad`` counts them, as in ``pack_pages``."""
    tensors = [t for t in (buf, page_ids, kv, scales, bad) if t is not None]
    if use_triton(*tensors):
        return unpack_pages_triton(buf, page_ids, kv, scales, layers, bad=bad)
    return unpack_pages_reference(buf, page_ids, kv, scales, layers, bad=bad)


op = pack_pages   # the one-op-per-file registry name; its inverse is unpack_pages
