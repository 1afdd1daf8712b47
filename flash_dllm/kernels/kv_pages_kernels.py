"""The Triton kernels of ``kernels/kv_pages.py`` (page-first packing of KV pages, with fp8 / int8
quantisation): the launchers, the layout checks and the PyTorch references they are tested
against are there; this file holds only the ``@triton.jit`` functions, to keep each file short.
"""
from __future__ import annotations

from flash_dllm.kernels._triton import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_fp32(x, DROP: tl.constexpr, MAGIC: tl.constexpr, TINY: tl.constexpr):
        """fp32 ``x`` rounded to nearest-even as a narrow float with ``23 - DROP`` mantissa bits
        and smallest normal ``TINY`` (its subnormals are multiples of ``ulp(MAGIC)``), still
        fp32: the cast to that float is then exact."""
        bits = x.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        sign = bits ^ mag
        # normal range: round the magnitude's bits (a carry moves into the exponent, as it should)
        keep = (mag + ((1 << (DROP - 1)) - 1) + ((mag >> DROP) & 1)) & (-(1 << DROP))
        # below the smallest normal 2^EMIN: adding MAGIC = 2^(EMIN - MANT + 23) rounds to its ulp
        small = (mag.to(tl.float32, bitcast=True) + MAGIC) - MAGIC
        normal = mag.to(tl.float32, bitcast=True) >= TINY
        out = tl.where(normal, keep, small.to(tl.int32, bitcast=True))
        return (out | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _fp8_bits(y):
        """fp32 ``y`` (already an e4m3 value, or NaN) -> its e4m3fn code as uint8. NaN gets the
        NaN code 0x7F with y's sign, as torch's cast (the interpreter's own cast has no NaN)."""
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
        return tl.where(y != y, (sign | 0x7F).to(tl.uint8), code)

    @triton.jit
    def _fp8_value(code):
        """uint8 e4m3fn ``code`` -> fp32; the NaN codes 0x7F / 0xFF give a NaN of that sign."""
        x = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        nan = (((code.to(tl.int32) & 0x80) << 24) | 0x7FC00000).to(tl.float32, bitcast=True)
        return tl.where((code & 0x7F) == 0x7F, nan, x)

    @triton.jit
    def _fragment(pid, ids_ptr, stride_id, num_pages, bad_ptr, layer0, n_layers, s_l, s_kv, s_p,
                  b_n, b_l, b_kv, CHUNKS: tl.constexpr, HAS_BAD: tl.constexpr):
        """Program id -> (pool offset, buffer offset, chunk, scales row, page id in range) of its
        (page, layer, k/v) fragment; ``CHUNKS`` programs share a fragment. An id outside
        [0, num_pages) is counted once into ``bad_ptr[0]`` (when ``HAS_BAD``): by the first
        program of its page record."""
        frag = pid // CHUNKS
        chunk = pid - frag * CHUNKS
        i = frag // (2 * n_layers)
        r = frag - i * (2 * n_layers)
        layer = r // 2
        half = r - layer * 2
        page = tl.load(ids_ptr + i * stride_id).to(tl.int64)
        ok = (page >= 0) & (page < num_pages)
        if HAS_BAD:
            tl.atomic_add(bad_ptr, 1, mask=(ok == 0) & (r == 0) & (chunk == 0))
        src = (layer0 + layer) * s_l + half * s_kv + tl.where(ok, page, 0) * s_p
        dst = i * b_n + layer * b_l + half * b_kv
        return src, dst, chunk, ((i * n_layers + layer) * 2 + half), ok

    @triton.jit
    def _copy_kernel(kv_ptr, buf_ptr, ids_ptr, stride_id, num_pages, bad_ptr, layer0, n_layers,
                     s_l, s_kv, s_p, b_n, b_l, b_kv, FRAG: tl.constexpr, BLOCK: tl.constexpr,
                     CHUNKS: tl.constexpr, PACK: tl.constexpr, HAS_BAD: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        src, dst, chunk, _, ok = _fragment(pid, ids_ptr, stride_id, num_pages, bad_ptr, layer0,
                                           n_layers, s_l, s_kv, s_p, b_n, b_l, b_kv, CHUNKS,
                                           HAS_BAD)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        # NOTE: a page id outside [0, num_pages) reads nothing from the pool (pack writes zeros)
        # and writes nothing into it (unpack): never an out-of-bounds access. `ok` is one scalar
        # per program, so a branch (uniform) keeps the in-range path's accesses as they were.
        if FRAG % BLOCK == 0:
            if PACK:
                if ok:
                    tl.store(buf_ptr + dst + offs, tl.load(kv_ptr + src + offs))
                else:
                    tl.store(buf_ptr + dst + offs, tl.zeros((BLOCK,), buf_ptr.dtype.element_ty))
            elif ok:
                tl.store(kv_ptr + src + offs, tl.load(buf_ptr + dst + offs))
        else:
            mask = offs < FRAG
            if PACK:
                if ok:
                    tl.store(buf_ptr + dst + offs, tl.load(kv_ptr + src + offs, mask=mask),
                             mask=mask)
                else:
                    tl.store(buf_ptr + dst + offs, tl.zeros((BLOCK,), buf_ptr.dtype.element_ty),
                             mask=mask)
            elif ok:
                tl.store(kv_ptr + src + offs, tl.load(buf_ptr + dst + offs, mask=mask),
                         mask=mask)

    @triton.jit
    def _quant_kernel(kv_ptr, buf_ptr, scale_ptr, ids_ptr, stride_id, num_pages, bad_ptr,
                      layer0, n_layers, s_l, s_kv, s_p, b_n, b_l, b_kv, S: tl.constexpr,
                      H: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, HGROUPS: tl.constexpr,
                      QMAX: tl.constexpr, INT8: tl.constexpr, DROP: tl.constexpr,
                      MAGIC: tl.constexpr, TINY: tl.constexpr, HAS_BAD: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        src, dst, hg, row, ok = _fragment(pid, ids_ptr, stride_id, num_pages, bad_ptr, layer0,
                                          n_layers, s_l, s_kv, s_p, b_n, b_l, b_kv, HGROUPS,
                                          HAS_BAD)
        heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        # [BLOCK_S, BLOCK_H, BLOCK_D] tile: token t, head h, column d of one fragment
        inner = (offs_s[:, None, None] * (H * D) + heads[None, :, None] * D
                 + offs_d[None, None, :])
        hd_mask = (heads[None, :, None] < H) & (offs_d[None, None, :] < D)
        # a bad page id reads as zeros (no token is below s_lim): amax 0, scale 1, codes 0
        # (written, like the copy's zeros)
        s_lim = tl.where(ok, S, 0)
        amax = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):
            x = tl.load(kv_ptr + src + s0 * (H * D) + inner,
                        mask=hd_mask & (offs_s[:, None, None] < s_lim - s0), other=0.0)
            x = tl.abs(x.to(tl.float32))
            # NaN-propagating max (tl.max / tl.maximum drop NaN), as torch's amax
            tile = tl.reduce(tl.reduce(x, 2, _max_nan), 0, _max_nan)
            amax = tl.maximum(amax, tile, propagate_nan=tl.PropagateNan.ALL)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, QMAX), 1.0)        # [BLOCK_H]
        tl.store(scale_ptr + row * H + heads, scale, mask=heads < H)
        for s0 in range(0, S, BLOCK_S):   # a second read of a page that fits a tile hits L1/L2
            mask = hd_mask & (offs_s[:, None, None] < S - s0)
            x = tl.load(kv_ptr + src + s0 * (H * D) + inner,
                        mask=hd_mask & (offs_s[:, None, None] < s_lim - s0), other=0.0)
            y = tl.math.div_rn(x.to(tl.float32), scale[None, :, None])
            y = tl.maximum(y, -QMAX, propagate_nan=tl.PropagateNan.ALL)      # NaN stays NaN
            y = tl.minimum(y, QMAX, propagate_nan=tl.PropagateNan.ALL)
            if INT8:
                y = (y + 12582912.0) - 12582912.0         # 1.5 * 2^23: round half to even
                y = tl.where(y != y, 0.0, y)              # no int8 NaN: code 0 (the reference's)
            else:
                y = _fp8_bits(_round_fp32(y, DROP, MAGIC, TINY))   # buf viewed as uint8
            tl.store(buf_ptr + dst + s0 * (H * D) + inner,
                     y.to(buf_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(kv_ptr, buf_ptr, scale_ptr, ids_ptr, stride_id, num_pages, bad_ptr,
                        layer0, n_layers, s_l, s_kv, s_p, b_n, b_l, b_kv, H: tl.constexpr,
                        D: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_D: tl.constexpr, CHUNKS: tl.constexpr, FP8_BITS: tl.constexpr,
                        ROUND: tl.constexpr,
                        DROP: tl.constexpr, MAGIC: tl.constexpr, TINY: tl.constexpr,
                        HAS_BAD: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        src, dst, chunk, row, ok = _fragment(pid, ids_ptr, stride_id, num_pages, bad_ptr, layer0,
                                             n_layers, s_l, s_kv, s_p, b_n, b_l, b_kv, CHUNKS,
                                             HAS_BAD)
        # a fragment is ROWS = page_size * kv_heads rows of D values; row r belongs to head r % H
        rows = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        offs = rows[:, None] * D + cols[None, :]                          # [BLOCK_R, BLOCK_D]
        mask = (rows[:, None] < ROWS) & (cols[None, :] < D)
        scale = tl.load(scale_ptr + row * H + rows % H, mask=rows < ROWS, other=1.0)
        x = tl.load(buf_ptr + dst + offs, mask=mask)
        x = (_fp8_value(x) if FP8_BITS else x.to(tl.float32)) * scale[:, None]
        if ROUND:
            x = _round_fp32(x, DROP, MAGIC, TINY)
        # a bad page id writes nothing (no row is below 0)
        store = (rows[:, None] < tl.where(ok, ROWS, 0)) & (cols[None, :] < D)
        tl.store(kv_ptr + src + offs, x.to(kv_ptr.dtype.element_ty), mask=store)
