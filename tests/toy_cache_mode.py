"""A toy cache mode, as a contributor would add one: one file, one class, registered with
``CACHE_MODES.register(TwoBlocks())`` (``tests/test_toy_seams.py`` does it). ``two_blocks``
refreshes the whole canvas only at the request's first step; every later step recomputes the
previous and the active block (so the last commits of a finished block are refreshed once more),
everything else is read from the cache. Its window is the same at every step of a block, so its
steady steps may run fused."""
from __future__ import annotations

from flash_dllm.cache.modes import CacheMode


class TwoBlocks(CacheMode):
    name = "two_blocks"
    fusable = True

    def refresh(self, first_step, first_block):
        return first_step and first_block

    def window(self, canvas_len, block_start, block_end, first_step, logit_shift, first_block):
        bl = block_end - block_start
        return max(0, block_start - bl - logit_shift), block_end
