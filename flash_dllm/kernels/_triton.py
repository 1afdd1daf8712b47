"""What every kernel file shares: is Triton importable, is it interpreting, and layout checks.

NOTE: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *decorated* (module import), and
``triton.language``'s own jit helpers are built when triton is first imported. Each kernel module
therefore captures ``interpreting()`` at its own import: imported under the interpreter (the CPU
tests set it before anything imports triton) it accepts CPU tensors, otherwise it insists on CUDA.
"""
from __future__ import annotations

import functools
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

try:  # pragma: no cover - Triton >= 3.3 (the device's 3.6 has it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # pragma: no cover - never called: pdl() is False without them
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False


def interpreting() -> bool:
    """Would ``triton.jit`` build an interpreted kernel right now? Kernel modules call this at
    import and pass the answer to ``check_device``."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def env_switch(name: str, default: bool, off: str, on: str) -> bool:
    """A kernel's 0 / 1 switch read from the environment at import (A/B timing in one process):
    any other value fails with one line naming the variable and what 0 and 1 mean."""
    value = os.environ.get(name, "1" if default else "0")
    check(value in ("0", "1"), f"{name} must be 0 ({off}) or 1 ({on}), got {value!r}")
    return value == "1"


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


def split_slices(K: int, split: int, block: int) -> tuple[int, int]:
    """(K per slice, slices) of a split-K launch: ``split`` slices of K, each starting on a
    ``block`` boundary (fewer slices when the rounding leaves the last ones empty)."""
    per = -(-K // split)
    per = -(-per // block) * block
    return per, -(-K // per)


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


# Programmatic dependent launch (PDL, sm_90+): a kernel launched with ``launch_pdl`` may start
# while the one before it in the stream still runs; its programs block in ``pdl_wait`` until that
# kernel has finished and its writes are visible, then let the next kernel launch. The launch gap
# between the small kernels of a batch-1 step (~1.2 us each, ~0.4 ms of SDAR-4B's 4.4 ms) is
# hidden, and a GEMM can prefetch its weights (which no kernel writes) before it waits.
# Opt-in (``FLASH_DLLM_PDL=1``) until its GPU A/B has run (``benchmarks/run_gpu.sh OUT pdl``):
# compiled for sm_90 and tested under the interpreter only so far.
PDL_ENV = "FLASH_DLLM_PDL"


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_mode(t: torch.Tensor) -> int:
    """How a kernel on ``t``'s device launches: 0 plainly; with PDL (CUDA sm_90+, compiled, turned
    on) 1 = each program lets the next kernel launch as soon as it has waited (``FLASH_DLLM_PDL=1``),
    2 = only as it exits (``FLASH_DLLM_PDL=2``: the next kernel's launch overlaps this one's tail,
    its programs never hold an SM while this one still has programs to place)."""
    mode = os.environ.get(PDL_ENV, "0")
    if mode not in ("1", "2") or not (HAS_GDC and t.is_cuda) or interpreting():
        return 0
    return int(mode) if _pdl_capable(t.device.index or 0) else 0


def pdl(t: torch.Tensor) -> bool:
    """Launch a kernel on ``t``'s device with PDL? (``pdl_mode`` not 0)."""
    return pdl_mode(t) > 0


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that takes ``PDL: tl.constexpr`` and calls ``pdl_wait(PDL)``
    before it touches anything an earlier kernel writes: ``kernel[grid](..., **pdl_args(x))``.
    Every kernel launched with ``launch_pdl`` must wait so: the kernels after it rely on its
    completion implying its predecessor's."""
    mode = pdl_mode(t)
    return {"PDL": mode, "launch_pdl": mode > 0}


if HAS_TRITON:
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel in the stream; ``PDL == 1``: then let the next one launch
        (its programs then wait here while this kernel runs: one kernel ahead, never a chain);
        ``PDL == 2``: the next one launches as this kernel's programs exit."""
        if PDL:
            gdc_wait()
            if PDL == 1:
                gdc_launch_dependents()

    @triton.jit
    def split_sum(p, stride_ps, omask, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """A split-K tile's fp32 partials at ``p`` (slice ``s`` at ``p + s * stride_ps``) added
        in slice order, the same order whichever slice came last (``quant_gemm``,
        ``skinny_gemm``: their tile's last slice sums; deterministic)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in tl.static_range(SPLIT):                   # (64-bit pointer steps)
            acc += tl.load(p, mask=omask, other=0.0, cache_modifier=".cg")
            p += stride_ps
        return acc

    @triton.jit
    def prefetch_l2(ptrs):
        """One L2 prefetch per element of ``ptrs`` (global addresses; no value, never a fault):
        what a kernel launched with PDL does with the weights it will stream (no kernel writes
        them) while it waits in ``pdl_wait``. Compiled code only (not the interpreter)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_lines(programs: int, rows: int, k_lines: int, budget_mb: float | None = None
                   ) -> int:
    """How many 128-byte lines of each of its ``rows`` weight rows a program prefetches before
    ``pdl_wait``: a power of 2 (or 0), at most ``k_lines`` (rounded up) and 32, all programs
    together at most ``FLASH_DLLM_PREFETCH_MB`` (default 8 MiB: a sixth of an H100's L2)."""
    if budget_mb is None:
        budget_mb = float(os.environ.get("FLASH_DLLM_PREFETCH_MB", "8"))
    lines = min(32, next_pow2(max(1, k_lines)))
    while lines and programs * rows * lines * 128 > budget_mb * 2 ** 20:
        lines //= 2
    return lines
