"""Paged KV-cache layout and the small tensor helpers around it (no torch.cuda here).

Layout: ONE tensor per model, ``[layers, 2, num_pages, page_size, kv_heads, head_dim]``
(index 0 = K, 1 = V). ``cache[l, 0]`` and ``cache[l, 1]`` are that layer's K and V pools as
zero-copy views ``[num_pages, page_size, kv_heads, head_dim]``, which is what every kernel takes. A token's slot is
``page * page_size + offset``; a request owns a row of page ids (its block table).

Why this layout:

- **Fused write = one contiguous store.** A token's K (and V) for all kv heads are ``kv_heads *
  head_dim`` adjacent values (LLaDA-8B: 8 KiB in bf16; Dream-7B: 1 KiB), so ``rope_cache`` writes
  each as one contiguous row straight from the projection, no transpose.
- **Attention loads stay coalesced.** The attention kernel reads, for one kv head, ``BLOCK_N`` key
  rows of ``head_dim`` contiguous values (256 B in bf16 = two full 128 B lines) strided by
  ``kv_heads * head_dim``. Every row is a full-sector transaction, so the head-major alternative
  (``[pages, kv_heads, page_size, head_dim]``) would buy longer bursts but not fewer bytes, at the
  cost of a scattered write. With GQA the query heads of a group hit the same rows in L2.
- **Same order as a dense per-request cache** (``[layers, 2, canvas, kv_heads, head_dim]``, the
  tests' oracle: a canvas is one big page) and as FlashAttention /
  FlashInfer's "NHD" paged layout, so a vendor kernel can be swapped in without a copy.
- **Layer-outermost** keeps each layer's K/V pool one strided view with no per-layer allocation.
  The kernels take page/slot strides as arguments. Pages that leave the GPU (tiers, transfers)
  travel page-first (all layers of a page contiguous), packed and unpacked by kernels.

Bytes per token (all layers, K and V) = ``2 * layers * kv_heads * head_dim * dtype_bytes``:
LLaDA-8B (32 layers, 32 kv heads, 128) 512 KiB in bf16; Dream-7B (28 layers, 4 kv heads) 56 KiB.

FP8 pages (``kv_cache_dtype="fp8"``, ``kernels/kv_quant.py``): the same tensor in
``float8_e4m3fn`` plus ``scales [layers, 2, num_pages, kv_heads]`` fp32 (one per page, layer, K/V
and kv head: a tensor-parallel rank's scales shard with its heads). A page costs
``page_size * bytes_per_token`` (1 byte per value) plus ``8 * layers * kv_heads`` bytes of
scales, so a memory budget holds ~2x the tokens of bf16 (LLaDA-8B, page 16: 256 KiB + 4 KiB).

Page size: 16 by default. dLLM canvases (prompt + max_tokens) are allocated whole at admission, so
waste is < 1 page per request whatever the size; small pages give finer prefix sharing. The
kernels look up each key's page individually, so any page size works and needs no tile alignment.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_PAGE_SIZE = 16


@dataclass(frozen=True)
class PagedKVLayout:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_pages", "page_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PagedKVLayout.{name} must be > 0, got {getattr(self, name)}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"PagedKVLayout.dtype must be a float dtype, got {self.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads,
                self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers: 2 * layers * kv_heads * head_dim * bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def quantized(self) -> bool:
        """fp8 pages: one fp32 scale per (page, layer, K/V, kv head) beside the codes."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_pages, self.num_kv_heads)

    @property
    def scale_bytes_per_page(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * 4 if self.quantized else 0

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size + self.scale_bytes_per_page

    @property
    def tokens(self) -> int:
        """Token capacity of the pool."""
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    @classmethod
    def for_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   page_size: int = DEFAULT_PAGE_SIZE, dtype: torch.dtype = torch.bfloat16
                   ) -> PagedKVLayout:
        """The largest layout whose cache fits ``budget_bytes``."""
        one = cls(num_layers, 1, page_size, num_kv_heads, head_dim, dtype)
        pages = budget_bytes // one.bytes_per_page
        if pages <= 0:
            raise ValueError(f"a budget of {budget_bytes} B holds no page of "
                             f"{one.bytes_per_page} B")
        return cls(num_layers, int(pages), page_size, num_kv_heads, head_dim, dtype)


def allocate_kv_cache(layout: PagedKVLayout, device: torch.device | str = "cpu",
                      zero: bool = False) -> torch.Tensor:
    """The cache tensor ``layout.shape``; uninitialised unless ``zero`` (pages are written before
    they are read, so zeroing is only for tests and debugging)."""
    alloc = torch.zeros if zero else torch.empty
    return alloc(layout.shape, dtype=layout.dtype, device=device)


def allocate_kv_scales(layout: PagedKVLayout, device: torch.device | str = "cpu"
                       ) -> torch.Tensor | None:
    """fp8 pools: the scales ``layout.scales_shape`` fp32, all 0 ("no valid entry"); else None."""
    if not layout.quantized:
        return None
    return torch.zeros(layout.scales_shape, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class KVPoolDtype:
    """What an ``EngineConfig.kv_cache_dtype`` makes of the pool: its element type (None: the
    model's) and whether its pages are codes with per-page, per-head scales beside them (which
    the tiers carry, and overflow streaming and KV transfers do not yet)."""
    element: torch.dtype | None
    quantized: bool


KV_POOL_DTYPES = {"auto": KVPoolDtype(None, False),
                  "fp8": KVPoolDtype(torch.float8_e4m3fn, True)}


def kv_pool(kv_cache_dtype: str) -> KVPoolDtype:
    if kv_cache_dtype not in KV_POOL_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_POOL_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return KV_POOL_DTYPES[kv_cache_dtype]


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for ``EngineConfig.kv_cache_dtype``."""
    return kv_pool(kv_cache_dtype).element or model_dtype


def pages_needed(length: int, page_size: int) -> int:
    """Pages that ``length`` tokens occupy."""
    return -(-length // page_size)
