"""The weight-only GEMM's tiles (``quant_gemm``): the defaults for a shape and the SM count, the
tuned files a sweep writes (``configs/quant_gemm/<device>.json``, read through
``kernels/tuned_configs``) and the check every tile passes before a launch. Re-exported by
``quant_gemm``, whose kernel they parameterise.
"""
from __future__ import annotations

import functools
import os

import torch

from flash_dllm.kernels import tuned_configs
from flash_dllm.kernels._triton import next_pow2

FP8 = torch.float8_e4m3fn        # 8-bit codes may also be e4m3 (the fused MoE's fp8 experts)


def default_config(M: int, N: int, K: int, group: int, num_sms: int = 132) -> dict:
    """Tiles for an ``[M, K] x [N, K]^T`` GEMM: BLOCK_M covers the rows (16-64), BLOCK_N 64 (32
    when N is small), BLOCK_K 128 (32-128 for small K); SPLIT_K grows (powers of 2) until the grid holds ~2
    waves of ``num_sms`` programs, keeping at least 4 BLOCK_K steps per slice."""
    block_m = min(64, max(16, next_pow2(M)))
    block_n = 64 if N >= 64 * num_sms // 2 else 32
    block_k = min(128, max(32, next_pow2(K)))        # (int4: BLOCK_K / 2 >= 16 for tl.dot)
    if group % 64 == 0:                              # a tile inside one group: the scale after
        while group % block_k:                       # the dot (``wq_dot_acc``); narrower groups
            block_k //= 2                            # keep wide tiles, dequantized before it
    tiles = -(-N // block_n) * -(-M // block_m)
    split = 1
    while tiles * split < 2 * num_sms and K // (split * 2) >= 4 * block_k:
        split *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": 3}


def code_name(qweight: torch.Tensor, bits: int) -> str:
    """What the packed weights hold: ``"int8"``, ``"int4"`` or ``"fp8"`` (e4m3 codes, the 8-bit
    path: the fused MoE's fp8 experts)."""
    return "fp8" if qweight.dtype == FP8 else f"int{bits}"


def problem_key(bits: int, N: int, K: int, group: int, code: str | None = None) -> str:
    """The tuned-config key of one GEMM (``kernels/tuned_configs``)."""
    return f"{code or f'int{bits}'}_N{N}_K{K}_g{group}"


def tuned_config(M: int, N: int, K: int, group: int, bits: int,
                 device: torch.device, code: str | None = None) -> dict | None:
    """The tiles a sweep measured for this GEMM on this device (``configs/quant_gemm/``), or
    None: ``default_config`` then applies."""
    if device.type != "cuda":
        return None
    return _tuned(_device_name(device), problem_key(bits, N, K, group, code), M,
                  os.environ.get(tuned_configs.ENV))


@functools.lru_cache(maxsize=4096)
def _tuned(device_name: str, key: str, M: int, env_dir: str | None) -> dict | None:
    """One lookup and check per (GEMM, row count, override folder): the eager path calls this
    at every launch. ``env_dir`` keys the cache only (``tuned_configs`` reads the variable).
    The dict is shared: callers copy it before changing it."""
    cfg = tuned_configs.lookup("quant_gemm", device_name, key, M)
    return None if cfg is None else check_tile(cfg, f"tuned quant_gemm tiles for {key}")


TILE_RULES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 1,
              "num_stages": 1, "JOIN": 0, "SWAP": 0}   # name -> smallest value (powers of 2
_CHOICES = {"JOIN": (0, 1, 2), "SWAP": (0, 1)}         # but stages; these: one of a few)


def check_tile(cfg: dict, where: str) -> dict:
    """``cfg`` if every name is a tile of this kernel with a value it can launch, else a
    ValueError naming ``where``, the name and the value (a bad tuned file must not fail inside a
    Triton compile or a division)."""
    for name, v in cfg.items():
        lo = TILE_RULES.get(name)
        if lo is None:
            raise ValueError(f"{where}: unknown tile {name!r} (known: {sorted(TILE_RULES)})")
        ok = isinstance(v, int) and v >= lo and (
            name == "num_stages" or (name in _CHOICES and v in _CHOICES[name])
            or (name not in _CHOICES and v & (v - 1) == 0))
        if not ok:
            raise ValueError(f"{where}: {name} = {v!r} is not a valid tile (a power of 2 >= "
                             f"{lo}; num_stages >= 1; JOIN 0, 1 or 2; SWAP 0 or 1)")
    return cfg


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
