"""Cache modes: which canvas positions a denoising step recomputes, and what the cache keeps.

Every mode runs through the same mechanism (the attention backend,
``flash_dllm.layers.attention_backend``): the recomputed positions write fresh K/V into the
request's pages, then attend to the whole cached canvas. A mode is therefore a choice of query
range, plus a few facts the engine asks of it (``CacheMode``'s attributes) instead of comparing
mode names:

| mode     | first step of a block | later steps of the block           |
|----------|-----------------------|------------------------------------|
| `none`   | whole canvas          | whole canvas (nothing is cached)   |
| `prefix` | whole canvas          | active block + masked suffix       |
| `dual`   | whole canvas          | active block only                  |
| `dual` + drift trigger | previous + active block, whole canvas once drift was seen | active block |
| `flash`  | previous + active block + top-k | active block + top-k     |
| `block`  | previous + active block (the first: prompt + block) | active block (exact: block-causal models only) |

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

A new mode is one class (a ``CacheMode`` subclass, in its own module) plus
``CACHE_MODES.register(MyMode())``; ``SamplingParams(cache=...)``, the CLI and the HTTP body
accept it from then on.

NOTE: models with a one-position logit shift (Dream) read slot i's logits from output i-1, so the
query also starts one position earlier; the extra row is committed text whose K/V gets refreshed.
"""
from __future__ import annotations

import torch

from flash_dllm.registry import Registry
from flash_dllm.transfer import h2d


class CacheMode:
    """What a cache mode computes and keeps. Subclasses set the class attributes and may override
    ``refresh`` / ``window`` / ``extra_positions``."""

    name: str = ""
    # False: nothing is read from the cache (every step recomputes the whole canvas)
    keeps_kv: bool = True
    # a finished request's pages may serve later prompts that start with the same tokens
    reusable: bool = True
    # steady (non-refresh) steps may run as ONE fused step graph (``worker/fused_step.py``): the
    # query window is the same at every step of a block and needs nothing from the last step
    fusable: bool = False
    # a block's first step (after the first block) may run fused too when the engine asks
    # (``EngineConfig.fused_first_steps``): its window is as small as a steady one's
    fusable_first: bool = False
    # refreshes the whole canvas at block starts, so the drift trigger (``drift_min``) may take
    # that decision instead
    block_refresh: bool = False
    # a request larger than the GPU pool may use it (``cache/io/kv_overflow.py``): its cached K/V
    # stay valid between steps and its window needs no attention statistics
    streams_overflow: bool = False
    # needs the last layer's per-key attention mass of every step (``extra_positions``)
    needs_mass: bool = False
    # may run on a block-causal model (contiguous query windows, no attention statistics) /
    # only on one (its windows rely on later blocks never being seen)
    block_causal_ok: bool = True
    needs_block_causal: bool = False
    # the fast mode a request gets on this attention when nothing names one (a family's own
    # ``default_cache`` first): "bidirectional" / "block_causal" (``fast_default``)
    default_for: tuple[str, ...] = ()

    def refresh(self, first_step: bool, first_block: bool) -> bool:
        """Whether a step recomputes the whole canvas (when no trigger decides it)."""
        return first_step

    def window(self, canvas_len: int, block_start: int, block_end: int, first_step: bool,
               logit_shift: int, first_block: bool) -> tuple[int, int]:
        """The positions a step that does not refresh recomputes, ``[q0, q1)``."""
        raise NotImplementedError

    def query_range(self, canvas_len: int, block_start: int, block_end: int, first_step: bool,
                    logit_shift: int, first_block: bool = True, refresh: bool | None = None
                    ) -> tuple[int, int]:
        """Half-open range [q0, q1) of canvas positions to recompute this step (for ``flash``,
        the window only: ``extra_positions`` adds the top-k). ``refresh``: whether this step
        recomputes the whole canvas (None: the mode's rule; the drift trigger,
        ``decoding/drift.py``, decides it for ``block_refresh`` modes)."""
        if refresh is None:
            refresh = self.refresh(first_step, first_block)
        if refresh or not self.keeps_kv:
            return 0, canvas_len
        return self.window(canvas_len, block_start, block_end, first_step, logit_shift,
                           first_block)

    def extra_positions(self, members: list[int], batch: list, states: list,
                        windows: list[tuple[int, int]], dev: torch.device
                        ) -> dict[int, torch.Tensor]:
        """Positions outside the window that a step recomputes too, decided on the device from
        earlier steps (batch index -> ascending positions). ``members``: the batch indices of this
        mode's requests. None by default."""
        return {}

    def __repr__(self) -> str:
        return f"<cache mode {self.name}>"


class NoCache(CacheMode):
    """The exact reference: every step recomputes the whole canvas."""

    name = "none"
    keeps_kv = False
    reusable = False

    def refresh(self, first_step: bool, first_block: bool) -> bool:
        return True


class _BlockRefreshCache(CacheMode):
    """Fast-dLLM's caches: a whole-canvas refresh at every block's first step."""

    block_refresh = True
    fusable = True
    streams_overflow = True
    suffix = False          # prefix: the masked suffix is recomputed with the block

    def window(self, canvas_len, block_start, block_end, first_step, logit_shift, first_block):
        q0 = block_start - logit_shift
        if first_step and not first_block:
            # a block start without a refresh (drift trigger): the previous block's last commits
            # are stale in the cache, so it is recomputed too
            q0 -= block_end - block_start
        return q0, canvas_len if self.suffix else block_end


class PrefixCache(_BlockRefreshCache):
    name = "prefix"
    suffix = True


class DualCache(_BlockRefreshCache):
    name = "dual"
    default_for = ("bidirectional",)


class FlashCache(CacheMode):
    """Flash-Cache: no refresh after the prefill; the active window plus the ``flash_budget``
    most-attended cached positions of the request's previous step are recomputed."""

    name = "flash"
    needs_mass = True
    block_causal_ok = False

    def refresh(self, first_step: bool, first_block: bool) -> bool:
        return first_step and first_block

    def window(self, canvas_len, block_start, block_end, first_step, logit_shift, first_block):
        q0 = block_start - logit_shift
        if first_step and not first_block:
            q0 -= block_end - block_start
        return q0, block_end

    def extra_positions(self, members, batch, states, windows, dev):
        """For each member with a previous step (``state.mass_src``: that step's mass and the
        request's row in it), the ``flash_budget`` cached positions outside its window that got
        the most attention mass, ascending. One batched topk per previous-step mass tensor
        (normally one per step); a request's very first step recomputes its whole canvas."""
        groups: dict[tuple[int, int], list[int]] = {}
        for b in members:
            r, st = batch[b], states[b]
            if st.mass_src is None:
                continue
            q0, q1 = windows[b]
            # reused pages [0, reused_len) are read-only: never among the recomputed positions
            k = min(r.params.flash_budget, r.canvas_len - (q1 - q0) - r.reused_len)
            if k > 0:      # same source and same k per topk call (ties: see select_top_k)
                groups.setdefault((id(st.mass_src[0]), k), []).append(b)
        out: dict[int, torch.Tensor] = {}
        for (_, k), group in groups.items():
            src = states[group[0]].mass_src[0]                           # [rows, keys]
            row, q0, q1, length, reused = h2d(
                [[states[b].mass_src[1] for b in group], [windows[b][0] for b in group],
                 [windows[b][1] for b in group], [batch[b].canvas_len for b in group],
                 [batch[b].reused_len for b in group]],
                torch.long, dev)[:, :, None]                             # one copy: 5 x [n, 1]
            rows = src[row[:, 0]]
            col = torch.arange(rows.shape[1], device=dev)[None, :]
            # NOTE: -1 for the window (mass >= 0 elsewhere), -inf past the canvas and in the
            # reused (read-only) prefix: never chosen while k <= canvas - window - reused
            rows = rows.masked_fill((col >= q0) & (col < q1), -1.0)
            rows = rows.masked_fill((col >= length) | (col < reused), float("-inf"))
            top = torch.topk(rows, k, dim=-1).indices.sort(dim=-1).values    # [n, k]
            for j, b in enumerate(group):
                out[b] = top[j]
        return out


class BlockCache(CacheMode):
    """The exact block KV cache of block-causal models (LLaDA2, SDAR): a position sees its own
    block and earlier ones, so a finished block's K/V never change. A step recomputes only the
    active block; a block's first step also recomputes the block before it, once, with its final
    tokens (its last commits were made after its last forward), and the request's first step
    computes the prompt's blocks with the first block (positions past the active block are never
    computed: no query sees them). Equal, token for token, to recomputing every block up to the
    active one at every step (``none``)."""

    name = "block"
    fusable = True
    fusable_first = True           # (the block before and the active one)
    needs_block_causal = True
    default_for = ("block_causal",)

    def query_range(self, canvas_len, block_start, block_end, first_step, logit_shift,
                    first_block=True, refresh=None):
        if first_step and first_block:
            return 0, block_end
        q0 = block_start - logit_shift
        if first_step:
            q0 -= block_end - block_start
        return max(0, q0), block_end


CACHE_MODES: Registry[CacheMode] = Registry("cache mode")
for _mode in (NoCache(), PrefixCache(), DualCache(), FlashCache(), BlockCache()):
    CACHE_MODES.register(_mode)


def fast_default(block_causal: bool) -> str:
    """The registered mode that declares itself the default for this attention
    (``CacheMode.default_for``): what a request of a model of no family default gets."""
    want = "block_causal" if block_causal else "bidirectional"
    for mode in CACHE_MODES.values():
        if want in mode.default_for:
            return mode.name
    raise LookupError(f"no registered cache mode declares itself the default for {want} "
                      "attention (CacheMode.default_for)")


def query_range(mode: str, canvas_len: int, block_start: int, block_end: int, first_step: bool,
                logit_shift: int, first_block: bool = True, refresh: bool | None = None
                ) -> tuple[int, int]:
    """``CACHE_MODES[mode].query_range(...)`` (``ValueError`` for an unknown mode)."""
    return CACHE_MODES[mode].query_range(canvas_len, block_start, block_end, first_step,
                                         logit_shift, first_block, refresh)
