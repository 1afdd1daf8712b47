"""Attention-mass collection for the cache modes that need it (``CacheMode.needs_mass``: ``flash``,
whose next step recomputes the most-attended cached positions) and for placement policies that
learn from attention (``kv_placement`` ema / kag: the mass per page, summed over a request's
block by the engine and handed to the KV manager)."""
from __future__ import annotations

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.worker.extensions.base import StepExtension


class AttentionMass(StepExtension):
    name = "attention_mass"
    wants_mass = True

    def active(self, req) -> bool:
        return CACHE_MODES[req.params.cache].needs_mass

    def after_forward(self, runner, step, states, members):
        mass = step.meta.mass.clone()    # one copy (a graph's output is overwritten on replay)
        for i in members:
            states[i].mass_src = (mass, i)
        if runner.collect_page_mass:     # (placement: after the step, never mid-step)
            step.ext[self.name] = mass.view(mass.shape[0], -1, runner.page_size).sum(-1)

    def read_back(self, runner, step, members, column, counters):
        """Request id -> attention mass per canvas page (np), when placement wants it."""
        page_mass = step.ext.get(self.name)
        if page_mass is None:
            return None
        per_page = page_mass.cpu().numpy()
        return {step.batch[i].request_id: per_page[i] for i in members}

    def apply(self, engine, req, value) -> None:
        engine.block_mass.add(req, value.get(req.request_id))
