"""Greedy proposal from logits: per row, (argmax skipping one id, softmax probability of it).

``decoding.sampling.propose`` at temperature 0 does, in PyTorch, ``logits.float()``, a clone with
the MASK column set to -inf, ``argmax``, ``softmax`` and ``gather``: about 7 passes over an
``[N, V]`` float32 tensor (LLaDA: V = 126,464, so 1 GB per pass at N = 2,048, a batch-64 step).
This kernel reads the (bf16) logits once: each row is split into chunks of ``CHUNK`` ids, one
program each, walking its chunk in ``BLOCK`` columns keeping the running max ``m`` and
``S = sum exp(l - m)`` over *all* ids (the excluded id stays in the normaliser, as the softmax
does) and the best logit/first index over the allowed ids; a second small kernel merges a row's
chunks in chunk order. The chunking follows V only, never the number of rows: a row's answer is
bitwise the same in any batch (batch invariance).

``confidence = exp(best - m) / S`` is the same formula as ``softmax(...).gather(...)`` in float32,
up to summation order; ties go to the lowest index, as ``torch.argmax``'s do.

The LM head GEMM stays in cuBLAS: at N = 2,048 it is compute-bound and cuBLAS is faster than the
fused LM-head kernel (``benchmarks/studies/confidence.py``, measured in
``benchmarks/results/step/kernels_h200.json``).
"""
from __future__ import annotations

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
    def _argmax_conf_kernel(x_ptr, part_ptr, idx_ptr, V, stride_x, exclude, CHUNK,
                            NCP: tl.constexpr, BLOCK: tl.constexpr):
        """Row ``program_id(0)``'s chunk ``program_id(1)`` of ``CHUNK`` ids: its running max
        ``m``, ``S = sum exp(l - m)`` and best allowed logit / first index, into the row's slot."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.zeros([], tl.int32)
        v_end = tl.minimum(V, (chunk + 1) * CHUNK)
        for v0 in range(chunk * CHUNK, v_end, BLOCK):
            c = v0 + cols
            ok = c < v_end
            x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
            allowed = tl.where(c == exclude, float("-inf"), x)
            cb = tl.max(allowed, axis=0)
            ci = tl.min(tl.where(allowed == cb, c, 2147483647), axis=0)
            take = cb > best                    # strictly: an earlier block keeps its tie
            idx = tl.where(take, ci, idx)
            best = tl.where(take, cb, best)
        slot = part_ptr + (row * NCP + chunk) * 3
        tl.store(slot, m)
        tl.store(slot + 1, s)
        tl.store(slot + 2, best)
        tl.store(idx_ptr + row * NCP + chunk, idx)

    @triton.jit
    def _merge_kernel(part_ptr, idx_ptr, tok_ptr, conf_ptr, NC, NCP: tl.constexpr):
        """A row's chunks, in chunk order: ``M = max m``, ``S = sum S_c exp(m_c - M)``, the best
        logit and its lowest index (chunks hold ascending ids; each keeps its first tie)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NCP)
        ok = c < NC
        slot = part_ptr + (row * NCP + c) * 3
        m = tl.load(slot, mask=ok, other=float("-inf"))
        s = tl.load(slot + 1, mask=ok, other=0.0)
        best = tl.load(slot + 2, mask=ok, other=float("-inf"))
        idx = tl.load(idx_ptr + row * NCP + c, mask=ok, other=2147483647)
        big_m = tl.max(m, axis=0)
        total = tl.sum(tl.where(ok, s * tl.exp(m - big_m), 0.0), axis=0)
        b = tl.max(best, axis=0)
        i = tl.min(tl.where(best == b, idx, 2147483647), axis=0)
        tl.store(tok_ptr + row, i.to(tl.int64))
        tl.store(conf_ptr + row, tl.exp(b - big_m) / total)


def argmax_confidence_reference(logits: torch.Tensor, exclude: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] -> (token [N] int64, confidence [N] float32), as ``propose`` at T = 0."""
    logits = logits.float()
    choose = logits
    if exclude is not None:
        choose = logits.clone()
        choose[:, exclude] = float("-inf")
    token = choose.argmax(dim=-1)
    return token, torch.softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)


# Ids per program: a row is split into ``ceil(V / CHUNK)`` programs whatever the batch (LLaDA's
# 126,464 ids: 16), so a few-row step (SDAR's block of 4) is not 4 programs each walking the whole
# vocab (56 us on an H100), and a row's answer never depends on how many rows came with it.
CHUNK = 8192


def argmax_confidence_triton(logits: torch.Tensor, exclude: int | None = None, block: int = 4096,
                             chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    check(HAS_TRITON, "argmax_confidence: triton is not importable")
    check(logits.dim() == 2, f"argmax_confidence: logits must be [N, V], got {tuple(logits.shape)}")
    check_dtype("argmax_confidence: logits", logits, FLOAT_DTYPES)
    check(logits.stride(1) == 1, f"argmax_confidence: rows must be contiguous, strides "
                                 f"{logits.stride()}")
    N, V = logits.shape
    check(V < 2 ** 31 - 1, f"argmax_confidence: V={V} does not fit int32 indices")
    check(exclude is None or 0 <= exclude < V,
          f"argmax_confidence: exclude={exclude} not in [0, {V})")
    check_device("argmax_confidence", INTERPRET, logits)
    token = torch.empty(N, dtype=torch.int64, device=logits.device)
    conf = torch.empty(N, dtype=torch.float32, device=logits.device)
    check(block >= 16 and block & (block - 1) == 0 and chunk >= block and chunk % block == 0,
          f"argmax_confidence: block must be a power of 2 >= 16 dividing chunk, got block "
          f"{block}, chunk {chunk}")
    if N:
        nc = -(-V // chunk)
        ncp = max(2, next_pow2(nc))
        part = torch.empty(N, ncp, 3, dtype=torch.float32, device=logits.device)
        idx = torch.empty(N, ncp, dtype=torch.int32, device=logits.device)
        _argmax_conf_kernel[(N, nc)](logits, part, idx, V, logits.stride(0),
                                     -1 if exclude is None else int(exclude), chunk, NCP=ncp,
                                     BLOCK=block, num_warps=8)
        _merge_kernel[(N,)](part, idx, token, conf, nc, NCP=ncp, num_warps=1)
    return token, conf


def op(logits: torch.Tensor, exclude: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, confidence) of each row; Triton on CUDA, else the reference."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return argmax_confidence_triton(logits, exclude)
    return argmax_confidence_reference(logits, exclude)
