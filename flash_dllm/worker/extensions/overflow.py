"""Requests larger than the GPU pool (``cache/io/kv_overflow.py``, ``--kv-overflow-gb``) as a step
extension: their step attends through the overflow stage's metadata (``wrap_metadata``), and
under lazy loading each step's attention per loaded page (and quest's page scores) is read back
for the resident-set choice and the lazy-load sentinel (``after_forward`` / ``read_back``)."""
from __future__ import annotations

from flash_dllm.cache.io.kv_overflow import OverflowMetadata
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.core.counters import count
from flash_dllm.worker.extensions.base import StepExtension


class OverflowStream(StepExtension):
    name = "overflow"

    def active(self, req) -> bool:
        return req.overflow is not None

    def wrap_metadata(self, runner, plan, step) -> None:
        """The request's step metadata over the stage (its host buffer and resident page index
        made at its first step; the window of the block's later steps is kept resident)."""
        seq = plan.seqs[0]                 # (an overflow request runs alone)
        r, st = seq.req, runner.overflow_state
        if st is None or st.request_id != r.request_id:
            st = runner.overflow_state = runner.overflow.new_state(r.request_id, seq.overflow)
        steady = CACHE_MODES[r.params.cache].query_range(
            r.canvas_len, r.block_start, r.block_end, False, runner.cfg.logit_shift,
            first_block=False, refresh=False)
        step.meta = runner.overflow.step(step.meta, seq.overflow, st, seq.window, r.canvas_len,
                                         steady)

    def after_forward(self, runner, step, states, members):
        # lazy loading: where the step attended, per page of its block table (a measuring step:
        # every page, for the block's next steps; a lazy step: the loaded ones, for the
        # sentinel); reduced on the device here, read after the step's one sync
        meta = step.meta
        if isinstance(meta, OverflowMetadata) and meta.mass is not None:
            n = meta.mass_pages
            step.ext[self.name] = meta.mass[0, :n * runner.page_size].view(n, -1).sum(-1).float()

    def read_back(self, runner, step, members, column, counters):
        meta = step.meta
        if not isinstance(meta, OverflowMetadata):
            return None
        if meta.quest_score is not None:
            runner.overflow.observe_score(runner.overflow_state, meta.quest_score.cpu().numpy())
        lazy_mass = step.ext.get(self.name)
        if lazy_mass is not None:
            checked, trig = runner.overflow.observe(runner.overflow_state, meta.lazy,
                                                    lazy_mass.cpu().numpy())
            if checked:
                count(counters, 0, "sentinel_checks", 1, "lazy_load")
                count(counters, 0, "sentinel_triggers", int(trig), "lazy_load")
        return None
