"""The draft sentinels of ``decode="verify"``: cheap per-slot checks that turn a slot the threshold
rule would commit into a draft that must pass verification (``decoding/sentinels.py`` holds the
tensor math). Both hook into the policy's selection (``demote``)."""
from __future__ import annotations

import torch

from flash_dllm.core.counters import count
from flash_dllm.decoding.sentinels import entropy, perturbation_flips
from flash_dllm.transfer import h2d
from flash_dllm.worker.extensions.base import StepExtension


class EntropySentinel(StepExtension):
    """``entropy_max``: a slot whose predictive entropy (nats) exceeds it is drafted."""

    name = "entropy"

    def active(self, req) -> bool:
        return req.params.entropy_max is not None

    def demote(self, ctx, members, passing, gid) -> torch.Tensor:
        """[n_slot] bool: the passing slots of ``members`` (``gid``: member index per slot, -1
        for others) whose entropy is too high."""
        dev, G = passing.device, len(members)
        demoted = torch.zeros_like(passing)
        h_max = [ctx.batch[i].params.entropy_max for i in members]
        sel = gid >= 0
        hm = h2d([float("inf") if h is None else h for h in h_max], torch.float32, dev)
        on = torch.zeros_like(passing)
        on[sel] = h2d([h is not None for h in h_max], torch.bool, dev)[gid[sel]]
        rows = torch.nonzero(passing & on).squeeze(-1)
        trig = entropy(ctx.logits[rows]) > hm[gid[rows]]
        demoted[rows[trig]] = True
        checks = torch.bincount(gid[rows], minlength=G).tolist()
        trigs = torch.bincount(gid[rows[trig]], minlength=G).tolist()
        for g, i in enumerate(members):
            count(ctx.counters, i, "sentinel_checks", checks[g], "entropy")
            count(ctx.counters, i, "sentinel_triggers", trigs[g], "entropy")
        return demoted


class PerturbationSentinel(StepExtension):
    """``perturb_sigma``: a slot whose top-1 changes under N(0, sigma^2) logit noise (seeded by the
    request's ``seed``, else 0) is drafted."""

    name = "perturbation"

    def active(self, req) -> bool:
        return req.params.perturb_sigma is not None

    def demote(self, ctx, members, passing, gid) -> torch.Tensor:
        demoted = torch.zeros_like(passing)
        for i in members:
            req, st, sigma = ctx.batch[i], ctx.states[i], ctx.batch[i].params.perturb_sigma
            if sigma is None:
                continue
            s, e = ctx.bounds[i]
            rows = s + torch.nonzero(passing[s:e]).squeeze(-1)
            if rows.numel() == 0:
                continue
            if st.sentinel_generator is None:
                seed = req.params.seed if req.params.seed is not None else 0
                st.sentinel_generator = torch.Generator(device=passing.device).manual_seed(seed)
            trig = perturbation_flips(ctx.logits[rows], sigma, st.sentinel_generator,
                                      forbid=ctx.mask_id)
            demoted[rows[trig]] = True
            count(ctx.counters, i, "sentinel_checks", rows.numel(), "perturbation")
            count(ctx.counters, i, "sentinel_triggers", int(trig.sum()), "perturbation")
        return demoted
