"""Skinny bf16 / fp16 GEMMs for a few rows: ``out = x @ W^T (+ bias)``, and SwiGLU's fused
``silu(x @ W_gate^T) * (x @ W_up^T)`` in the same launch.

A batch-1 block-diffusion step multiplies 4-32 rows by every weight: reading the weights is the
whole cost. cuBLAS streams them at ~2.4 TB/s at 4 rows on an H100 (SDAR-4B's step,
``benchmarks/results/step/profile_sdar4b_b1_h100.json``) and adds a split-K reduction kernel to
half of its GEMMs; SwiGLU's activation is one more launch per layer. This kernel is
``quant_gemm``'s skinny loop on plain weights: a (BLOCK_N columns, SPLIT_K slices, BLOCK_M rows)
grid, each program streaming its ``[BLOCK_N, K / SPLIT_K]`` slice of W once against the (cached)
x tile; the K slices' fp32 partials are added by the tile's last slice in slice order (the
arrival counters of ``quant_gemm``: one launch, deterministic). With ``silu`` the program also
streams the matching up rows (``W[I + n]``) and writes ``silu(gate) * up`` with
``kernels/silu_mul``'s roundings (gate and up rounded to x's dtype first, as the unfused pair).

When it runs: only where a sweep measured it faster than cuBLAS on this device
(``benchmarks/step/sweep_skinny_gemm.py`` writes ``configs/skinny_gemm/<device>.json``; the
entry for a shape and row bucket is its tiles, an empty one where cuBLAS won): elsewhere, and for more than ``MAX_ROWS`` rows,
in a deterministic mode, under autograd or on the CPU, ``linear`` is ``F.linear`` and
``silu_gate_up`` returns None (the caller runs its unfused pair). ``*_reference`` are the
PyTorch math the tests compare the kernel with (under the interpreter on the CPU).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from flash_dllm.kernels import quant_gemm, tuned_configs
from flash_dllm.kernels._triton import (
    HAS_TRITON,
    batch_invariant_active,
    check,
    check_device,
    describe,
    interpreting,
    pdl_args,
    prefetch_lines,
    split_slices,
    use_triton,
)

INTERPRET = interpreting()
MAX_ROWS = 32            # beyond, the GEMM is not bound by one read of the weights
HALF_DTYPES = (torch.bfloat16, torch.float16)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from flash_dllm.kernels._triton import pdl_wait, prefetch_l2, split_sum

    @triton.jit
    def _slice_dot(x_rows, row_ok, w_rows, col_ok, k_start, k_end, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
        """[BM, BN] fp32: x[:, k_start:k_end] @ W[cols, k_start:k_end]^T (K masked)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:       # (the interpreter's half-precision tl.dot is wrong)
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
        return acc

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, K_PER_SPLIT,
                       stride_xm, stride_wn, stride_om, stride_pm, stride_ps,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SILU: tl.constexpr,
                       UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)          # (SILU: of the gate / output)
        row_ok, col_ok = rows < M, cols < N
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if PDL and PF_LINES > 0:     # the slice's first lines into L2 while the last kernel runs
            ks = tl.minimum(k_start + tl.arange(0, PF_LINES) * 64, k_end - 1)[None, :]
            pf_rows = tl.minimum(cols, N - 1)[:, None].to(tl.int64)
            prefetch_l2(w_ptr + pf_rows * stride_wn + ks)
            if SILU:
                prefetch_l2(w_ptr + (pf_rows + N) * stride_wn + ks)
        pdl_wait(PDL)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
        acc = _slice_dot(x_rows, row_ok, w_rows, col_ok, k_start, k_end, BLOCK_M, BLOCK_N,
                         BLOCK_K, UPCAST)
        up = acc
        if SILU:                                   # the up rows: W[N + cols]
            w_up = w_ptr + (cols[:, None] + N).to(tl.int64) * stride_wn
            up = _slice_dot(x_rows, row_ok, w_up, col_ok, k_start, k_end, BLOCK_M, BLOCK_N,
                            BLOCK_K, UPCAST)
        omask = row_ok[:, None] & col_ok[None, :]
        if SPLIT > 1:        # fp32 partials [SPLIT, M, N (x 2: gate, up)]; the last slice adds
            part = part_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :]
            tl.store(part + pid_k.to(tl.int64) * stride_ps, acc, mask=omask)
            if SILU:
                tl.store(part + pid_k.to(tl.int64) * stride_ps + N, up, mask=omask)
            tl.debug_barrier()
            cnt = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
                acc = split_sum(part, stride_ps, omask, SPLIT, BLOCK_M, BLOCK_N)
                if SILU:
                    up = split_sum(part + N, stride_ps, omask, SPLIT, BLOCK_M, BLOCK_N)
                _epilogue(acc, up, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om,
                          HAS_BIAS, SILU)
                tl.atomic_xchg(cnt, 0)
        else:
            _epilogue(acc, up, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om, HAS_BIAS,
                      SILU)

    @triton.jit
    def _epilogue(acc, up, b_ptr, out_ptr, rows, cols, col_ok, omask, stride_om,
                  HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
        dt = out_ptr.dtype.element_ty
        if SILU:             # kernels/silu_mul's roundings on the rounded gate and up
            g = acc.to(dt).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt)
            out = (s.to(tl.float32) * up.to(dt).to(tl.float32)).to(dt)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out = acc.to(dt)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out,
                 mask=omask)


def linear_reference(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def silu_gate_up_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight^T`` split in halves (``[W_gate; W_up]``)."""
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 1,
         "num_stages": 1}                       # name -> smallest value (powers of 2 but stages)


def default_config(M: int, N: int, K: int) -> dict:
    return {"BLOCK_M": 16 if M <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1,
            "num_warps": 4, "num_stages": 3}


def problem_key(N: int, K: int, silu: bool) -> str:
    """The tuned-config key: ``N`` is the output width (SwiGLU's: the intermediate size)."""
    return f"{'silu_' if silu else ''}N{N}_K{K}"


def check_tile(cfg: dict, where: str) -> dict:
    for name, v in cfg.items():
        lo = TILES.get(name)
        check(lo is not None, f"{where}: unknown tile {name!r} (known: {sorted(TILES)})")
        check(isinstance(v, int) and v >= lo and (name == "num_stages" or v & (v - 1) == 0),
              f"{where}: {name} = {v!r} is not a valid tile (a power of 2 >= {lo}; "
              "num_stages >= 1)")
    return cfg


def skinny_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  silu: bool = False, config: dict | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous), weight [N, K] (``silu``: [2I, K], out [M, I]) -> out in x's
    dtype."""
    check(HAS_TRITON, "skinny_gemm: triton is not importable")
    check(x.dim() == 2 and x.stride(1) == 1 and x.dtype in HALF_DTYPES,
          f"skinny_gemm: x must be a bf16 / fp16 [M, K] with contiguous rows, got {describe(x)}")
    M, K = x.shape
    check(weight.dim() == 2 and weight.shape[1] == K and weight.stride(1) == 1
          and weight.dtype == x.dtype,
          f"skinny_gemm: weight must be [N, {K}] in {x.dtype} with contiguous rows, got "
          f"{describe(weight)}")
    check(not silu or (weight.shape[0] % 2 == 0 and bias is None),
          f"skinny_gemm: silu wants [W_gate; W_up] ([2I, K], no bias), got {describe(weight)}")
    N = weight.shape[0] // 2 if silu else weight.shape[0]
    check(bias is None or (bias.shape == (N,) and bias.is_contiguous()),
          f"skinny_gemm: bias must be None or [{N}], got {describe(bias)}")
    check_device("skinny_gemm", INTERPRET, x, weight)
    cfg = check_tile({**default_config(M, N, K), **(config or {})}, "skinny_gemm tiles")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    tiles = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    cnt = (quant_gemm.split_counters(x.device, tiles[0] * tiles[1]) if cfg["SPLIT_K"] > 1
           else None)                    # (None: no buffer can be made now: no K split)
    per, split = split_slices(K, cfg["SPLIT_K"] if cnt is not None else 1, cfg["BLOCK_K"])
    grid = (tiles[0], split, tiles[1])
    pdl = pdl_args(x)
    lines = (prefetch_lines(grid[0] * split * (2 if silu else 1), cfg["BLOCK_N"],
                            -(-per * x.element_size() // 128)) if pdl["PDL"] else 0)
    part, cnt = out, out if cnt is None else cnt
    if split > 1:
        part = torch.empty(split, M, 2 * N if silu else N, dtype=torch.float32,
                           device=x.device)
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else x, out, part, cnt, M, N, K, per,
        x.stride(0), weight.stride(0), out.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0, HAS_BIAS=bias is not None, SPLIT=split,
        SILU=silu, UPCAST=INTERPRET, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        PF_LINES=lines, **pdl)
    return out


_device_name = quant_gemm._device_name      # (one cached name per device)


@functools.lru_cache(maxsize=4096)
def _tuned(device_name: str, key: str, M: int, env_dir: str | None) -> dict | None:
    cfg = tuned_configs.lookup("skinny_gemm", device_name, key, M)
    return None if cfg is None else check_tile(cfg, f"tuned skinny_gemm tiles for {key}")


def tuned_config(x: torch.Tensor, N: int, silu: bool) -> dict | None:
    """The sweep's tiles for this GEMM and row count on x's device, or None (no kernel: the
    caller's cuBLAS path), and None wherever the kernel is not to run (see the module)."""
    if not use_triton(x) or not _has_tables(x.device):   # (common: no sweep for this device)
        return None
    env = os.environ.get(tuned_configs.ENV)
    M, K = x.shape[0] if x.dim() == 2 else x.numel() // max(1, x.shape[-1]), x.shape[-1]
    if (M == 0 or M > MAX_ROWS or x.dtype not in HALF_DTYPES
            or torch.is_grad_enabled() or batch_invariant_active()):
        return None
    cfg = _tuned(_device_name(x.device), problem_key(N, K, silu), M, env)
    return cfg or None            # (an empty entry: the sweep found cuBLAS faster there)


@functools.lru_cache(maxsize=None)
def _has_tables(device: torch.device) -> bool:
    """Whether any ``skinny_gemm`` table exists for the device, asked once per process (eager
    steps ask per projection; ``FLASH_DLLM_KERNEL_CONFIGS`` is read at the first ask)."""
    return bool(tuned_configs.load("skinny_gemm", _device_name(device)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``F.linear``, through the kernel where a sweep found it faster (see the module)."""
    cfg = tuned_config(x, weight.shape[0], False)
    if cfg is None:
        return F.linear(x, weight, bias)
    return _on_rows(x, weight, bias, False, cfg)


def silu_gate_up(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of the fused gate/up projection in one launch where a sweep found it
    faster than cuBLAS + ``silu_mul``; None elsewhere (the caller runs the pair)."""
    cfg = tuned_config(x, weight.shape[0] // 2, True)
    return None if cfg is None else _on_rows(x, weight, None, True, cfg)


def _on_rows(x, weight, bias, silu, cfg):
    """The kernel on x's rows ([..., K] -> [..., N]), leading dims kept."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = skinny_triton(x2, weight, bias, silu, cfg)
    return out.view(*x.shape[:-1], out.shape[-1])
