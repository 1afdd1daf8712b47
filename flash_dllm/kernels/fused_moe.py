"""Fused mixture-of-experts: routed SwiGLU experts as two grouped GEMMs over expert-sorted pairs.

``op(x, w_gate_up, w_down, topk_ids, topk_weights)``: ``x [T, d]``; ``w_gate_up [E, 2I, d]`` (rows
``0..I-1`` gate, ``I..2I-1`` up, as ``nn.Linear`` weights); ``w_down [E, d, I]``; ``topk_ids
[T, k]`` int32/int64; ``topk_weights [T, k]`` float32 (already scaled). Returns ``out [T, d]`` in
x's dtype, ``out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, j]``.
Rounding points (the reference has the same): GEMMs accumulate in fp32, SwiGLU in fp32, ``h`` is
rounded once to x's dtype (the down GEMM's tensor-core input), the weighted sum over the k slots
is fp32, rounded once. An id outside ``[0, E)`` contributes nothing (expert parallelism marks a
non-local expert -1); ids are never range-checked on the device (that would be a host sync).

Launches (no host sync, every grid from host sizes: the layer can be captured in a CUDA graph):
1. ``_count_kernel`` + ``_place_kernel`` (alignment, like vLLM / SGLang's
   ``moe_align_block_size``): the ``P = T*k`` pairs sorted by expert (stable: pair order inside a
   group) into ``sorted_ids [cap]``, each expert's group padded to a multiple of ``BLOCK_M`` with
   the sentinel ``P``; ``block_expert [cap / BLOCK_M]``; ``total [1]`` (the padded length).
   ``cap = capacity(P, E, BLOCK_M) >= P + min(E, P) * (BLOCK_M - 1)``, a static bound; programs
   past ``total`` exit at once. (``moe_align_reference`` is the same in torch ops, ~15 launches.)
2. ``_gate_up_kernel``: one program per (block of BLOCK_M sorted pairs, BLOCK_N columns of h):
   gathers the block's x rows, streams the gate and up rows of its expert, SwiGLU in the epilogue;
   writes ``h [cap, I]`` once, by sorted position (so the down GEMM reads it contiguously).
3. ``_down_kernel``: ``h @ w_down[e]^T`` per block, times the pair's mixing weight (epilogue).
4. ``_sum_kernel``: ``out[t] = sum_j buf[t*k + j]`` in slot order, cast once.
Grids are 1-D with the column tile fastest: the programs of one row block run together (its x / h
tile is read once from HBM) and so do an expert's consecutive blocks (its weights are read once).

NOTE (combine): the down GEMM writes one fp32 row per pair (``buf [P, d]``) and ``_sum_kernel``
adds a token's k rows in a fixed order: deterministic, no zero-fill. The alternative
(``combine="atomic"``: fp32 ``atomic_add`` into a zeroed ``[T, d]``, then a cast) saves the round
trip of ``buf``, 2 * P * d * 4 bytes: at T = 32 that is 4.2 MB next to the ~1 GB of weights
(0.4 %, ~1.4 us on an H100), at T = 2048 it is 268 MB next to 1.61 GB (+17 % bytes, ~0.07 ms
predicted) - but the order of a token's k additions then changes from run to run, and with it the
last bit of the output. Deterministic is the default (DESIGN: keep a deterministic path); the
benchmark measures both.

NOTE (batch invariance): the tiles follow the mean rows per expert (``default_config``); a row's
reduction order over d / I follows BLOCK_K and the MMA instruction that BLOCK_M selects, so the
same token can differ in its last bits between a batch-1 and a batch-64 step. Pass one ``config``
to ``fused_moe_triton`` for bit-stable answers across batch sizes.

Floors of one LLaDA2-mini MoE layer (d 2048, I 512, E 256, k 8; bf16; an expert is 3 * 512 *
2048 weights = 6.29 MB, all 256 are 1.61 GB; H100 copy 3.0 TB/s, H200 4.22 TB/s, ~800 TFLOP/s):

| T (batch x 32) | experts touched (uniform) | weight bytes | FLOPs | floor H100 / H200 |
|---|---|---|---|---|
| 32 | 256 (1 - (1 - 8/256)^32) = 163.3 | 1.03 GB | 1.6 G | 0.342 / 0.243 ms (bytes) |
| 256 | 255.9 | 1.61 GB | 12.9 G | 0.537 / 0.382 ms (bytes) |
| 2048 | 256 | 1.61 GB (+ x, h, buf 0.31 GB) | 103 G | 0.537 / 0.382 ms (bytes) |

Even at T = 2048 an expert sees 64 rows: 64 FLOPs per weight byte, under the H100's ridge of
~265, so every regime here is bound by reading the weights; the grouped GEMM must stream each
touched expert once at close to the copy rate. Tiles: small T (<= 16 rows per expert on average)
BLOCK_M 16 (a block holds ~1.6 real rows at T = 32), wide BLOCK_N/K and a deep pipeline, no
split-K (163 experts x 8 column tiles already give ~1,300 programs of 512 KB each); large T
BLOCK_M 32 / 64 for tensor-core tiles. Predictions (H100): T = 32 at 1.2-1.5x its floor (0.41 to
0.51 ms); the per-expert loop, eager (its per-expert counts need a host sync, so no graph), ~8
launches for each of 163 experts, 4-8 ms: >= 8x. T = 2048: 0.8-1.0 ms against a 10+ ms loop.

Shared expert: store it as expert ``E`` of the stacked weights and route every token to it with
weight 1 (``with_shared_expert``): it streams in the same grid and sums in the same pass (no
extra launches, which is what pays at batch 1). A shared expert of width ``n * I`` is ``n``
experts of width ``I`` (SwiGLU is separable by columns).

NOTE (size): just over 400 lines for one op: five kernels that share the alignment's layout
(sorted_ids / block_expert / total), their launcher, the reference, the alignment's reference
and the per-expert baseline the benchmark compares against. Split it only if a kernel joins.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    INT_DTYPES,
    batch_invariant_active,
    check,
    check_device,
    check_dtype,
    interpreting,
    next_pow2,
    pdl_args,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported
FP32_PRECISION = "tf32x3"   # fp32 inputs: ~fp32 products on tensor cores (paged_attention's note)
CONFIG_KEYS = ("BLOCK_M", "GU_N", "GU_K", "DN_N", "DN_K", "num_warps", "num_stages")
_SCAN = 512                 # pairs per step of the alignment kernels' scans

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait

    @triton.jit
    def _count_kernel(ids_ptr, counts_ptr, P, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        e = tl.program_id(0)
        acc = tl.zeros([BLOCK_P], tl.int32)
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            acc += (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
        tl.store(counts_ptr + e, tl.sum(acc, axis=0))

    @triton.jit
    def _place_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ptr, total_ptr, P, E,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                      PDL: tl.constexpr):
        pdl_wait(PDL)
        e = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.sum(tl.where(offs_e == e, tl.cumsum(padded, axis=0), 0), axis=0)
        start = end - tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
        filled = start + tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
        if e == 0:
            tl.store(total_ptr, tl.sum(padded, axis=0))
        base = start                       # this expert's pairs, in pair order
        for p0 in range(0, P, BLOCK_P):
            offs = p0 + tl.arange(0, BLOCK_P)
            mine = (tl.load(ids_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
            tl.store(sorted_ptr + base + tl.cumsum(mine, axis=0) - 1, offs, mask=mine > 0)
            base += tl.sum(mine, axis=0)
        pad = filled + tl.arange(0, BLOCK_M)   # < BLOCK_M padding slots close the group
        tl.store(sorted_ptr + pad, P, mask=pad < end)
        for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_P):
            offs_b = b0 + tl.arange(0, BLOCK_P)
            tl.store(expert_ptr + offs_b, e, mask=offs_b < end // BLOCK_M)

    @triton.jit
    def _tile(ptrs, row_ok, offs_k, k_left, EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
        # NOTE: with EVEN_K the K mask is dropped: a per-column mask would stop the loads from
        # being vectorised; the row mask is constant along K and costs nothing
        if EVEN_K:
            t = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            t = tl.load(ptrs, mask=row_ok[:, None] & (offs_k < k_left)[None, :], other=0.0)
        if UPCAST:         # the interpreter's half-precision tl.dot is wrong (Triton 3.9)
            t = t.to(tl.float32)
        return t

    @triton.jit
    def _rows(pid_m, sorted_ptr, expert_ptr, P, BLOCK_M: tl.constexpr):
        """Row block ``pid_m``: (expert, sorted positions, pair ids, real-row mask)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        return tl.load(expert_ptr + pid_m).to(tl.int64), offs_m, pair, pair < P

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, h_ptr, sorted_ptr, expert_ptr, total_ptr, P, TOPK, D, I,
                        stride_xt, stride_we, stride_wn, stride_ht, num_n,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_m = tl.program_id(0) // num_n
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return                         # past the last group: the grid is only a bound
        e, offs_m, pair, m_ok = _rows(pid_m, sorted_ptr, expert_ptr, P, BLOCK_M)
        pid_n = tl.program_id(0) % num_n
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        tok = (pair // TOPK).to(tl.int64)
        x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
        g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        u_ptrs = g_ptrs + I * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = _tile(x_ptrs, m_ok, offs_k, D - k0, EVEN_K, UPCAST)                # [BM, BK]
            acc_g = tl.dot(a, tl.trans(_tile(g_ptrs, n_ok, offs_k, D - k0, EVEN_K, UPCAST)),
                           acc_g, input_precision=PREC)
            acc_u = tl.dot(a, tl.trans(_tile(u_ptrs, n_ok, offs_k, D - k0, EVEN_K, UPCAST)),
                           acc_u, input_precision=PREC)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u              # SwiGLU in fp32, rounded once
        tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + offs_n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, out_ptr, tw_ptr, sorted_ptr, expert_ptr, total_ptr, P, TOPK,
                     D, I, stride_ht, stride_we, stride_wn, stride_ot, num_n,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                     ATOMIC: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        pid_m = tl.program_id(0) // num_n
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        e, offs_m, pair, m_ok = _rows(pid_m, sorted_ptr, expert_ptr, P, BLOCK_M)
        pid_n = tl.program_id(0) % num_n
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < D
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_ht + offs_k[None, :]
        w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, I, BLOCK_K):
            acc = tl.dot(_tile(h_ptrs, m_ok, offs_k, I - k0, EVEN_K, UPCAST),
                         tl.trans(_tile(w_ptrs, n_ok, offs_k, I - k0, EVEN_K, UPCAST)),
                         acc, input_precision=PREC)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(tw_ptr + pair, mask=m_ok, other=0.0)[:, None]        # mixing weight
        ok = m_ok[:, None] & n_ok[None, :]
        if ATOMIC:      # out [T, D] fp32, zeroed: a token's k slots meet here in any order
            row = (pair // TOPK).to(tl.int64)
            tl.atomic_add(out_ptr + row[:, None] * stride_ot + offs_n[None, :], acc, mask=ok)
        else:           # out [P, D] fp32: one row per pair, summed in slot order by _sum_kernel
            tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :], acc,
                     mask=ok)

    @triton.jit
    def _sum_kernel(buf_ptr, ids_ptr, out_ptr, TOPK, E, D, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        c_ok = cols < D
        acc = tl.zeros([BLOCK], tl.float32)
        for j in range(TOPK):
            e = tl.load(ids_ptr + t * TOPK + j)
            lim = tl.where((e >= 0) & (e < E), D, 0)    # an unplaced pair's row is never written
            acc += tl.load(buf_ptr + (t * TOPK + j) * D + cols, mask=cols < lim, other=0.0)
        tl.store(out_ptr + t * D + cols, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def _check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    """(T, d, E, I, k) after checking the operands' shapes and dtypes against the contract."""
    check(x.dim() == 2, f"fused_moe: x must be [T, d], got {tuple(x.shape)}")
    T, d = x.shape
    check(w_gate_up.dim() == 3 and w_gate_up.shape[1] % 2 == 0 and w_gate_up.shape[2] == d,
          f"fused_moe: w_gate_up must be [E, 2I, {d}], got {tuple(w_gate_up.shape)}")
    E, I = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    check(tuple(w_down.shape) == (E, d, I),
          f"fused_moe: w_down must be [{E}, {d}, {I}], got {tuple(w_down.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T,
          f"fused_moe: topk_ids must be [{T}, k], got {tuple(topk_ids.shape)}")
    check(tuple(topk_weights.shape) == tuple(topk_ids.shape),
          f"fused_moe: topk_weights must be {tuple(topk_ids.shape)}, got "
          f"{tuple(topk_weights.shape)}")
    check_dtype("fused_moe: x", x, FLOAT_DTYPES)
    check(w_gate_up.dtype == x.dtype and w_down.dtype == x.dtype,
          f"fused_moe: weight dtypes {w_gate_up.dtype} / {w_down.dtype} != x dtype {x.dtype}")
    check_dtype("fused_moe: topk_ids", topk_ids, INT_DTYPES)
    check_dtype("fused_moe: topk_weights", topk_weights, (torch.float32,))
    return T, d, E, I, topk_ids.shape[1]


def fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights) -> torch.Tensor:
    """PyTorch reference (the CPU path): a loop over experts in fp32 with the kernels' rounding
    points (``h`` rounded to x's dtype). Host syncs: fine for a reference."""
    T, d, E, I, _ = _check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)
    out = torch.zeros((T, d), dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(E):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)        # the pairs routed to e
        if tok.numel() == 0:
            continue
        gate, up = (xf[tok] @ w_gate_up[e].float().T).split(I, dim=-1)       # [n, I] each
        h = (F.silu(gate) * up).to(x.dtype).float()
        y = h @ w_down[e].float().T                                          # [n, d]
        out.index_add_(0, tok, y * topk_weights[tok, slot].float()[:, None])
    return out.to(x.dtype)


def per_expert_loop(x, w_gate_up, w_down, topk_ids, topk_weights) -> torch.Tensor:
    """The naive baseline: one host sync for the per-expert counts, then for each expert that has
    pairs: index_select, ``F.linear`` (gate/up), silu * up, ``F.linear`` (down), index_add, in
    x's dtype (cuBLAS on the GPU), summed in fp32. Not capturable in a CUDA graph."""
    T, d, E, _, k = _check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.sort(key, stable=True).indices                       # pairs by expert
    counts = torch.bincount(key, minlength=E + 1).tolist()             # the host sync
    weights = topk_weights.reshape(-1)
    out = torch.zeros((T, d), dtype=torch.float32, device=x.device)
    start = 0
    for e in range(E):
        pairs = order[start:start + counts[e]]
        start += counts[e]
        if counts[e] == 0:
            continue
        tok = pairs // k
        gate, up = F.linear(x.index_select(0, tok), w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])
        out.index_add_(0, tok, y.float() * weights[pairs, None])
    return out.to(x.dtype)


def with_shared_expert(topk_ids, topk_weights, shared_id: int):
    """Routes every token also to expert ``shared_id`` (the shared expert stored as one more
    expert of the stacked weights) with weight 1: ``[T, k]`` -> ``[T, k + 1]``."""
    col = torch.full_like(topk_ids[:, :1], shared_id)
    return (torch.cat([topk_ids, col], dim=1),
            torch.cat([topk_weights, torch.ones_like(topk_weights[:, :1])], dim=1))


def capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded length: each non-empty group adds < block_m padding slots."""
    return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m * block_m


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """The alignment in torch ops (static shapes, no host sync): -> ``sorted_ids [cap]`` int32
    (pair indices ``t * k + j`` grouped by expert, in pair order inside a group, each group
    padded to a multiple of ``block_m`` with ``P``; slots past the total are ``P``),
    ``block_expert [cap / block_m]`` int32 (``E`` past the total), ``total [1]`` int32."""
    P, E, dev = topk_ids.numel(), num_experts, topk_ids.device
    cap = capacity(P, E, block_m)
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)             # invalid ids: never placed
    order = torch.sort(key, stable=True).indices                        # [P]
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(
        0, key, torch.ones_like(key))                                   # [E + 1]
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)                                             # [E] padded group ends
    skey = key[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[skey]   # place in group
    starts = torch.cat([ends - padded, ends.new_full((1,), cap)])       # invalid: a dump slot
    dest = torch.where(skey < E, starts[skey] + rank, cap)
    sorted_ids = torch.full((cap + 1,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    blocks = torch.arange(cap // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)
    total = ends[-1:] if E else torch.zeros(1, dtype=torch.long, device=dev)
    return sorted_ids[:cap], block_expert, total.to(torch.int32)


def moe_align_triton(ids: torch.Tensor, num_experts: int, block_m: int):
    """``moe_align_reference`` in two launches over flat contiguous ``ids [P]``; slots and block
    entries past ``total`` are left unwritten (the GEMM programs there exit at once)."""
    P, E, dev = ids.numel(), num_experts, ids.device
    check(ids.dim() == 1 and ids.is_contiguous(), "moe_align: ids must be flat and contiguous")
    check(block_m >= 1 and block_m & (block_m - 1) == 0,
          f"moe_align: block_m must be a power of 2, got {block_m}")
    cap = capacity(P, E, block_m)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    block_expert = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)      # written by program 0
    if P == 0 or E == 0:
        return sorted_ids, block_expert, total.zero_()
    counts = torch.empty(E, dtype=torch.int32, device=dev)
    pdl = pdl_args(ids)
    _count_kernel[(E,)](ids, counts, P, BLOCK_P=_SCAN, num_warps=4, **pdl)
    _place_kernel[(E,)](ids, counts, sorted_ids, block_expert, total, P, E, BLOCK_M=block_m,
                        BLOCK_P=_SCAN, BLOCK_E=max(16, next_pow2(E)), num_warps=4, **pdl)
    return sorted_ids, block_expert, total


def default_config(T: int, k: int, E: int) -> dict:
    """Tiles from host sizes only (one variant per bucket, static for a CUDA graph), by the
    mean rows per expert: few -> stream weights (BLOCK_M 16, deep pipeline); many -> MMA tiles."""
    rows = T * k / max(E, 1)
    if rows <= 16:
        tiles = (16, 64, 128, 128, 128, 4, 4)
    elif rows <= 48:
        tiles = (32, 64, 64, 128, 64, 4, 4)
    else:
        tiles = (64, 64, 64, 128, 64, 4, 3)
    return dict(zip(CONFIG_KEYS, tiles))


# one config for every batch under ``batch_invariant_launches`` (deterministic): a row's sums
# then follow no other row's count (the middle bucket of ``default_config``)
INVARIANT_CONFIG = dict(zip(CONFIG_KEYS, (32, 64, 64, 128, 64, 4, 4)))


def _resolve_config(T: int, k: int, E: int, config: dict | None) -> dict:
    cfg = dict(INVARIANT_CONFIG) if batch_invariant_active() else default_config(T, k, E)
    unknown = sorted(set(config or {}) - set(CONFIG_KEYS))
    check(not unknown, f"fused_moe: unknown config keys {unknown}; known: {CONFIG_KEYS}")
    cfg.update(config or {})
    for key in ("BLOCK_M", "GU_N", "GU_K", "DN_N", "DN_K"):
        v = cfg[key]
        check(isinstance(v, int) and v >= 16 and v & (v - 1) == 0,
              f"fused_moe: {key} must be a power of 2 >= 16 (tl.dot), got {v!r}")
    return cfg


def fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights, *, config: dict | None = None,
                     combine: str = "sum") -> torch.Tensor:
    """The fused layer (see the module docstring). ``config``: any of ``CONFIG_KEYS`` over
    ``default_config``; ``combine``: "sum" (deterministic) or "atomic"."""
    check(HAS_TRITON, "fused_moe_triton: triton is not importable")
    T, d, E, I, k = _check_shapes(x, w_gate_up, w_down, topk_ids, topk_weights)
    check(combine in ("sum", "atomic"), f"fused_moe: combine must be 'sum' or 'atomic', "
                                        f"got {combine!r}")
    check(x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1,
          f"fused_moe: the last dims must be contiguous, strides x {x.stride()} w_gate_up "
          f"{w_gate_up.stride()} w_down {w_down.stride()}")
    check_device("fused_moe", INTERPRET, x, w_gate_up, w_down, topk_ids, topk_weights)
    cfg = _resolve_config(T, k, E, config)
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    if T == 0 or k == 0 or E == 0 or d == 0:
        return out.zero_()
    P, bm = T * k, cfg["BLOCK_M"]
    ids = topk_ids.contiguous().view(-1)                           # [P], int32 or int64
    tw = topk_weights.contiguous().view(-1)                        # [P] fp32
    sorted_ids, block_expert, total = moe_align_triton(ids, E, bm)
    h = torch.empty((sorted_ids.shape[0], I), dtype=x.dtype, device=x.device)  # [cap, I]
    prec = FP32_PRECISION if x.dtype == torch.float32 else "tf32"
    launch = {"BLOCK_M": bm, "UPCAST": INTERPRET, "PREC": prec, "num_warps": cfg["num_warps"],
              "num_stages": cfg["num_stages"]}
    pdl = pdl_args(x)
    launch.update(pdl)
    blocks, n_gu, n_dn = sorted_ids.shape[0] // bm, -(-I // cfg["GU_N"]), -(-d // cfg["DN_N"])
    _gate_up_kernel[(blocks * n_gu,)](
        x, w_gate_up, h, sorted_ids, block_expert, total, P, k, d, I, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), n_gu, BLOCK_N=cfg["GU_N"],
        BLOCK_K=cfg["GU_K"], EVEN_K=d % cfg["GU_K"] == 0, **launch)
    atomic = combine == "atomic"
    buf = (torch.zeros((T, d), dtype=torch.float32, device=x.device) if atomic
           else torch.empty((P, d), dtype=torch.float32, device=x.device))   # [T | P, d]
    _down_kernel[(blocks * n_dn,)](
        h, w_down, buf, tw, sorted_ids, block_expert, total, P, k, d, I, h.stride(0),
        w_down.stride(0), w_down.stride(1), buf.stride(0), n_dn, BLOCK_N=cfg["DN_N"],
        BLOCK_K=cfg["DN_K"], EVEN_K=I % cfg["DN_K"] == 0, ATOMIC=atomic, **launch)
    if atomic:
        return out.copy_(buf)
    block = min(1024, max(16, next_pow2(d)))
    _sum_kernel[(T, -(-d // block))](buf, ids, out, k, E, d, BLOCK=block, num_warps=4,
                                     **pdl)
    return out


def op(x, w_gate_up, w_down, topk_ids, topk_weights) -> torch.Tensor:
    """The fused MoE: Triton on CUDA tensors, the PyTorch reference otherwise."""
    if use_triton(x, w_gate_up, w_down, topk_ids, topk_weights):
        return fused_moe_triton(x, w_gate_up, w_down, topk_ids, topk_weights)
    return fused_moe_reference(x, w_gate_up, w_down, topk_ids, topk_weights)
