"""``threshold`` (Fast-dLLM): every masked slot whose confidence reaches ``threshold``, and always
the block's single most confident slot, so each step makes progress."""
from __future__ import annotations

import numpy as np
import torch

from flash_dllm.decoding.policies.base import DecodePolicy
from flash_dllm.decoding.policies.rules import group_ids, select_threshold, threshold_rows
from flash_dllm.transfer import h2d


class ThresholdPolicy(DecodePolicy):
    name = "threshold"
    fusable = True
    warm_up = True

    def select(self, ctx, members):
        conf = ctx.conf
        gid = group_ids(conf.shape[0], [ctx.bounds[i] for i in members], conf.device)
        # rows of other policies join a last, never-passing group (no boolean indexing, which
        # would sync), and are masked out of the result
        G = len(members)
        tau = h2d([ctx.batch[i].params.threshold for i in members] + [float("inf")], conf.dtype,
                  conf.device)
        mine = gid >= 0
        ctx.keep |= select_threshold(conf, torch.where(mine, gid, G), G + 1, tau) & mine

    def fused_fields(self, batch, signature, dims):
        return (), [("tau", len(batch))]

    def fill_fused(self, host, sl, batch, signature, arena_rows):
        host[sl["tau"]] = np.array([r.params.threshold for r in batch],
                                   dtype=np.float64).view(np.int64)

    def fused_keep(self, conf, masked, inp, sl, key):
        return threshold_rows(conf, masked, inp[sl["tau"]].view(torch.float64))
