"""Greedy proposal from logits: per row, (argmax skipping one id, softmax probability of it).

``decoding.sampling.propose`` at temperature 0 does, in PyTorch, ``logits.float()``, a clone with
the MASK column set to -inf, ``argmax``, ``softmax`` and ``gather``: about 7 passes over an
``[N, V]`` float32 tensor (LLaDA: V = 126,464, so 1 GB per pass at N = 2,048, a batch-64 step).
This kernel reads the (bf16) logits once: one program per row walks the vocab in ``BLOCK``
columns keeping the running max ``m`` and ``S = sum exp(l - m)`` over *all* ids (the excluded id
stays in the normaliser, as the softmax does) and the best logit/first index over the allowed ids.

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
    use_triton,
)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _argmax_conf_kernel(x_ptr, tok_ptr, conf_ptr, V, stride_x, exclude,
                            BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        idx = tl.zeros([], tl.int32)
        for v0 in range(0, V, BLOCK):
            c = v0 + cols
            ok = c < V
            x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(ok, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
            allowed = tl.where(c == exclude, float("-inf"), x)
            cb = tl.max(allowed, axis=0)
            ci = tl.min(tl.where(allowed == cb, c, 2147483647), axis=0)
            take = cb > best                    # strictly: an earlier chunk keeps its tie
            idx = tl.where(take, ci, idx)
            best = tl.where(take, cb, best)
        tl.store(tok_ptr + row, idx.to(tl.int64))
        tl.store(conf_ptr + row, tl.exp(best - m) / s)


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


def argmax_confidence_triton(logits: torch.Tensor, exclude: int | None = None, block: int = 4096
                             ) -> tuple[torch.Tensor, torch.Tensor]:
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
    if N:
        _argmax_conf_kernel[(N,)](logits, token, conf, V, logits.stride(0),
                                  -1 if exclude is None else int(exclude),
                                  BLOCK=block, num_warps=8)
    return token, conf


def op(logits: torch.Tensor, exclude: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, confidence) of each row; Triton on CUDA, else the reference."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        return argmax_confidence_triton(logits, exclude)
    return argmax_confidence_reference(logits, exclude)
