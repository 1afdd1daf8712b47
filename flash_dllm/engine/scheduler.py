"""The scheduler: which requests run, admission by KV pages, and each step's plan (CPU only).

NOTE: continuous batching happens at step granularity: requests join (admitted from ``waiting``
when their whole canvas's pages fit and a running slot is free, first come first served) and leave
(finished, aborted) between steps. The scheduler never touches the device; the query window of
each request comes from its cache mode (``cache/modes.py``).
"""
from __future__ import annotations

import itertools
from collections import deque

from flash_dllm.cache.kv_manager import KVCacheManager
from flash_dllm.cache.modes import query_range
from flash_dllm.engine.plan import SeqPlan, StepPlan
from flash_dllm.engine.request import Request


class Scheduler:
    def __init__(self, max_num_seqs: int, kv: KVCacheManager, logit_shift: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv = kv
        self.logit_shift = logit_shift
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        """The unfinished request with this id, running or waiting."""
        for req in itertools.chain(self.running, self.waiting):
            if req.request_id == request_id and not req.finished:
                return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if not r.finished)

    def admit(self) -> list[Request]:
        """Move waiting requests to running while a slot is free and their pages fit (FIFO: the
        first that does not fit blocks the ones behind it). Returns the admitted requests."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.finished:          # aborted while waiting
                continue
            if self.kv.allocate(req.request_id, req.canvas_len) is None:
                self.waiting.appendleft(req)
                break
            self.running.append(req)
            admitted.append(req)
        return admitted

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan one step for every running request."""
        self.admit()
        self.running = [r for r in self.running if not r.finished]
        shift = self.logit_shift
        return StepPlan([SeqPlan(r, query_range(r.params.cache, r.canvas_len, r.block_start,
                                                r.block_end, r.first_step, shift,
                                                first_block=r.block == 0),
                                 self.kv.pages(r.request_id)) for r in self.running])

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]
