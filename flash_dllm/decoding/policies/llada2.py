"""``llada2``: the commit rule of LLaDA2's published sampler (``generate`` in its
``modeling_llada2_moe.py``). At step s of a block, with k = the step schedule's count (the block
length spread over ``steps_per_block`` steps, ``decoding/schedule.py``, capped at the masked
slots left): if at least k masked slots have a confidence strictly above ``threshold``, commit
all of them; otherwise commit the k most confident. With one step per token (its defaults:
``steps`` = block length, k = 1) it is Fast-dLLM's threshold rule but for ``>`` instead of ``>=``.

Ties among the k most confident break as the reference's ``torch.topk`` over a row the length of
the block (-inf at unmasked slots) breaks them; the general and the fused step build that row the
same way, so they agree.
"""
from __future__ import annotations

import numpy as np
import torch

from flash_dllm.decoding.policies.base import DecodePolicy
from flash_dllm.decoding.policies.rules import group_ids, select_top_k, top_k_rows
from flash_dllm.decoding.schedule import transfer_count
from flash_dllm.transfer import h2d


class LLaDA2Policy(DecodePolicy):
    name = "llada2"
    fusable = True
    # k follows the step within the block (the schedule)
    fused_static_per_block = False

    @staticmethod
    def _k(req) -> int:
        return min(transfer_count(req), req.num_masked)

    def select(self, ctx, members):
        batch, conf, dev = ctx.batch, ctx.conf, ctx.conf.device
        bounds = [ctx.bounds[i] for i in members]
        ks = [self._k(batch[i]) for i in members]
        G = len(members)
        gid = group_ids(conf.shape[0], bounds, dev)
        mine = gid >= 0
        g = torch.where(mine, gid, G)                    # others: a last, never-passing group
        tau = h2d([batch[i].params.threshold for i in members] + [float("inf")], conf.dtype, dev)
        k = h2d(ks + [0], torch.long, dev)
        high = (conf > tau[g]) & mine
        n_high = torch.zeros(G + 1, dtype=torch.long, device=dev).scatter_add_(
            0, g, high.long())
        # the top-k rule on rows the length of each block (block-relative positions)
        start = h2d([batch[i].block_start for i in members] + [0], torch.long, dev)
        top = select_top_k(conf, ctx.positions - start[g], bounds, ks,
                           [batch[i].params.block_length for i in members])
        ctx.keep |= torch.where(n_high[g] >= k[g], high, top) & mine

    # NOTE (fused): the top-k side groups requests by (block length, k) as ``select_top_k``
    # groups them; the groups are part of the graph's key, ``perm`` lists the rows group by group
    def fused_signature(self, req) -> int:
        return self._k(req)

    def fused_fields(self, batch, signature, dims):
        by: dict[tuple[int, int], list[int]] = {}
        for b, (r, k) in enumerate(zip(batch, signature)):
            by.setdefault((r.params.block_length, k), []).append(b)
        groups, a = [], 0
        for (length, k), members in by.items():
            groups.append((length, k, a, a + len(members)))
            a += len(members)
        B = len(batch)
        key = (tuple(groups), tuple(b for members in by.values() for b in members))
        return key, [("perm", B), ("tau", B), ("k", B)]

    def fill_fused(self, host, sl, batch, signature, arena_rows):
        key, _ = self.fused_fields(batch, signature, None)
        host[sl["perm"]] = key[1]
        host[sl["tau"]] = np.array([r.params.threshold for r in batch],
                                   dtype=np.float64).view(np.int64)
        host[sl["k"]] = signature

    def fused_keep(self, conf, masked, inp, sl, key):
        B = conf.shape[0]
        tau = inp[sl["tau"]].view(torch.float64).to(conf.dtype)
        high = (conf > tau[:, None]) & masked
        zero = torch.zeros(B, dtype=torch.long, device=conf.device)   # block-relative rows
        top = top_k_rows(conf, masked, inp[sl["perm"]], zero, key[0])
        return torch.where((high.sum(1) >= inp[sl["k"]])[:, None], high, top)
