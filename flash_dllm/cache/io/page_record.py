"""The byte layout of one KV page record, the unit every tier below the GPU pool stores::

    [ payload (packed page) | scales (quantised only) | key (16 B) | checksum (16 B) | pad ]

padded to a multiple of ``RECORD_ALIGN`` bytes, so that every record of a batch (a row of one
device tensor) starts 16-byte aligned: the pack kernel writes the payload straight into the
records, and the checksum and unpack kernels read them in place with vector loads (with odd row
strides the checksum ran 4x slower and a staging copy of the payload cost as much again).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OFFLOAD_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
RECORD_ALIGN = 256   # record size multiple: see the module docstring


@dataclass
class RecordLayout:
    """Byte layout of one page record (see the module docstring)."""

    shape: tuple                 # one packed page: [1, layers, 2, page_size, kv_heads, head_dim]
    dtype: torch.dtype           # payload dtype (the pool's, or fp8 / int8)
    payload: int
    scales: int                  # bytes of [1, layers, 2, kv_heads] fp32, 0 when not quantised

    @property
    def key_at(self) -> int:
        return self.payload + self.scales

    @property
    def sums_at(self) -> int:
        return self.payload + self.scales + 16

    @property
    def nbytes(self) -> int:
        return -(-(self.payload + self.scales + 32) // RECORD_ALIGN) * RECORD_ALIGN

    def payload_view(self, rec: torch.Tensor) -> torch.Tensor:
        """The packed pages of records ``rec [n, nbytes]`` uint8, as the pack / unpack kernels'
        ``[n, layers, 2, page_size, kv_heads, head_dim]`` buffer: a view (rows strided)."""
        n = rec.shape[0]
        return rec[:, :self.payload].view(self.dtype).view(n, *self.shape[1:])

    def scales_view(self, rec: torch.Tensor) -> torch.Tensor:
        """The scales of records ``rec`` as ``[n, layers, 2, kv_heads]`` fp32 (a copy: the
        kernels take contiguous scales)."""
        n = rec.shape[0]
        return rec[:, self.payload:self.key_at].contiguous().view(torch.float32).view(
            n, self.shape[1], 2, self.shape[4])

    @classmethod
    def for_pool(cls, kv: torch.Tensor, offload_dtype: torch.dtype | None) -> RecordLayout:
        """``offload_dtype`` None: the pool's own bytes. An fp8 pool (``kv_cache_dtype="fp8"``)
        always carries its pages' scales: its codes travel as they are."""
        L, _, _, S, H, D = kv.shape
        fp8_pool = kv.dtype == torch.float8_e4m3fn
        if fp8_pool and offload_dtype not in (None, kv.dtype):
            raise ValueError(f"an fp8 KV pool's pages leave the GPU as fp8 (codes and scales): "
                             f"kv_offload_dtype must be bf16 or fp8 with it, got {offload_dtype}")
        dtype = kv.dtype if fp8_pool else (offload_dtype or kv.dtype)
        payload = L * 2 * S * H * D * torch.empty((), dtype=dtype).element_size()
        scales = L * 2 * H * 4 if offload_dtype is not None or fp8_pool else 0
        return cls((1, L, 2, S, H, D), dtype, payload, scales)
