"""What every kernel file shares: is Triton importable, is it interpreting, and layout checks.

NOTE: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *decorated* (module import), and
``triton.language``'s own jit helpers are built when triton is first imported. Each kernel module
therefore captures ``interpreting()`` at its own import: imported under the interpreter (the CPU
tests set it before anything imports triton) it accepts CPU tensors, otherwise it insists on CUDA.
"""
from __future__ import annotations

import os

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False



def interpreting() -> bool:
    """Would ``triton.jit`` build an interpreted kernel right now? Kernel modules call this at
    import and pass the answer to ``check_device``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Escape hatch for debugging: force every dispatcher onto its PyTorch reference.
DISABLE = os.environ.get("FLASH_DLLM_DISABLE_TRITON", "0") == "1"

# Batch-invariant launches (``EngineConfig.deterministic`` on a GPU; ``layers/batch_invariant``
# sets it for a step): while set, every dispatcher picks tiles, splits and paths that do not
# depend on how many rows or requests share the launch, so a row's result does not either.
_BATCH_INVARIANT = [0]


def batch_invariant_active() -> bool:
    return _BATCH_INVARIANT[0] > 0


class batch_invariant_launches:
    """``with batch_invariant_launches():`` the dispatchers' batch-invariant choices (nestable;
    host-side only, so a CUDA graph captured inside keeps them)."""

    def __enter__(self):
        _BATCH_INVARIANT[0] += 1
        return self

    def __exit__(self, *exc):
        _BATCH_INVARIANT[0] -= 1
        return False


def use_triton(*tensors: torch.Tensor) -> bool:
    """Dispatch rule: Triton when importable, not disabled, and every tensor is on a CUDA device."""
    return HAS_TRITON and not DISABLE and all(t.is_cuda for t in tensors)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check(cond: bool, msg: str) -> None:
    """Layout assertion that survives ``python -O`` (a wrong stride is silent corruption).

    NOTE: ``msg`` is built before the call, whether or not the check fails: never put a
    tensor's repr (``{t!r}``) in it. Printing a CUDA tensor reads its values, one host sync
    each: a checksum launcher that did so waited for the GPU and spent ~3 ms per call. Name a
    tensor with ``describe(t)``."""
    if not cond:
        raise ValueError(msg)


def describe(x) -> str:
    """A short description of an argument for error messages that never reads a tensor's values
    (no device sync): ``tensor[4, 16] torch.uint8 on cuda:0``, else a truncated repr."""
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)} {x.dtype} on {x.device}"
    return repr(x)[:60]


def check_device(name: str, interpret: bool, *tensors: torch.Tensor) -> None:
    dev = tensors[0].device
    for t in tensors:
        check(t.device == dev,
              f"{name}: all tensors must be on one device, got {t.device} and {dev}")
    if not interpret:
        check(dev.type == "cuda", f"{name}: the Triton kernel needs CUDA tensors (got {dev}); "
                                  "use op() for the reference path or set TRITON_INTERPRET=1 "
                                  "before the kernel module is imported")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    check(t.dtype in allowed, f"{name} must be one of {allowed}, got {t.dtype}")


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)
