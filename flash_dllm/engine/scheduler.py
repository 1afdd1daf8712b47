"""The scheduler: which requests run, admission by KV pages, and each step's plan (CPU only).

NOTE: continuous batching happens at step granularity: requests join (admitted from ``waiting``
when their whole canvas's pages fit and a running slot is free, first come first served) and leave
(finished, aborted) between steps. A request larger than the whole pool (``--kv-overflow-gb``)
waits until nothing runs and then runs alone (``cache/io/kv_overflow.py``). The scheduler never touches the device; the query window of
each request comes from its cache mode (``cache/modes.py``).
"""
from __future__ import annotations

import itertools
from collections import deque

from flash_dllm.cache.kv_manager import KVCacheManager
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.core.plan import OverflowPlan, SeqPlan, StepPlan
from flash_dllm.core.request import Request
from flash_dllm.worker import extensions


class Scheduler:
    # waiting requests (from the head of the queue) whose prefix is prefetched from disk
    PREFETCH_AHEAD = 8

    def __init__(self, max_num_seqs: int, kv: KVCacheManager, logit_shift: int,
                 prefetch: bool = False) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv = kv
        self.prefetch = prefetch
        self._prefetched: set[str] = set()       # waiting requests whose prefetch was issued
        self.logit_shift = logit_shift
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # each running request's SeqPlan, rebuilt only when its block or refresh state changes;
        # the whole StepPlan is reused while nothing joined, left or changed block (the engine
        # calls ``invalidate``), so a steady batch costs no per-request planning
        self._plans: dict[str, tuple[tuple[int, bool], SeqPlan]] = {}
        self._last: StepPlan | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def find(self, request_id: str) -> Request | None:
        """The unfinished request with this id, running or waiting."""
        for req in itertools.chain(self.running, self.waiting):
            if req.request_id == request_id and not req.finished:
                return req
        return None

    def has_unfinished(self) -> bool:
        """A running request, or a waiting one not aborted (``Engine.abort`` drops an aborted
        one from ``waiting``; one finished there by other means is skipped at admission)."""
        return bool(self.running) or any(not r.finished for r in self.waiting)

    @property
    def num_waiting(self) -> int:
        return sum(1 for r in self.waiting if not r.finished)

    def admit(self) -> list[Request]:
        """Move waiting requests to running while a slot is free and their pages fit (FIFO: the
        first that does not fit blocks the ones behind it). Returns the admitted requests."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            if any(r.overflow is not None and not r.finished for r in self.running):
                break                 # a request larger than the pool runs alone
            req = self.waiting.popleft()
            if req.finished:          # aborted while waiting
                continue
            if not self.kv.can_ever_fit(req.canvas_len):
                # larger than the pool (``cache/io/kv_overflow.py``; the engine validated it):
                # waits until nothing runs, then takes the whole pool
                pages = None if self.running else self.kv.allocate_overflow(req.request_id,
                                                                            req.canvas_len)
                if pages is None:
                    self.waiting.appendleft(req)
                    break
                n = self.kv.pages_for(req.canvas_len)
                req.overflow = OverflowPlan(n - len(pages), pages)
                self._prefetched.discard(req.request_id)
                req.reused_len = 0
                self.running.append(req)
                admitted.append(req)
                break
            # NOTE: on a block-causal model's grid a position's K/V depend on its whole block:
            # the reused prefix is whole blocks (``align``)
            alloc = self.kv.allocate(req.request_id, req.canvas_len, req.prompt_ids,
                                     reuse=CACHE_MODES[req.params.cache].reusable,
                                     mode=req.params.cache, align=req.grid)
            if alloc is None:
                self.waiting.appendleft(req)
                break
            self._prefetched.discard(req.request_id)
            req.reused_len = alloc.reused_len
            self.running.append(req)
            admitted.append(req)
        if self.prefetch and self.kv.l2_slots and (self.waiting or self._prefetched):
            self._prefetch_waiting()
        return admitted

    def _prefetch_waiting(self) -> None:
        """Queue-ahead prefetch: the disk copies of the reusable prefixes of the first
        ``PREFETCH_AHEAD`` waiting requests start moving to host memory while they wait
        (``KVCacheManager.prefetch``), once per request."""
        if self._prefetched:
            gone = self._prefetched - {r.request_id for r in self.waiting if not r.finished}
            for rid in gone:                        # aborted while waiting
                self.kv.cancel_prefetch(rid)
            self._prefetched -= gone
        for req in itertools.islice(self.waiting, self.PREFETCH_AHEAD):
            if (req.finished or not CACHE_MODES[req.params.cache].reusable
                    or req.request_id in self._prefetched
                    or not self.kv.can_ever_fit(req.canvas_len)):    # (never reuses)
                continue
            self._prefetched.add(req.request_id)
            self.kv.prefetch(req.request_id, req.prompt_ids, req.params.cache)

    def invalidate(self) -> None:
        """A running request finished, was aborted, or entered a new block or refresh state."""
        self._last = None

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan one step for every running request."""
        if self.admit():
            self._last = None
        if self._last is None:
            self.drop_finished()
            self._last = StepPlan([self._plan(r) for r in self.running])
        self._last.ops = self.kv.take_ops()
        return self._last

    def remove(self, req: Request) -> None:
        """Take an unfinished request out (it moves to another engine: ``disagg/migrate.py``)."""
        self.running = [r for r in self.running if r is not req]
        self.waiting = deque(r for r in self.waiting if r is not req)
        self._plans.pop(req.request_id, None)
        self._last = None

    def drop_waiting(self, req: Request) -> None:
        """Take ``req`` out of the queue if it waits there (an abort: ``Engine.abort``), and
        cancel its queue-ahead prefetch now (not at the next admission: the engine may be
        idle until then)."""
        try:
            self.waiting.remove(req)          # (by identity: Request defines no __eq__)
        except ValueError:
            return
        if req.request_id in self._prefetched:
            self._prefetched.discard(req.request_id)
            self.kv.cancel_prefetch(req.request_id)

    def requeue(self, req: Request) -> None:
        """A running request goes back to the head of the queue (its admission was undone)."""
        self.running = [r for r in self.running if r is not req]
        self._plans.pop(req.request_id, None)
        req.reused_len = 0
        self.waiting.appendleft(req)
        self._last = None

    def _plan(self, r: Request) -> SeqPlan:
        key = (r.block, r.first_step, r.stale)
        cached = self._plans.get(r.request_id)
        if cached is not None and cached[0] == key:
            return cached[1]
        q0, q1 = CACHE_MODES[r.params.cache].query_range(
            r.canvas_len, r.block_start, r.block_end, r.first_step, self.logit_shift,
            first_block=r.block == 0, refresh=extensions.refresh(r))
        # NOTE: reused pages are shared and read-only: nothing below reused_len is recomputed
        window = (max(q0, r.reused_len), q1)
        if r.overflow is not None:         # logical page ids: the runner's stage
            plan = SeqPlan(r, window, list(range(r.overflow.num_pages)), overflow=r.overflow)
        else:
            plan = SeqPlan(r, window, self.kv.pages(r.request_id))
        self._plans[r.request_id] = (key, plan)
        return plan

    def drop_finished(self) -> None:
        self._last = None
        if any(r.finished for r in self.running):
            for r in self.running:
                if r.finished:
                    self._plans.pop(r.request_id, None)
            self.running = [r for r in self.running if not r.finished]
