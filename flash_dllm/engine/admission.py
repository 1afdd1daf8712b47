"""How long a new request would wait for admission, and the 429 when that is too long
(``EngineConfig.max_queue_wait``, issue 44).

The queue's length bounds memory (``max_waiting``), not time: 64 clients of a 2-core server all
queued with a 24 s median wait and no 429. ``QueueWait`` estimates a new request's wait as the
requests ahead of it, plus itself, over the engine's finish rate while requests waited: the
rate of a saturated engine is what it can do. A finish with no queue starts the window afresh
(an idle or trickling server's finishes follow its arrivals, not its capacity), and before two
finishes of the current backlog there is no estimate: the request is admitted.
"""
from __future__ import annotations

import math
import time
from collections import deque

from flash_dllm.engine.streams import QueueFullError

FINISH_WINDOW = 32         # finishes of the current backlog the rate averages over


class QueueWait:
    """The finish times of the current backlog and the estimate they give (not thread-safe:
    the caller holds its lock)."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.finishes: deque[float] = deque(maxlen=FINISH_WINDOW)

    def finished(self, backlog: bool) -> None:
        """A request finished; ``backlog``: requests were waiting for admission then."""
        if backlog:
            self.finishes.append(self.clock())
        else:
            self.finishes.clear()

    def estimate(self, ahead: int, free_slot: bool) -> float | None:
        """Seconds a request submitted now waits, with ``ahead`` requests waiting before it; 0
        when ``free_slot`` (a running slot is free) and none is ahead; None with no rate yet."""
        if ahead == 0 and free_slot:
            return 0.0
        if len(self.finishes) < 2:
            return None
        span = self.finishes[-1] - self.finishes[0]
        rate = (len(self.finishes) - 1) / max(span, 1e-6)        # finishes per second
        return (ahead + 1) / rate

    def check(self, bound: float, ahead: int, free_slot: bool) -> None:
        """``QueueFullError`` (with a ``retry_after``) when the estimate exceeds ``bound``
        seconds; a bound of 0 never refuses."""
        wait = self.estimate(ahead, free_slot) if bound else None
        if wait is not None and wait > bound:
            raise QueueFullError(
                f"the estimated wait for admission is {wait:.0f} s ({ahead} request(s) ahead; "
                f"{len(self.finishes) - 1} finished in "
                f"{self.finishes[-1] - self.finishes[0]:.1f} s), over --max-queue-wait "
                f"{bound:g} s", retry_after=max(1, math.ceil(wait - bound)))
