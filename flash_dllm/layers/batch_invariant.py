"""Batch-invariant row GEMMs: a token's result does not depend on how many other rows share its
GEMM (``EngineConfig.deterministic``; issue 44, cause (a)).

A step runs every token-wise GEMM (q/k/v, o, gate/up, down, the router, the MoE experts, the LM
head) once over the rows of the whole batch.

- **CPU.** The CPU BLAS picks its kernel and splits the rows over threads by the row count:
  measured with torch's CPU GEMM, a row multiplied alone (or with up to ~11 others, at 2
  threads) differs in the last bits from the same row inside a larger GEMM. Padding the rows to a
  multiple of ``ROW_MULTIPLE`` (at least one such tile) made every row's result equal to its
  padded solo result, for any row count and offset, at 1, 2 and 4 threads
  (``tests/test_same_answer.py::test_padded_cpu_gemm_is_row_invariant``).
- **GPU.** cuBLAS chooses tiles and split-K by shape, so padding is not enough: the mode sends the
  step's ``F.linear`` and 2-D ``@`` to ``kernels/fixed_gemm`` (one tile for every shape, K walked
  in order), and sets ``kernels._triton.batch_invariant_launches`` so the other dispatchers pick
  shape-independent tiles and paths too (paged attention: no key split, a fixed query tile; the
  fused MoE: one config; the quantized GEMM: one config and never the many-rows path; the fused
  q/k/v + RoPE kernel is not used). Tested under the Triton interpreter; whether the GPU's
  answers are bitwise batch-invariant, and what it costs, is for ``tests/gpu`` and run_gpu.sh's
  ``deterministic`` group (not run yet). Not covered: fp8 weights (refused by the runner),
  verify's batched draft attention, tensor parallelism's all-reduce (docs/serving.md).

``batch_invariant()`` is a ``TorchFunctionMode`` that applies the above to ``F.linear`` and to
2-D ``@`` / ``torch.matmul`` (a ``[rows, d]`` times a weight). The attention matmuls (3-D and up)
are per request on the CPU path already and are left alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from flash_dllm.kernels import fixed_gemm
from flash_dllm.kernels._triton import batch_invariant_launches, use_triton

ROW_MULTIPLE = 16


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """``x`` ([rows, d]) with zero rows appended up to a multiple of ``multiple`` (>= one)."""
    rows = x.shape[0]
    padded = max(multiple, -(-rows // multiple) * multiple)
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])    # [padded, d]


class batch_invariant(TorchFunctionMode):
    """Within the block, 2-D row GEMMs run on rows padded to ``ROW_MULTIPLE`` on the CPU and on
    ``fixed_gemm`` on CUDA, and the kernels' dispatchers make batch-invariant choices (see the
    module)."""

    _LINEAR = (F.linear,)
    _MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __enter__(self):
        self._launches = batch_invariant_launches().__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._launches.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._LINEAR or func in self._MATMUL:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() == 2
                    and x.dtype == w.dtype and use_triton(x, w)):      # (CUDA tensors)
                if func in self._LINEAR:
                    bias = args[2] if len(args) > 2 else kwargs.get("bias")
                    return fixed_gemm.op(x, w, bias)
                if x.dim() >= 2 and w.t().is_contiguous():    # h @ W.t(): the LM head
                    return fixed_gemm.op(x, w.t())
            if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2
                    and w.dim() == 2 and x.device.type == "cpu"
                    and x.shape[0] % ROW_MULTIPLE):
                rows = x.shape[0]
                return func(pad_rows(x), *args[1:], **kwargs)[:rows]
        return func(*args, **kwargs)
