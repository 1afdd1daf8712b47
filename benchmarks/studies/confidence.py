"""Masked confidence: LM head + (argmax, max-prob, entropy) over the vocab in one pass.

STUDY, not used by the engine (moved out of ``flash_dllm/kernels``).
``benchmarks/step/bench_kernels.py`` (``benchmarks/results/step/kernels_h200.json``): 85 % of the
copy rate at 32 rows, but only 376 TFLOP/s at a batch-64 step's 2,048 rows, where the LM head is
compute-bound and cuBLAS runs near the ~790 TFLOP/s matmul rate; the engine keeps the LM head
in cuBLAS and proposes with ``flash_dllm/kernels/argmax_confidence.py``.
Tests: ``python3 -m pytest benchmarks/studies -q``.

Given final-normed hidden rows ``h [N, d]`` (the masked slots only) and the LM head ``W [V, d]``,
returns per row

- ``token``: argmax of the logits, skipping ``exclude`` (the MASK id: the engine never proposes it),
  first index on ties (as ``torch.argmax``);
- ``confidence = exp(logit[token] - logsumexp(all logits))``: the excluded id stays in the
  normaliser, as ``decoding.sampling.propose``'s softmax-then-gather does;
- ``entropy = -sum p log p`` over the whole vocab.

Kernel (no ``[N, V]`` tensor ever reaches HBM): program ``(i, j)`` owns a tile of ``BLOCK_M`` rows
and the j-th contiguous split of the vocab. It walks its split in ``BLOCK_V`` columns; each tile's
logits come from a ``BLOCK_K``-stepped ``tl.dot`` (fp32 accumulate) and are folded at once into
running (max m, S = sum e^(l-m), T = sum e^(l-m)(l-m), best logit, best index). T is kept relative
to the running max so entropy = log S - T/S has no large-magnitude cancellation. A second tiny
kernel merges the splits of a row (logsumexp-style rescale; ties go to the lower split, i.e. the
lower index). The split count is chosen so ~4 programs per SM are in flight: at batch 1 (N ~ 32)
the op is a single streaming read of W (1.04 GB for LLaDA-8B) and must use every SM; rows are the
fastest grid axis so programs that share a W chunk run together and hit L2.
"""
from __future__ import annotations

import functools

import torch

from flash_dllm.kernels._triton import (
    FLOAT_DTYPES,
    HAS_TRITON,
    check,
    check_device,
    check_dtype,
    interpreting,
    next_pow2,
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _confidence_split_kernel(h_ptr, w_ptr, m_ptr, s_ptr, t_ptr, best_ptr, idx_ptr,
                                 N, V, d, stride_h, stride_w, stride_part, v_per_split, exclude,
                                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                                 BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < N
        offs_k = tl.arange(0, BLOCK_K)
        v_begin = pid_s * v_per_split
        v_end = tl.minimum(v_begin + v_per_split, V)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_i = tl.zeros([BLOCK_M], tl.float32)
        t_i = tl.zeros([BLOCK_M], tl.float32)
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_M], tl.int32)
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_mask = cols < v_end
            w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
            acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
            for k0 in range(0, d, BLOCK_K):
                kk = k0 + offs_k
                k_mask = kk < d
                a = tl.load(h_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :],
                            other=0.0)                                        # [BM, BK]
                b = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & k_mask[None, :],
                            other=0.0)                                        # [BV, BK]
                acc += tl.dot(a, tl.trans(b))
            logit = tl.where(col_mask[None, :], acc, float("-inf"))          # [BM, BV]
            # online softmax statistics; every tile has >= 1 valid column so m_new is finite
            m_new = tl.maximum(m_i, tl.max(logit, axis=1))
            alpha = tl.exp(m_i - m_new)
            delta = tl.where(s_i > 0, m_i - m_new, 0.0)      # avoids 0 * -inf on the first tile
            e = tl.exp(logit - m_new[:, None])               # 0 on padded columns
            rel = tl.where(col_mask[None, :], logit - m_new[:, None], 0.0)   # no 0 * -inf
            t_i = (t_i + s_i * delta) * alpha + tl.sum(e * rel, axis=1)
            s_i = s_i * alpha + tl.sum(e, axis=1)
            m_i = m_new
            # argmax without the excluded id, first index on ties
            cand = tl.where(cols[None, :] == exclude, float("-inf"), logit)
            tile_best = tl.max(cand, axis=1)
            tile_idx = tl.min(tl.where(cand == tile_best[:, None], cols[None, :], 2147483647),
                              axis=1)
            better = tile_best > best                          # strict: earlier tiles win ties
            best_idx = tl.where(better, tile_idx, best_idx)
            best = tl.where(better, tile_best, best)
        part = rows * stride_part + pid_s
        tl.store(m_ptr + part, m_i, mask=row_mask)
        tl.store(s_ptr + part, s_i, mask=row_mask)
        tl.store(t_ptr + part, t_i, mask=row_mask)
        tl.store(best_ptr + part, best, mask=row_mask)
        tl.store(idx_ptr + part, best_idx, mask=row_mask)

    @triton.jit
    def _confidence_merge_kernel(m_ptr, s_ptr, t_ptr, best_ptr, idx_ptr, tok_ptr, conf_ptr, ent_ptr,
                                 num_splits, stride_part, BLOCK_S: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        mask = offs < num_splits
        base = row * stride_part + offs
        m = tl.load(m_ptr + base, mask=mask, other=float("-inf"))
        s = tl.load(s_ptr + base, mask=mask, other=0.0)
        t = tl.load(t_ptr + base, mask=mask, other=0.0)
        b = tl.load(best_ptr + base, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + base, mask=mask, other=2147483647)
        m_all = tl.max(m, axis=0)
        dm = tl.where(mask, m - m_all, 0.0)                   # no 0 * -inf on padded splits
        scale = tl.where(mask, tl.exp(dm), 0.0)
        s_all = tl.sum(s * scale, axis=0)
        t_all = tl.sum((t + s * dm) * scale, axis=0)
        log_s = tl.log(s_all)
        b_all = tl.max(b, axis=0)
        i_all = tl.min(tl.where(b == b_all, idx, 2147483647), axis=0)
        tl.store(tok_ptr + row, i_all.to(tl.int64))
        tl.store(conf_ptr + row, tl.exp(b_all - m_all - log_s))
        tl.store(ent_ptr + row, log_s - t_all / s_all)


def confidence_reference(h: torch.Tensor, weight: torch.Tensor, exclude: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, d], weight [V, d] -> (token [N] int64, confidence [N] fp32, entropy [N] fp32)."""
    logits = h.float() @ weight.float().t()                   # [N, V]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    choose = logits
    if exclude is not None:
        choose = logits.clone()
        choose[:, exclude] = float("-inf")
    token = choose.argmax(dim=-1)
    confidence = logp.gather(-1, token[:, None]).squeeze(-1).exp()
    return token, confidence, entropy


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def confidence_triton(h: torch.Tensor, weight: torch.Tensor, exclude: int | None = None, *,
                      block_m: int | None = None, block_v: int = 128, block_k: int = 64,
                      num_splits: int | None = None, num_warps: int = 4, num_stages: int = 4
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, d], weight [V, d] (same float dtype, rows contiguous) -> (token, confidence, entropy).

    The keyword-only knobs are tiling choices (benchmarks sweep them); defaults suit an H200.
    """
    check(HAS_TRITON, "confidence_triton: triton is not importable")
    check(h.dim() == 2 and weight.dim() == 2,
          f"confidence: h must be [N, d] and weight [V, d], got {tuple(h.shape)} and "
          f"{tuple(weight.shape)}")
    N, d = h.shape
    V = weight.shape[0]
    check(weight.shape[1] == d, f"confidence: weight is [V, {weight.shape[1]}] but h has d={d}")
    check_dtype("confidence: h", h, FLOAT_DTYPES)
    check(weight.dtype == h.dtype, f"confidence: weight dtype {weight.dtype} != h dtype {h.dtype}")
    check(h.stride(1) == 1 and weight.stride(1) == 1,
          f"confidence: last dims must be contiguous, strides h {h.stride()} weight "
          f"{weight.stride()}")
    check(V < 2 ** 31 - 1, f"confidence: V={V} does not fit int32 indices")
    check(exclude is None or 0 <= exclude < V, f"confidence: exclude={exclude} not in [0, {V})")
    check_device("confidence", INTERPRET, h, weight)
    dev = h.device
    token = torch.empty(N, dtype=torch.int64, device=dev)
    conf = torch.empty(N, dtype=torch.float32, device=dev)
    ent = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return token, conf, ent
    if block_m is None:
        block_m = 16 if N <= 16 else (32 if N <= 32 else 64)
    row_tiles = -(-N // block_m)
    v_tiles = -(-V // block_v)
    if num_splits is None:
        sms = _num_sms(dev.index if dev.type == "cuda" and dev.index is not None else 0)
        num_splits = max(1, min(v_tiles, -(-4 * sms // row_tiles)))
    # every split is a whole number of tiles and none is empty
    v_per_split = -(-v_tiles // num_splits) * block_v
    num_splits = -(-V // v_per_split)
    part = torch.empty((4, N, num_splits), dtype=torch.float32, device=dev)  # m, S, T, best
    idx = torch.empty((N, num_splits), dtype=torch.int32, device=dev)
    _confidence_split_kernel[(row_tiles, num_splits)](
        h, weight, part[0], part[1], part[2], part[3], idx, N, V, d, h.stride(0),
        weight.stride(0), num_splits, v_per_split, -1 if exclude is None else int(exclude),
        BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k, num_warps=num_warps,
        num_stages=num_stages)
    _confidence_merge_kernel[(N,)](
        part[0], part[1], part[2], part[3], idx, token, conf, ent, num_splits, num_splits,
        BLOCK_S=next_pow2(num_splits), num_warps=4)
    return token, conf, ent


def op(h: torch.Tensor, weight: torch.Tensor, exclude: int | None = None
       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token [N] int64, confidence [N] fp32, entropy [N] fp32); Triton on CUDA, else reference."""
    if use_triton(h, weight) and h.dim() == 2 and h.stride(1) == 1 and weight.stride(1) == 1 \
            and h.dtype == weight.dtype:
        return confidence_triton(h, weight, exclude)
    return confidence_reference(h, weight, exclude)
