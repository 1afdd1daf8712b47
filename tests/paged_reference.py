"""Plain-torch reference helpers of the paged KV layout (``flash_dllm/cache/paged.py``), for the
tests: block tables, slot mapping and dense gathers written the obvious way, so the engine's
host-side index building and the kernels are checked against something independent."""
from __future__ import annotations

import torch

from flash_dllm.cache.paged import (  # noqa: F401 (re-exported for the tests)
    DEFAULT_PAGE_SIZE,
    PagedKVLayout,
    allocate_kv_cache,
    pages_needed,
)


def layer_kv(cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [layers, 2, P, S, Hkv, D] -> (k, v) views [P, S, Hkv, D] of one layer."""
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise ValueError(f"cache must be [layers, 2, pages, page_size, kv_heads, head_dim], got "
                         f"{tuple(cache.shape)}")
    return cache[layer, 0], cache[layer, 1]


def block_table(pages: list[list[int]], device: torch.device | str = "cpu",
                width: int | None = None) -> torch.Tensor:
    """Per-request page-id lists -> int32 [B, width] (padded with page 0, never read: kernels stop
    at each request's key length)."""
    width = max((len(p) for p in pages), default=0) if width is None else width
    table = torch.zeros((len(pages), max(width, 1)), dtype=torch.int32)
    for b, row in enumerate(pages):
        if len(row) > width:
            raise ValueError(f"request {b} has {len(row)} pages > table width {width}")
        table[b, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return table.to(device)


def token_requests(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cu_seqlens [B+1] -> the request index of each packed token [T] (int64, no host sync)."""
    tokens = torch.arange(num_tokens, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(tokens.dtype), tokens, right=True)


def slot_mapping(table: torch.Tensor, requests: torch.Tensor, positions: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """(block table [B, max_pages], request index [T], canvas position [T]) -> slot [T] int64,
    ``slot = table[req, pos // page_size] * page_size + pos % page_size``."""
    pages = table[requests.long(), positions.long() // page_size].long()
    return pages * page_size + positions.long() % page_size


def gather_kv(cache: torch.Tensor, layer: int, pages: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first ``length`` keys and values of ``layer``: ([L, Hkv, D], [L, Hkv, D])
    copies, in position order (the dense view the reference attention uses)."""
    k, v = layer_kv(cache, layer)
    n = pages_needed(length, k.shape[1])
    idx = pages[:n].long()
    return k[idx].flatten(0, 1)[:length], v[idx].flatten(0, 1)[:length]
