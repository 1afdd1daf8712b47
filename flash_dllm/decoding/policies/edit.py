"""``edit``: LLaDA2.1's joint threshold decoding, mask-to-token (M2T) and token-to-token (T2T)
editing (its ``JointThreshold`` sampler as SGLang runs it). Every step of a block:

- M2T: every masked slot whose confidence is strictly above ``threshold``, or, when none is, the
  single most confident masked slot;
- T2T: every decoded slot of the block (not the prompt's) whose prediction differs from its
  token with a probability above ``edit_threshold``, replaced by the prediction;
- the block ends when a step changes nothing, or when it has had no mask for
  ``max_post_edit_steps`` steps (that step changes nothing).

The engine asks the policy to score every answer slot of the block (``edits``), commits the
kept slots' tokens over their current ones, and keeps the block's text provisional until the
block ends (``core/request.Request``). One deviation: MASK is never a prediction here (the
engine never proposes it), so T2T never re-masks a token.
"""
from __future__ import annotations

import torch

from flash_dllm.decoding.policies.base import DecodePolicy
from flash_dllm.decoding.policies.rules import group_ids
from flash_dllm.transfer import h2d


class EditPolicy(DecodePolicy):
    name = "edit"
    edits = True

    def select(self, ctx, members):
        batch, conf, dev = ctx.batch, ctx.conf, ctx.conf.device
        G = len(members)
        gid = group_ids(conf.shape[0], [ctx.bounds[i] for i in members], dev)
        mine = gid >= 0
        g = torch.where(mine, gid, G)
        masked = (ctx.current == ctx.mask_id) & mine
        # M2T: above threshold, else the best masked slot (the earliest on ties)
        tau = h2d([batch[i].params.threshold for i in members] + [float("inf")], conf.dtype, dev)
        m2t = masked & (conf > tau[g])
        score = torch.where(masked, conf, -1.0)
        best = torch.full((G + 1,), -1.0, dtype=conf.dtype, device=dev).scatter_reduce(
            0, g, score, reduce="amax")
        idx = torch.arange(conf.shape[0], device=dev)
        first = torch.full((G + 1,), conf.shape[0], dtype=idx.dtype, device=dev).scatter_reduce(
            0, g, torch.where(masked & (score == best[g]), idx, conf.shape[0]), reduce="amin")
        none = torch.zeros(G + 1, dtype=torch.long, device=dev).scatter_add_(
            0, g, m2t.long()) == 0
        m2t |= masked & none[g] & (idx == first[g])
        # T2T: a decoded slot whose prediction differs, above edit_threshold; none once the block
        # has spent its post-edit steps (the step that ends it changes nothing)
        open_ = [batch[i].num_masked > 0 or batch[i].post_edit_steps < batch[i].params.
                 max_post_edit_steps for i in members]
        edit_tau = h2d([batch[i].params.edit_threshold if ok else float("inf")
                        for i, ok in zip(members, open_)] + [float("inf")], conf.dtype, dev)
        t2t = ~masked & mine & (ctx.tokens != ctx.current) & (conf > edit_tau[g])
        ctx.keep |= m2t | t2t
