"""Host -> device copies of small index tensors that never stall the GPU stream.

``torch.tensor(data, device="cuda")`` copies from pageable host memory, which the driver performs
in stream order *and* waits for on the host: issued after a forward was queued, each such copy
blocks the host until the forward finishes, so the host can no longer run ahead. The engine builds
many small index tensors per step; ``h2d`` stages them in pinned memory (PyTorch's caching host
allocator keeps each staging block alive until its copy has run) and copies asynchronously.
"""
from __future__ import annotations

import numpy as np
import torch


def h2d(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``, without a host sync on CUDA. ``data``:
    a list, a numpy array or a CPU tensor."""
    if isinstance(data, np.ndarray):
        t = torch.from_numpy(data).to(dtype)
    elif isinstance(data, torch.Tensor):
        t = data.to(dtype)
    else:
        t = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def h2d_into(dst: torch.Tensor, data: np.ndarray) -> torch.Tensor:
    """Copy the host array ``data`` into the device tensor ``dst`` (a CUDA graph's static input)
    as ``h2d`` does: staged in pinned memory, asynchronous. Returns ``dst``."""
    src = torch.from_numpy(data)
    if dst.device.type != "cuda":
        return dst.copy_(src)
    return dst.copy_(src.pin_memory(), non_blocking=True)
