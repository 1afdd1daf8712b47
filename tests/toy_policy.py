"""A toy decode policy, as a contributor would add one: one file, one class, registered with
``DECODE_POLICIES.register(Leftmost())`` (``tests/test_toy_seams.py`` does it). ``leftmost``
commits the leftmost masked slot of the block at every step: autoregressive order inside the
block. It has a graph-safe form, so steady steps also run fused."""
from __future__ import annotations

import torch

from flash_dllm.decoding.policies import DecodePolicy
from flash_dllm.transfer import h2d


class Leftmost(DecodePolicy):
    name = "leftmost"
    fusable = True

    def select(self, ctx, members):
        # a request's masked slots come in canvas order: its first slot is its leftmost one
        first = [ctx.bounds[i][0] for i in members if ctx.bounds[i][1] > ctx.bounds[i][0]]
        if first:
            ctx.keep[h2d(first, torch.long, ctx.keep.device)] = True

    def fused_keep(self, conf, masked, inp, sl, key):
        return masked & (masked.cumsum(1) == 1)
