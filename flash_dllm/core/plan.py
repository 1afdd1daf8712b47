"""The data that crosses the engine's seams each step (host data, no device state).

``Scheduler.schedule() -> StepPlan``; ``ModelRunner.execute(plan) -> StepResult``;
``Engine`` applies the result to its requests. Features plug in here: the memory tiers add the
pages to load and store to the plan, disaggregation the pages to send.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flash_dllm.core.request import Request


@dataclass
class OverflowPlan:
    """Where a request larger than the GPU pool keeps its pages (``cache/io/kv_overflow.py``):
    its first ``spill`` logical pages in host memory, the rest in the pool pages ``resident``
    (in logical order)."""

    spill: int
    resident: list[int]

    @property
    def num_pages(self) -> int:
        return self.spill + len(self.resident)


@dataclass
class SeqPlan:
    """One request's part of a step.

    ``window``: the canvas positions ``[q0, q1)`` the step recomputes (its cache mode's query
    range, ``cache/modes.py``). The runner may add positions decided on the device from earlier
    steps' attention (``cache="flash"``'s top-k, the KV sentinel's refresh) and, for
    ``decode="verify"``, the verification rows of its pending drafts. ``pages``: the request's KV
    pages, which must be resident for the step (its block table row), except for an overflow
    request's."""

    req: Request
    window: tuple[int, int]
    pages: list[int]
    # a request larger than the GPU pool (``cache/io/kv_overflow.py``): ``pages`` are then its
    # logical page ids 0..n-1 (the stage's), this says which are in host memory and which pool
    # pages hold the rest
    overflow: OverflowPlan | None = None

    @property
    def pool_pages(self) -> list[int]:
        """The GPU pool pages the step touches: ``pages``, or an overflow request's resident
        pool pages (its ``pages`` are logical ids)."""
        return self.pages if self.overflow is None else self.overflow.resident


@dataclass
class StepPlan:
    """``ops``: the KV manager's tier ops (``cache/tiers.py``) to carry out before the step:
    stores (L0 -> L1) first, then spills, fetches and loads of the pages reused requests need."""

    seqs: list[SeqPlan] = field(default_factory=list)
    ops: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.requests: list[Request] = [s.req for s in self.seqs]

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepResult:
    """What the runner hands back after a step, in ONE device->host copy: each request's active
    block as the step left it (``blocks`` [B, max block length] int64; columns past a request's
    block length are padding). Counters: per request, the verify / sentinel counts of this step
    (``core/counters.new_counters`` layout) or None when none was counted. ``extensions``: each
    step extension's result for the engine, by extension name (``worker/extensions``)."""

    blocks: np.ndarray
    counters: list[dict | None] | None = None
    ops_done: list = field(default_factory=list)   # (op, ok, seconds) of completed tier ops
    failed: set = field(default_factory=set)       # request ids skipped: a reused page failed
    #                                                verification (``blocks`` omits their rows)
    errors: dict = field(default_factory=dict)     # request id -> why it failed for good
    #                                                (``blocks`` omits its row)
    extensions: dict = field(default_factory=dict)
