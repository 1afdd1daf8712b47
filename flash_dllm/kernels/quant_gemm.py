"""Weight-only int8 / int4 GEMMs (W8A16 / W4A16): ``out = x @ dequant(W)^T + bias``, the weight
dequantized inside the kernel from its packed integers and group scales.

Layout (what ``quantize`` returns and the kernels read):

- ``qweight``: int8 ``[N, K]`` (bits 8), or uint8 ``[N, K / 2]`` (bits 4: two weights per byte,
  column ``2j`` in the low nibble, ``2j + 1`` in the high one, each stored as ``q + 8`` in
  ``[0, 15]``); 8 bits may also be e4m3 codes (float8_e4m3fn ``[N, K]``: the fused MoE's fp8
  experts, ``fused_moe_quant``; one float32 scale per row, i.e. ``scales`` ``[N, 1]``; every e4m3 value is
  exact in bf16, so the kernel's conversion is exact as the integers' is);
- ``scales``: float16 ``[N, K / group]``, one per output row and ``group`` consecutive inputs;
- the weight is ``W[n, k] = q[n, k] * scales[n, k // group]`` (symmetric, no zero point):
  ``q`` in [-127, 127] (int8) or [-8, 7] (int4, scale = group absmax / 7).

Math: the reference dequantizes ``W`` in fp32, rounds it once to x's dtype, accumulates the GEMM
in fp32, adds the bias in fp32 and rounds once to x's dtype. The kernel does the same when a K
tile crosses scale groups; when a tile lies inside one group (the default tiles from group 64)
it multiplies x by the integers themselves (exact) and scales the tile's fp32 partial sum, so
``W`` is never rounded to x's dtype (slightly more accurate than the reference). Either way the
K-order of accumulation is the tiling's: results agree with the reference to the dtype's
rounding, not bitwise.

Kernel, for skinny M (a batch-1 dLLM step is a 32-row GEMM: reading the weights is the whole
cost, 64 FLOPs per weight byte at most, far below the ridge): a 3-D grid of (BLOCK_N columns,
SPLIT_K slices of K, BLOCK_M rows). Each program streams its ``[BLOCK_N, K / SPLIT_K]`` slice of
packed weights once, decodes in registers (on GPUs with bf16 x, int4 and e4m3 codes by the bit
recipes of ``quant_decode``, no conversion instructions; no unpacked copy of the weights ever
exists), and ``tl.dot``s against the (tiny, cached) x tile. With few column tiles (N / BLOCK_N
below ~2 waves of SMs) the K split gives every SM a slice of the weights to stream; the slices
write fp32 partials ``[SPLIT_K, M, N]`` and the tile's last slice to finish (an arrival counter)
adds them in slice order and writes the output: one launch, deterministic. The tile option
``SWAP`` takes the dots transposed (``W @ x^T``: the decoded weight becomes the register operand
of Hopper's wgmma, the few rows of x its narrow N side); on an H100 it won the int4 shapes at 32
rows (gate/up 44.4 -> 39.1 us) and lost fp8's and the fused MoE's (findings/quantization.md).
Tiles: a device's tuned file (``tuned_config``), else ``default_config`` (shape and SM count).

NOTE (size): ~420 lines for one op: the skinny kernel and its tile loop (also the fused MoE's on
packed experts), its int4 reads and transposed dots, and the reference. The layout's
``quantize`` / ``unpack`` / ``dequantize`` live in ``quant_decode``, the tiles (defaults, tuned
files, their check) in ``quant_tiles``; both re-exported here.

NOTE (batch invariance): the split and the tiles follow M (through ``default_config``), so a
row's reduction order may change with the batch size; pass one ``config`` for bit-stable
answers across batch sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_dllm.kernels import quant_decode
from flash_dllm.kernels.quant_decode import dequantize_triton  # (op's many-row path)
from flash_dllm.kernels.quant_decode import (  # noqa: F401  (the layout's own functions)
    INT_BITS,
    SCALE_DTYPE,
    dequantize,
    quantize,
    unpack,
)
from flash_dllm.kernels.quant_tiles import (  # noqa: F401  (the tiles: quant_tiles)
    FP8,
    TILE_RULES,
    _device_name,
    _num_sms,
    check_tile,
    code_name,
    default_config,
    problem_key,
    tuned_config,
)
from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    batch_invariant_active,
    check,
    check_device,
    check_dtype,
    describe,
    interpreting,
    pdl_args,
    split_slices,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
# How int4 tiles read their nibbles when no tuned tile says (``_int_tile_dot``'s ``JOIN``): 1,
# the nibbles joined into their columns: fastest on an H100 (``step/sweep_quant_gemm_int4_h100
# .json``: LLaDA-8B's projections at 32 rows, read 1 35 / 20 / 56 / 46 us, 2 50 / 47 / 75 / 127).
INT4_READ = 1
# the tiles int4 words are read with (``_int_tile_dot``'s JOIN 3: one 128-column word tile)
WORD_READ = {"JOIN": 3, "BLOCK_K": quant_decode.WORD_TILE}

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait, split_sum

    @triton.jit
    def wq_dot_acc(acc, a_rows, a_ok, q_rows, s_rows, w_ok, k_start, k_end,
                   GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                   UPCAST: tl.constexpr, PREC: tl.constexpr, JOIN: tl.constexpr,
                   FP8: tl.constexpr = False, SWAP: tl.constexpr = 0):
        """acc [BM, BN] += A[:, k_start:k_end] @ dequant(Q[:, k_start:k_end])^T, the weight
        dequantized in registers: ``a_rows`` [BM, 1] / ``q_rows``, ``s_rows`` [BN, 1] point at
        each row's start (x / packed integers / scales, in this module's layout); ``a_ok`` /
        ``w_ok`` mask the rows. Also the fused MoE's on packed experts (``fused_moe_quant``).

        When a K tile lies inside one scale group (``GROUP % BLOCK_K == 0``; the slices start on
        group boundaries) the integers themselves meet x in the dot (``_int_tile_dot``) and the
        tile's partial sum is scaled per column after it: one conversion per weight, no scale
        gather, no K mask (every tile is whole). Otherwise each weight is dequantized before the
        dot (``_dequant_tile_dot``: ``q * s`` rounded to x's dtype, as the reference).

        ``SWAP`` (whole-group tiles only): the dots are taken transposed, ``W @ x^T`` into a
        ``[BN, BM]`` accumulator (the decoded weight the dot's first operand, the few rows of x
        its narrow second one), scaled per row and transposed once at the end."""
        if GROUP % BLOCK_K == 0 and SWAP:
            acc_t = tl.zeros((acc.shape[1], acc.shape[0]), dtype=tl.float32)
            for k0 in range(k_start, k_end, BLOCK_K):
                s = tl.load(s_rows + k0 // GROUP, mask=w_ok[:, None], other=0.0)   # [BN, 1]
                part = _int_tile_dot(a_rows, a_ok, q_rows, w_ok, k0, BITS, BLOCK_K, UPCAST,
                                     PREC, JOIN, FP8, 1)
                acc_t += part * s.to(tl.float32)
            acc += tl.trans(acc_t)
        elif GROUP % BLOCK_K == 0:
            for k0 in range(k_start, k_end, BLOCK_K):
                s = tl.load(s_rows + k0 // GROUP, mask=w_ok[:, None], other=0.0)   # [BN, 1]
                part = _int_tile_dot(a_rows, a_ok, q_rows, w_ok, k0, BITS, BLOCK_K, UPCAST,
                                     PREC, JOIN, FP8, 0)
                acc += part * tl.trans(s.to(tl.float32))
        else:
            for k0 in range(k_start, k_end, BLOCK_K):
                acc = _dequant_tile_dot(acc, a_rows, a_ok, q_rows, s_rows, w_ok, k0, k_end,
                                        GROUP, BITS, BLOCK_K, UPCAST, PREC, FP8)
        return acc

    @triton.jit
    def _int_tile_dot(a_rows, a_ok, q_rows, w_ok, k0, BITS: tl.constexpr,
                      BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                      JOIN: tl.constexpr, FP8: tl.constexpr, SWAP: tl.constexpr):
        """[BM, BN] fp32 (``SWAP``: its transpose [BN, BM], from ``_mm``):
        x[:, k0:k0 + BK] @ q[:, k0:k0 + BK]^T with the integers as values
        (exact in any float dtype: |q| <= 127). int4 reads its nibbles by ``JOIN``
        (``INT4_READ`` has the H100's timings): 0, two half-width dots against x's even / odd
        columns loaded strided (scalar loads, not pipelined); 1, the nibbles joined into their
        columns for one dot with x's tile; 2, x split into even / odd columns, two dots; 3 (a
        layout, never in tuned files): int32 words of ``quant_decode.interleave_int4``."""
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_rows + ks[None, :], mask=a_ok[:, None], other=0.0)      # [BM, BK]
            w = tl.load(q_rows + ks[None, :], mask=w_ok[:, None], other=0)
            if FP8 and not UPCAST and x.dtype == tl.bfloat16:
                w = quant_decode.e4m3_bf16(w)          # bit recipe, no cvt (quant_decode)
            else:
                if FP8:      # e4m3 codes, passed as their bytes
                    w = w.to(tl.float8e4nv, bitcast=True)
                if UPCAST:   # (the interpreter's int -> bf16 cast is wrong: fp32, as exact)
                    x, w = x.to(tl.float32), w.to(tl.float32)
                else:
                    w = w.to(x.dtype)
            part = _mm(x, w, PREC, SWAP)
        elif JOIN == 3:   # int32 words, interleaved (quant_decode.interleave_int4)
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_rows + ks[None, :], mask=a_ok[:, None], other=0.0)
            jw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            wq = tl.load(q_rows.to(tl.pointer_type(tl.int32)) + jw[None, :],
                         mask=w_ok[:, None], other=0)
            part = _mm(x.to(tl.float32) if UPCAST else x,
                       quant_decode.int4_words(wq, x, BLOCK_K, UPCAST), PREC, SWAP)
        elif JOIN == 2:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_rows + ks[None, :], mask=a_ok[:, None], other=0.0)      # [BM, BK]
            jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # byte index
            b = tl.load(q_rows + jb[None, :], mask=w_ok[:, None], other=0).to(tl.int32)
            if UPCAST:
                x = x.to(tl.float32)
            xe, xo = tl.split(tl.reshape(x, (x.shape[0], BLOCK_K // 2, 2)))
            we = ((b & 0xF) - 8).to(x.dtype)
            wo = ((b >> 4) - 8).to(x.dtype)
            part = _mm(xe, we, PREC, SWAP) + _mm(xo, wo, PREC, SWAP)
        elif JOIN:
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a_rows + ks[None, :], mask=a_ok[:, None], other=0.0)
            jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # byte index
            b = tl.load(q_rows + jb[None, :], mask=w_ok[:, None], other=0)
            if not UPCAST and x.dtype == tl.bfloat16:     # bit recipe, no cvt (quant_decode)
                lo, hi = quant_decode.int4_pair_bf16(b)
                w = tl.reshape(tl.join(lo, hi), (b.shape[0], BLOCK_K))
            else:
                b = b.to(tl.int32)
                if UPCAST:
                    x = x.to(tl.float32)
                w = tl.reshape(tl.join((b & 0xF) - 8, (b >> 4) - 8),
                               (b.shape[0], BLOCK_K)).to(x.dtype)
            part = _mm(x, w, PREC, SWAP)
        else:
            jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # byte index
            ke = 2 * jb
            xe = tl.load(a_rows + ke[None, :], mask=a_ok[:, None], other=0.0)
            xo = tl.load(a_rows + ke[None, :] + 1, mask=a_ok[:, None], other=0.0)
            b = tl.load(q_rows + jb[None, :], mask=w_ok[:, None], other=0).to(tl.int32)
            if UPCAST:
                xe, xo = xe.to(tl.float32), xo.to(tl.float32)
            we = ((b & 0xF) - 8).to(xe.dtype)
            wo = ((b >> 4) - 8).to(xe.dtype)
            part = _mm(xe, we, PREC, SWAP) + _mm(xo, wo, PREC, SWAP)
        return part

    @triton.jit
    def _mm(x, w, PREC: tl.constexpr, SWAP: tl.constexpr):
        """x [BM, BK] @ w [BN, BK]^T, or with ``SWAP`` its transpose w @ x^T [BN, BM]."""
        if SWAP:
            out = tl.dot(w, tl.trans(x), input_precision=PREC)
        else:
            out = tl.dot(x, tl.trans(w), input_precision=PREC)
        return out

    @triton.jit
    def _dequant_tile_dot(acc, a_rows, a_ok, q_rows, s_rows, w_ok, k0, k_end,
                          GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                          UPCAST: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
        """acc += one K tile with each weight dequantized before the dot (the tile may cross
        groups and the slice's end: masked)."""
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x = tl.load(a_rows + ks[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            wmask = w_ok[:, None] & k_ok[None, :]
            q = tl.load(q_rows + ks[None, :], mask=wmask, other=0)
            if FP8:
                q = q.to(tl.float8e4nv, bitcast=True)
            q = q.to(tl.float32)
            s = tl.load(s_rows + ks[None, :] // GROUP, mask=wmask, other=0.0).to(tl.float32)
            w = (q * s).to(x.dtype)                        # rounded once, as the reference
            if UPCAST:       # the interpreter's half-precision tl.dot is wrong (Triton 3.9)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        else:
            # each byte once: its low nibbles are the even columns, its high ones the odd
            # columns; x's even and odd columns (strided, from cache) meet them in two dots
            jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)                          # byte index
            ke = 2 * jb                                                        # even columns
            k_ok = ke < k_end                         # (k_end is even: so are K and the slices)
            xmask = a_ok[:, None] & k_ok[None, :]
            xe = tl.load(a_rows + ke[None, :], mask=xmask, other=0.0)          # [BM, BK/2]
            xo = tl.load(a_rows + ke[None, :] + 1, mask=xmask, other=0.0)
            wmask = w_ok[:, None] & k_ok[None, :]
            b = tl.load(q_rows + jb[None, :], mask=wmask, other=0).to(tl.int32)
            se = tl.load(s_rows + ke[None, :] // GROUP, mask=wmask, other=0.0).to(tl.float32)
            so = tl.load(s_rows + (ke[None, :] + 1) // GROUP, mask=wmask,
                         other=0.0).to(tl.float32)
            we = (((b & 0xF).to(tl.float32) - 8.0) * se).to(xe.dtype)
            wo = (((b >> 4).to(tl.float32) - 8.0) * so).to(xe.dtype)
            if UPCAST:
                xe, xo = xe.to(tl.float32), xo.to(tl.float32)
                we, wo = we.to(tl.float32), wo.to(tl.float32)
            acc += tl.dot(xe, tl.trans(we), input_precision=PREC)
            acc += tl.dot(xo, tl.trans(wo), input_precision=PREC)
        return acc

    @triton.jit
    def _wq_gemm_kernel(x_ptr, q_ptr, s_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
                        K_PER_SPLIT, stride_xm, stride_qn, stride_sn, stride_om, stride_pm,
                        stride_ps, GROUP: tl.constexpr, BITS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                        PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, JOIN: tl.constexpr, FP8: tl.constexpr,
                        SWAP: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        acc = wq_dot_acc(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                         x_ptr + rows[:, None].to(tl.int64) * stride_xm, row_ok,
                         q_ptr + cols[:, None].to(tl.int64) * stride_qn,
                         s_ptr + cols[:, None].to(tl.int64) * stride_sn, col_ok, k_start, k_end,
                         GROUP, BITS, BLOCK_K, UPCAST, PREC, JOIN, FP8, SWAP)
        finish_tile(acc, part_ptr, cnt_ptr, b_ptr, out_ptr, rows, cols, row_ok, col_ok,
                    stride_om, stride_pm, stride_ps, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)

    @triton.jit
    def finish_tile(acc, part_ptr, cnt_ptr, b_ptr, out_ptr, rows, cols, row_ok, col_ok,
                    stride_om, stride_pm, stride_ps, HAS_BIAS: tl.constexpr,
                    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A program's fp32 output tile [BM, BN] (grid: column tiles, K slices, row tiles), with
        the bias, stored; with a K split, as its slice's partial (also ``fp8_skinny``'s)."""
        omask = row_ok[:, None] & col_ok[None, :]
        if SPLIT > 1:
            # fp32 partials [SPLIT, M, N]; the tile's last slice to finish (its counter) adds
            # them in slice order (deterministic: the order never depends on who came last),
            # writes the output and re-arms the counter for the next launch or graph replay
            part = part_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :]
            tl.store(part + tl.program_id(1).to(tl.int64) * stride_ps, acc, mask=omask)
            tl.debug_barrier()                         # every thread's partial is written
            cnt = cnt_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
            if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                acc = split_sum(part, stride_ps, omask, SPLIT, BLOCK_M, BLOCK_N)
                _store_out(acc, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om, HAS_BIAS)
                tl.atomic_xchg(cnt, 0)
        else:
            _store_out(acc, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om, HAS_BIAS)

    @triton.jit
    def _store_out(acc, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om,
                   HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=omask)



def weight_only_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """PyTorch reference: x [..., K] -> [..., N] with the weight dequantized to x's dtype."""
    w = dequantize(qweight, scales, bits, x.dtype)
    if bias is None:
        return F.linear(x, w)
    return (F.linear(x, w).float() + bias.float()).to(x.dtype)


# ------------------------------------------------------------------------------------ Triton
def weight_only_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None, bits: int, config: dict | None = None
                       ) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> [M, N] in x's dtype, as ``weight_only_reference``. An int32
    ``qweight`` is int4 words (``quant_decode.interleave_int4``): read by the word read (``JOIN``
    3, K tiles of ``WORD_TILE``) whatever the tiles say otherwise."""
    check(HAS_TRITON, "quant_gemm: triton is not importable")
    check(bits in INT_BITS, f"quant_gemm: bits must be one of {INT_BITS}, got {bits}")
    check(x.dim() == 2 and x.stride(1) == 1,
          f"quant_gemm: x must be [M, K] with contiguous rows, got {describe(x)} strides "
          f"{x.stride()}")
    check_dtype("quant_gemm: x", x, FLOAT_DTYPES)
    M, K = x.shape
    N = qweight.shape[0]
    words = qweight.dtype == torch.int32 and bits == 4
    if words:                                  # (the kernel takes the words' bytes)
        qweight = qweight.view(torch.uint8)
    want = (torch.int8, FP8) if bits == 8 else (torch.uint8, torch.int32)
    check(qweight.dtype in want and qweight.dim() == 2 and qweight.is_contiguous()
          and qweight.shape[1] * (8 // bits) == K,
          f"quant_gemm: a {bits}-bit qweight must be a contiguous {' or '.join(map(str, want))} "
          f"[N, {K * bits // 8}], got {describe(qweight)}")
    check(scales.dim() == 2 and scales.shape[0] == N and scales.shape[1] >= 1
          and K % scales.shape[1] == 0 and scales.stride(1) == 1,
          f"quant_gemm: scales must be [N={N}, K / group] with K = {K}, got {describe(scales)}")
    check(bias is None or (bias.shape == (N,) and bias.is_contiguous()),
          f"quant_gemm: bias must be None or [N={N}], got {describe(bias)}")
    check_device("quant_gemm", INTERPRET, x, qweight, scales)
    group = K // scales.shape[1]
    # (a partial config, e.g. a hand-edited tuned file, fills its gaps from the defaults)
    cfg = {**default_config(M, N, K, group, _num_sms(x.device)),
           **(config or tuned_config(M, N, K, group, bits, x.device, code_name(qweight, bits))
              or {}), **(WORD_READ if words else {})}
    check(cfg["BLOCK_K"] >= 32 and cfg["BLOCK_K"] & (cfg["BLOCK_K"] - 1) == 0,
          f"quant_gemm: BLOCK_K must be a power of 2 >= 32, got {cfg['BLOCK_K']}")
    check(cfg.get("JOIN") != 3 or (bits == 4 and cfg["BLOCK_K"] == quant_decode.WORD_TILE
                                   and quant_decode.takes_words(K, group)
                                   and qweight.data_ptr() % 4 == 0),
          f"quant_gemm: JOIN=3 reads int4 words (quant_decode.interleave_int4): BLOCK_K must be "
          f"{quant_decode.WORD_TILE} and divide the group, words 4-byte aligned; {cfg}, {group}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    tiles = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    cnt = split_counters(x.device, tiles[0] * tiles[1]) if cfg["SPLIT_K"] > 1 else None
    split = cfg["SPLIT_K"] if cnt is not None else 1
    per, split = split_slices(K, split, cfg["BLOCK_K"])   # (slices start on a BLOCK_K boundary)
    grid = (tiles[0], split, tiles[1])
    part = (torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1
            else out)                                     # (unused unless split > 1)
    cnt = out if cnt is None else cnt
    fp8 = qweight.dtype == FP8
    _wq_gemm_kernel[grid](
        x, qweight.view(torch.uint8) if fp8 else qweight, scales,
        bias if bias is not None else scales, out, part, cnt, M, N, K, per,
        x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0, group,
        BITS=bits, HAS_BIAS=bias is not None, SPLIT=split, UPCAST=INTERPRET,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        JOIN=int(cfg.get("JOIN", INT4_READ)) if bits == 4 else 0, FP8=fp8,
        SWAP=int(cfg.get("SWAP", 0)),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **pdl_args(x))
    return out


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """int32 zeros, at least ``n``: the split-K tiles' arrival counters. Every launch leaves
    them at zero (the last slice re-arms its tile's), so one buffer per device serves every GEMM
    of a stream in turn (``skinny_gemm``'s too). Outgrown buffers are kept, never freed: CUDA
    graphs captured with them still point at them. None while a graph is being captured and no
    buffer is large enough (one made inside a capture holds its zeros only after a replay): the
    caller then runs without a K split."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bufs.append(torch.zeros(max(n, 65536), dtype=torch.int32, device=device))
    return bufs[-1]


# NOTE: from this many rows the GEMM is compute-bound and the in-register dequantization is
# repeated for every BLOCK_M rows: dequantizing the weight once (a transient [N, K] copy, read
# packed and written once) and running the dtype's own GEMM is faster. The crossover is from the
# H100 sweep (``benchmarks/step/sweep_quant_gemm.py``).
DEQUANT_MIN_ROWS = 512


def op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
       bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """``x [..., K] -> [..., N]``: Triton on CUDA (the weight-only kernel for skinny steps, a
    dequantized copy and the dtype's GEMM from ``DEQUANT_MIN_ROWS`` rows), the reference
    elsewhere. An int32 ``qweight`` is int4 words (``quant_decode.interleave_int4``): the
    kernel's word read; the dequantized copy and the reference take them as ``unpack`` does."""
    if not use_triton(x, qweight):
        return weight_only_reference(x, qweight, scales, bias, bits)
    lead, N = x.shape[:-1], qweight.shape[0]        # (N, not -1: a view of 0 rows needs it)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    K, group = x2.shape[1], x2.shape[1] // scales.shape[1]
    if batch_invariant_active():          # deterministic: one path and one tile for any rows
        cfg = {**default_config(32, N, K, group, _num_sms(x.device)), "SPLIT_K": 1}
        return weight_only_triton(x2, qweight, scales, bias, bits, cfg).view(*lead, N)
    if x2.shape[0] >= DEQUANT_MIN_ROWS:
        w = dequantize_triton(qweight, scales, bits, x.dtype)       # (words read as words)
        out = F.linear(x2, w) if bias is None else (F.linear(x2, w).float()
                                                    + bias.float()).to(x.dtype)
        return out.view(*lead, N)
    return weight_only_triton(x2, qweight, scales, bias, bits).view(*lead, N)
