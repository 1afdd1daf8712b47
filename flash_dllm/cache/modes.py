"""Which canvas positions a denoising step recomputes, per cache mode.

Every mode runs through the same mechanism (the attention backend,
``flash_dllm.layers.attention_backend``): the recomputed positions write fresh K/V into the
request's pages, then attend to the whole cached canvas. A mode is therefore only a choice of query
range:

| mode     | first step of a block | later steps of the block           |
|----------|-----------------------|------------------------------------|
| `none`   | whole canvas          | whole canvas (nothing is cached)   |
| `prefix` | whole canvas          | active block + masked suffix       |
| `dual`   | whole canvas          | active block only                  |
| `dual` + drift trigger | previous + active block, whole canvas once drift was seen | active block |
| `flash`  | previous + active block + top-k | active block + top-k     |

Fast-dLLM's prefix cache keeps only prompt/committed K/V and recomputes the suffix; its dual cache
also keeps the suffix's K/V from the block's first step. Both refresh the whole cache at the first
step of every block, so that step equals the exact mode's.

`flash` (paged layout only) never refreshes the whole canvas after the first step of the request
(the prefill). Each step recomputes a fixed-size query: the active block (whose tokens committed last
step are in it), at a block's first step also the previous block (its last commits are stale in the
cache), plus the ``flash_budget`` cached positions outside that window that received the most
attention mass in the request's previous step (last layer, summed over heads and query rows, from
the paged attention kernel's mass output); their K/V are rewritten in place, everything else is
read from the cache.

NOTE: models with a one-position logit shift (Dream) read slot i's logits from output i-1, so the
query also starts one position earlier; the extra row is committed text whose K/V gets refreshed.
"""
from __future__ import annotations

CACHE_MODES = ("none", "prefix", "dual", "flash")


def query_range(mode: str, canvas_len: int, block_start: int, block_end: int, first_step: bool,
                logit_shift: int, first_block: bool = True, refresh: bool | None = None
                ) -> tuple[int, int]:
    """Half-open range [q0, q1) of canvas positions to recompute this step (for ``flash``, the
    window only: the engine adds the top-k positions). ``refresh``: whether this step recomputes
    the whole canvas (None: at every block's first step, as Fast-dLLM; the drift trigger,
    ``decoding/drift.py``, decides it for ``dual`` / ``prefix``: a first step without it
    recomputes the previous block, whose last commits are stale in the cache, and the active
    block, plus the masked suffix for ``prefix``)."""
    if mode not in CACHE_MODES:
        raise ValueError(f"cache mode must be one of {list(CACHE_MODES)}, got {mode!r}")
    if refresh is None:
        refresh = mode == "none" or (first_step and (mode != "flash" or first_block))
    if refresh or mode == "none":
        return 0, canvas_len
    q0 = block_start - logit_shift
    if first_step and not first_block:
        q0 -= block_end - block_start
    return q0, canvas_len if mode == "prefix" else block_end


def keeps_cache(mode: str) -> bool:
    return mode != "none"
