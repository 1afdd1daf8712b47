"""The KV manager: which KV pages each request owns (no torch).

NOTE (ownership): the manager is the only writer of the page ledger (``PagePool``: free list and
reference counts). The scheduler asks it to reserve a request's pages at admission and to free
them when the request finishes or is aborted; the runner only reads the page ids it is given in
the step plan, and owns the bytes (the pool tensor) behind them. A request holds its pages from
admission to release, so the set of running requests always fits (never an OOM mid-flight).
"""
from __future__ import annotations

from flash_dllm.cache.page_pool import PagePool


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages, page_size)
        self._pages: dict[str, list[int]] = {}

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def pages_for(self, n_tokens: int) -> int:
        return self.pool.pages_for(n_tokens)

    def can_ever_fit(self, n_tokens: int) -> bool:
        return self.pool.can_ever_fit(n_tokens)

    def allocate(self, request_id: str, n_tokens: int) -> list[int] | None:
        """Reserve pages for a canvas of ``n_tokens`` tokens, or None when they do not fit now
        (never a partial allocation)."""
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} already holds KV pages")
        pages = self.pool.allocate(n_tokens)
        if pages is not None:
            self._pages[request_id] = pages
        return pages

    def pages(self, request_id: str) -> list[int] | None:
        return self._pages.get(request_id)

    def free(self, request_id: str) -> bool:
        """Release a request's pages; False when it holds none (idempotent)."""
        pages = self._pages.pop(request_id, None)
        if pages is None:
            return False
        self.pool.free(pages)
        return True
