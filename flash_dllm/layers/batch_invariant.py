"""Batch-invariant row GEMMs on the CPU: a token's result does not depend on how many other rows
share its GEMM.

A step runs every token-wise GEMM (q/k/v, o, gate/up, down, the router, the MoE experts, the LM
head) once over the rows of the whole batch. The CPU BLAS picks its kernel and splits the rows
over threads by the row count: measured with torch's CPU GEMM, a row multiplied alone (or with up
to ~11 others, at 2 threads) differs in the last bits from the same row inside a larger GEMM,
so a request's tokens could depend on what else runs (issue 44, cause (a)). Padding the rows to a
multiple of ``ROW_MULTIPLE`` (at least one such tile) made every row's result equal to its
padded solo result, for any row count and offset, at 1, 2 and 4 threads
(``tests/test_same_answer.py::test_padded_cpu_gemm_is_row_invariant``).

``batch_invariant()`` is a ``TorchFunctionMode`` that pads the left operand of ``F.linear`` and of
2-D ``@`` / ``torch.matmul`` (a ``[rows, d]`` times a weight) and slices the result back. The
attention matmuls (3-D and up) are per request on the CPU path already and are left alone.
NOTE: CPU only. On a GPU cuBLAS / Triton choose tiles and split-K by shape too, and padding rows
is not enough (a batch-invariant GPU mode, like SGLang's and vLLM's, is future work).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_MULTIPLE = 16


def pad_rows(x: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """``x`` ([rows, d]) with zero rows appended up to a multiple of ``multiple`` (>= one)."""
    rows = x.shape[0]
    padded = max(multiple, -(-rows // multiple) * multiple)
    if padded == rows:
        return x
    return torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])    # [padded, d]


class batch_invariant(TorchFunctionMode):
    """Within the block, 2-D row GEMMs run on rows padded to ``ROW_MULTIPLE`` (see the module)."""

    _LINEAR = (F.linear,)
    _MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._LINEAR or func in self._MATMUL:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            if (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2
                    and w.dim() == 2 and x.device.type == "cpu"
                    and x.shape[0] % ROW_MULTIPLE):
                rows = x.shape[0]
                return func(pad_rows(x), *args[1:], **kwargs)[:rows]
        return func(*args, **kwargs)
