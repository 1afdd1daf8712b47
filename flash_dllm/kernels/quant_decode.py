"""Packed weight codes -> bf16 values in registers, without conversion instructions.

A batch-1 step's weight-only GEMM decodes every weight once; done with ``cvt`` (int -> bf16,
e4m3 -> f16 -> bf16) the conversions issue at a quarter of the ALU rate on Hopper and bound the
kernel near 7 weights per clock per SM (the int4 / fp8 rows of
``benchmarks/results/step/sweep_quant_gemm_int4_h100.json`` read 0.7 / 1.5 TB/s). These decoders
build the bf16 bit patterns with byte permutes, shifts and masks on two values per 32-bit
register, then one exact ``fma.rn.bf16x2``:

- int4 (``quant_gemm``'s layout: a byte holds ``q + 8`` for two columns, low nibble first):
  ``0x4300 | u`` is the bf16 ``128 + u`` (u < 128 fits the mantissa), and ``(128 + u) - 136``
  is ``q`` exactly (``int4_pair_bf16``: the low and the high nibbles of each byte).
- e4m3: a code's seven low bits shifted left by 4 are a bf16 whose exponent field is the code's
  exponent (no rebias) and whose mantissa is the code's: the value times 2^-120, subnormal codes
  included (a bf16 subnormal then); the sign moves to bit 15; ``* 2^120`` is exact
  (``e4m3_bf16``). NaN codes (0x7F / 0xFF) decode to a finite value; the quantizer never
  writes them.

The PTX needs sm_80+ (``fma.rn.bf16x2``); the interpreter cannot run inline assembly, so the
kernels take these paths on GPUs only (``quant_gemm._int_tile_dot``'s ``FAST``). ``*_reference``
are the same bit recipes in PyTorch: the CPU tests check them over all 256 byte values against
the true decodings, and the GPU tests check the kernels against ``quant_gemm``'s reference.

- int4 words (``interleave_int4``, the read ``JOIN = 3`` of ``quant_gemm``, a study so far):
  the same bytes re-ordered so that each 128-column K tile is 16 int32 words, word ``w`` holding
  columns ``w + 16 i`` at bits ``4 i``; ``int4_words`` decodes a tile of words into its columns
  with shifts and masks and lets the compiler lay the values out as the MMA wants them (on sm_90
  the packed tile reaches the wgmma registers with vector loads: no byte loads, no layout
  shuffle; fewer instructions per weight than ``int4_pair_bf16``'s read, in the SASS).

Also here: the packed layout's own functions (``quantize``, ``unpack``, ``dequantize``: the
layout is described in ``quant_gemm``, which re-exports them) and ``dequantize_triton``, the whole
weight decoded once into a dense copy (``quant_gemm.op`` from ``DEQUANT_MIN_ROWS`` rows), equal to
``dequantize``.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels._triton import HAS_TRITON, check, check_device, describe, interpreting

INTERPRET = interpreting()

if HAS_TRITON:
    import triton
    import triton.language as tl

    # per 4 bytes ($4): the bytes spread into 16-bit halves (prmt), nibble masks, one exact fma
    _INT4_ASM = tl.constexpr("""{
    .reg .b32 t0, t1, s0, s1, a, b, c, d, one, off;
    mov.b32 one, 0x3F803F80;
    mov.b32 off, 0xC308C308;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    shr.b32 s0, t0, 4;
    shr.b32 s1, t1, 4;
    and.b32 a, t0, 0x000F000F;
    and.b32 b, t1, 0x000F000F;
    and.b32 c, s0, 0x000F000F;
    and.b32 d, s1, 0x000F000F;
    or.b32 a, a, 0x43004300;
    or.b32 b, b, 0x43004300;
    or.b32 c, c, 0x43004300;
    or.b32 d, d, 0x43004300;
    fma.rn.bf16x2 $0, a, one, off;
    fma.rn.bf16x2 $1, b, one, off;
    fma.rn.bf16x2 $2, c, one, off;
    fma.rn.bf16x2 $3, d, one, off;
    }""")

    # per 4 bytes ($2): each byte to the high half of a 16-bit lane, magnitude bits >> 4 into
    # the bf16 exponent / mantissa, the sign kept in bit 15, then * 2^120 (exact)
    _E4M3_ASM = tl.constexpr("""{
    .reg .b32 t0, t1, s0, s1, p120, nz;
    mov.b32 p120, 0x7B807B80;
    mov.b32 nz, 0x80008000;
    prmt.b32 t0, $2, 0, 0x1404;
    prmt.b32 t1, $2, 0, 0x3424;
    shr.b32 s0, t0, 4;
    shr.b32 s1, t1, 4;
    and.b32 s0, s0, 0x07F007F0;
    and.b32 s1, s1, 0x07F007F0;
    and.b32 t0, t0, 0x80008000;
    and.b32 t1, t1, 0x80008000;
    or.b32 s0, s0, t0;
    or.b32 s1, s1, t1;
    fma.rn.bf16x2 $0, s0, p120, nz;
    fma.rn.bf16x2 $1, s1, p120, nz;
    }""")

    @triton.jit
    def int4_pair_bf16(b):
        """uint8 tile -> (low nibbles, high nibbles) as bf16 tiles of ``q = nibble - 8``."""
        return tl.inline_asm_elementwise(_INT4_ASM, "=r,=r,=r,=r,r", [b],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True,
                                         pack=4)

    # per 2 int32 words ($8, $9) of the interleaved layout: their low / high 16-bit halves
    # paired (prmt), then per nibble position j one bf16x2 of (word $8's, word $9's) q values
    _WORDS_ASM = tl.constexpr("""{
    .reg .b32 x, y, t, one, off;
    mov.b32 one, 0x3F803F80;
    mov.b32 off, 0xC308C308;
    prmt.b32 x, $8, $9, 0x5410;
    prmt.b32 y, $8, $9, 0x7632;
    and.b32 t, x, 0x000F000F; or.b32 t, t, 0x43004300; fma.rn.bf16x2 $0, t, one, off;
    shr.b32 t, x, 4; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $1, t, one, off;
    shr.b32 t, x, 8; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $2, t, one, off;
    shr.b32 t, x, 12; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $3, t, one, off;
    and.b32 t, y, 0x000F000F; or.b32 t, t, 0x43004300; fma.rn.bf16x2 $4, t, one, off;
    shr.b32 t, y, 4; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $5, t, one, off;
    shr.b32 t, y, 8; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $6, t, one, off;
    shr.b32 t, y, 12; and.b32 t, t, 0x000F000F;
    or.b32 t, t, 0x43004300; fma.rn.bf16x2 $7, t, one, off;
    }""")

    @triton.jit
    def _nib(w, i: tl.constexpr):
        return (((w >> (4 * i)) & 0xF) - 8).to(tl.float32)

    @triton.jit
    def int4_words(w, x, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        """``[BN, BLOCK_K / 8]`` int32 words of one interleaved K tile -> ``[BN, BLOCK_K]``
        values ``q`` in column order (word ``w``'s nibble ``i`` is column ``w + BLOCK_K / 8 *
        i``), in the dtype the dot takes with ``x``: bf16 by the bit recipe on a GPU, float32
        in the interpreter (``UPCAST``), else x's."""
        if not UPCAST and x.dtype == tl.bfloat16:
            n0, n1, n2, n3, n4, n5, n6, n7 = tl.inline_asm_elementwise(
                _WORDS_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=2)
        else:
            n0, n1, n2, n3 = _nib(w, 0), _nib(w, 1), _nib(w, 2), _nib(w, 3)
            n4, n5, n6, n7 = _nib(w, 4), _nib(w, 5), _nib(w, 6), _nib(w, 7)
        b = tl.join(tl.join(tl.join(n0, n1), tl.join(n2, n3)),
                    tl.join(tl.join(n4, n5), tl.join(n6, n7)))
        # [BN, W, i & 1, i >> 1 & 1, i >> 2] -> [BN, i, W]: column i * W + w
        out = tl.reshape(tl.permute(b, (0, 4, 3, 2, 1)), (w.shape[0], BLOCK_K))
        return out.to(tl.float32 if UPCAST else x.dtype)

    @triton.jit
    def e4m3_bf16(b):
        """uint8 tile of e4m3 codes -> their exact bf16 values."""
        return tl.inline_asm_elementwise(_E4M3_ASM, "=r,=r,r", [b], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn,
                        GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, WORDS: tl.constexpr, ROW_SCALE: tl.constexpr):
        """W [N, K] in w's dtype = q * scale, in fp32 and rounded once (as ``dequantize``).
        ``WORDS``: q_ptr is int4 words (``interleave_int4``, ``BLOCK_K`` = ``WORD_TILE``);
        ``ROW_SCALE``: the tile lies inside one scale group (one scale a row, not a gather)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rows < N
        q_row = q_ptr + rows[:, None].to(tl.int64) * stride_qn
        s_row = s_ptr + rows[:, None].to(tl.int64) * stride_sn
        w_row = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        m = n_ok[:, None] & (ks < K)[None, :]
        if BITS == 8:
            q = tl.load(q_row + ks[None, :], mask=m, other=0).to(tl.float32)   # (int8: exact)
        elif WORDS:  # the tile's words [BN, W]; nibble i of word w is column i * W + w
            wj = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
            wd = tl.load(q_row + wj[None, :], mask=n_ok[:, None] & (8 * wj < K)[None, :],
                         other=0)
            sh = 4 * tl.arange(0, 8)
            q = tl.reshape(((wd[:, None, :] >> sh[None, :, None]) & 0xF) - 8, (BLOCK_N, BLOCK_K))
        else:        # each byte's nibbles joined back into their columns: contiguous stores
            jb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            b = tl.load(q_row + jb[None, :], mask=n_ok[:, None] & (2 * jb < K)[None, :],
                        other=0).to(tl.int32)
            q = tl.reshape(tl.join((b & 0xF) - 8, (b >> 4) - 8), (BLOCK_N, BLOCK_K))
        if ROW_SCALE:
            sc = tl.load(s_row + tl.program_id(1) * BLOCK_K // GROUP, mask=n_ok[:, None],
                         other=0.0)                                           # [BN, 1]
        else:
            sc = tl.load(s_row + ks[None, :] // GROUP, mask=m, other=0.0)     # [BN, BK]
        tl.store(w_row + ks[None, :],
                 (q.to(tl.float32) * sc.to(tl.float32)).to(w_ptr.dtype.element_ty), mask=m)


# The packed layout (``quant_gemm``'s docstring): what the quantizer writes, every kernel reads.
INT_BITS = (8, 4)
SCALE_DTYPE = torch.float16
_QMAX = {8: 127, 4: 7}


def quantize(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float dtype; leading dims allowed, ``[..., N, K]``) -> (qweight,
    scales) in the layout above. ``group`` must divide K (the caller names the layer when it
    does not)."""
    check(bits in INT_BITS, f"quantize: bits must be one of {INT_BITS}, got {bits}")
    K = w.shape[-1]
    check(group >= 1 and K % group == 0, f"quantize: group {group} must divide K = {K}")
    check(bits == 8 or K % 2 == 0, f"quantize: int4 packs two weights per byte, K = {K} is odd")
    wf = w.float().unflatten(-1, (K // group, group))                  # [..., N, K/g, g]
    amax = wf.abs().amax(-1, keepdim=True)
    # NOTE: the scale is rounded to its storage dtype first and the weights are quantized with
    # the rounded scale, so dequant(q) is the nearest grid point of the scale actually stored
    scale = (amax / _QMAX[bits]).clamp_min(1e-7).to(SCALE_DTYPE)
    q = torch.round(wf / scale.float()).clamp(-_QMAX[bits] - (bits == 4), _QMAX[bits])
    q = q.flatten(-2).to(torch.int8)                                   # [..., N, K]
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        q = u[..., 0::2] | (u[..., 1::2] << 4)                          # [..., N, K/2]
    return q.contiguous(), scale.squeeze(-1).contiguous()


def unpack(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers ``q`` [..., N, K] (int8) of a packed ``qweight`` (int4 words included)."""
    if bits == 8:
        return qweight
    qweight = words_to_bytes(qweight)
    lo = (qweight & 0xF).to(torch.int8) - 8
    hi = (qweight >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], dim=-1).flatten(-2)                   # [..., N, K]


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W = q * scale`` [..., N, K], computed in fp32 and rounded once to ``dtype``."""
    q = unpack(qweight, bits).float()
    group = q.shape[-1] // scales.shape[-1]
    w = q.unflatten(-1, (scales.shape[-1], group)) * scales.float().unsqueeze(-1)
    return w.flatten(-2).to(dtype)


WORD_TILE = 128           # K columns per tile of the interleaved int4 words


def interleave_int4(qweight: torch.Tensor, tile: int = WORD_TILE) -> torch.Tensor:
    """An int4 ``qweight [..., N, K / 2]`` (this layout) -> the same bytes in the word order
    ``int4_words`` reads (``quant_gemm``'s ``JOIN = 3``): per ``tile`` columns, ``tile / 8``
    little-endian int32 words, word ``w`` holding column ``w + tile / 8 * i`` at bits ``4 i``."""
    K = qweight.shape[-1] * 2
    check(K % tile == 0 and tile % 8 == 0,
          f"interleave_int4: K = {K} must be a multiple of the tile {tile} (itself of 8)")
    return _transpose_nibbles(qweight, (K // tile, 8, tile // 8))


def _transpose_nibbles(b: torch.Tensor, tiles: tuple[int, int, int]) -> torch.Tensor:
    """Bytes of two nibbles each -> their nibbles (low first) cut into ``tiles`` ``(t, a, c)``
    along the last dim, each tile's ``a x c`` block transposed, packed two to a byte again:
    ``(t, 8, tile / 8)`` interleaves, ``(t, tile / 8, 8)`` undoes it."""
    u = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)                    # [..., N, K]
    u = u.unflatten(-1, tiles).transpose(-1, -2).flatten(-3)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def takes_words(K: int, group: int) -> bool:
    """Whether int4 codes of ``K`` inputs in scale groups of ``group`` can be words: whole
    ``WORD_TILE`` tiles, each inside one group (the word read scales a tile once)."""
    return K % WORD_TILE == 0 and group % WORD_TILE == 0


def deinterleave_int4(words: torch.Tensor, tile: int = WORD_TILE) -> torch.Tensor:
    """``interleave_int4``'s inverse."""
    K = words.shape[-1] * 2
    check(K % tile == 0, f"deinterleave_int4: K = {K} must be a multiple of the tile {tile}")
    return _transpose_nibbles(words, (K // tile, tile // 8, 8))


def words_to_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """An int4 ``qweight`` in this layout's bytes: int4 words (int32 ``[..., N, K / 8]``, as
    ``interleave_int4(q).view(torch.int32)``) de-interleaved; bytes as they are."""
    if qweight.dtype != torch.int32:
        return qweight
    return deinterleave_int4(qweight.view(torch.uint8))


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def int4_pair_reference(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``int4_pair_bf16``'s recipe in PyTorch (uint8 -> two bf16 tensors)."""
    b = b.to(torch.int32)
    lo = _bf16((b & 0xF) | 0x4300).float() - 136.0
    hi = _bf16(((b >> 4) & 0xF) | 0x4300).float() - 136.0
    return lo.to(torch.bfloat16), hi.to(torch.bfloat16)


def int4_words_reference(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    """``_WORDS_ASM``'s recipe in PyTorch: two int32 word tensors -> for each nibble position
    ``i`` (0..7), the pair of bf16 values its register holds (low half: word ``a``'s, high half:
    word ``b``'s)."""
    a, b = a.to(torch.int64) & 0xFFFFFFFF, b.to(torch.int64) & 0xFFFFFFFF
    x = (a & 0xFFFF) | ((b & 0xFFFF) << 16)               # prmt 0x5410: the low halves
    y = (a >> 16) | ((b >> 16) << 16)                      # prmt 0x7632: the high halves
    out = []
    for h in (x, y):
        for j in range(4):
            t = ((h >> (4 * j)) & 0x000F000F) | 0x43004300
            lo = _bf16(t & 0xFFFF).float() - 136.0         # fma.rn.bf16x2 t * 1 + (-136)
            hi = _bf16(t >> 16).float() - 136.0
            out.append((lo.to(torch.bfloat16), hi.to(torch.bfloat16)))
    return out


def e4m3_reference(b: torch.Tensor) -> torch.Tensor:
    """``e4m3_bf16``'s recipe in PyTorch (uint8 -> bf16)."""
    b = b.to(torch.int32)
    bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8)
    return (_bf16(bits).double() * 2.0 ** 120).to(torch.bfloat16)


def dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """``dequantize`` in one kernel: ``[N, K]`` in ``dtype`` (read packed, write once); an
    int32 ``qweight`` is int4 words (``interleave_int4``), read as they are."""
    check(HAS_TRITON, "quant_decode: triton is not importable")
    check(qweight.dim() == 2 and qweight.is_contiguous() and scales.dim() == 2
          and scales.stride(1) == 1, f"quant_gemm.dequantize_triton: a contiguous 2-D qweight "
          f"and scales, got {describe(qweight)} and {describe(scales)}")
    check_device("quant_decode", INTERPRET, qweight, scales)
    words = qweight.dtype == torch.int32
    check(not words or bits == 4, f"quant_decode: int32 words are int4's layout, not int{bits}")
    check(qweight.dtype in (torch.int8, torch.uint8, torch.int32),
          f"quant_decode.dequantize_triton: integer codes (int8, uint8 or int32 words), got "
          f"{qweight.dtype}")
    N, K = qweight.shape[0], qweight.shape[1] * (32 if words else 8) // bits
    w = torch.empty(N, K, dtype=dtype, device=qweight.device)
    if N and K:
        # (the words' tile: one K tile a program; BLOCK_N 32 and 4 warps: within 5 % of the
        # H100 sweep's best, benchmarks/step/sweep_dequant.py)
        bn, bk, group = 32, WORD_TILE, K // scales.shape[1]
        _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
            qweight, scales, w, N, K, qweight.stride(0), scales.stride(0), w.stride(0),
            GROUP=group, BITS=bits, BLOCK_N=bn, BLOCK_K=bk, WORDS=words,
            ROW_SCALE=group % bk == 0, num_warps=4)
    return w
