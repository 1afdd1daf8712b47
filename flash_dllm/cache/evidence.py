"""Placement evidence: each request's attention mass per page, summed over a decoded block (or
over every N steps, ``kag_update``) and handed to the KV manager's placement policy
(``KVCacheManager.observe``) once per block. The ``flash`` cache mode's steps provide the mass
(``worker/extensions/mass.py``); the engine applies it after each step."""
from __future__ import annotations

import numpy as np


class BlockMass:
    def __init__(self, kv_manager, every: int | None) -> None:
        self.kv = kv_manager
        self.every = every                         # None: once per block
        self.pending: dict[str, np.ndarray] = {}   # request id -> mass summed so far
        self._steps: dict[str, int] = {}           # steps summed per request (every-N-steps)

    def add(self, req, page_mass: np.ndarray | None) -> None:
        """Add a step's mass (None: the request had none this step); at the block's end (or the
        request's, or every N steps) hand the sum over."""
        rid = req.request_id
        if page_mass is not None:
            acc = self.pending.get(rid)
            self.pending[rid] = page_mass if acc is None else acc + page_mass
            self._steps[rid] = self._steps.get(rid, 0) + 1
        due = req.first_step or req.finished or (
            self.every is not None and self._steps.get(rid, 0) >= self.every)
        if due and rid in self.pending:
            self._steps.pop(rid, None)
            self.kv.observe(rid, self.pending.pop(rid))

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted, moved): its unsent evidence goes."""
        self.pending.pop(request_id, None)
        self._steps.pop(request_id, None)
