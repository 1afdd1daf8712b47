"""KV page pool: fixed-size pages with reference counts; the engine's admission ledger (no torch).

A request's canvas occupies ``ceil(canvas_len / page_size)`` pages for its whole life. The engine
reserves them when it admits the request and frees them when it finishes or aborts, so the set of
running requests always fits in memory (never an OOM mid-flight). Pages are reference-counted so a
later prefix cache can share one page between requests with a common prompt prefix: ``share``
takes another reference, ``free`` drops one, and a page returns to the free list at zero.

The ledger holds no bytes: the K/V of page ``p`` live at ``kv[:, :, p]`` in the runner's pool
tensor (``cache/paged.py``); ``cache/kv_manager.py`` maps requests to their pages.
"""
from __future__ import annotations


class PagePool:
    """``num_pages`` pages of ``page_size`` tokens each."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        for name, v in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        # NOTE: LIFO free list: recently freed (cache-warm) pages are reused first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs: list[int] = [0] * num_pages

    # ---------------------------------------------------------------------------------- queries
    def pages_for(self, n_tokens: int) -> int:
        """Pages that ``n_tokens`` tokens occupy."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"n_tokens must be an integer >= 0, got {n_tokens!r}")
        return -(-n_tokens // self.page_size)

    def can_ever_fit(self, n_tokens: int) -> bool:
        """Whether ``n_tokens`` fit in the pool when it is empty."""
        return self.pages_for(n_tokens) <= self.num_pages

    def can_allocate(self, n_tokens: int) -> bool:
        return self.pages_for(n_tokens) <= len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page: int) -> int:
        self._check_page(page)
        return self._refs[page]

    # -------------------------------------------------------------------------------- mutations
    def allocate(self, n_tokens: int) -> list[int] | None:
        """Fresh pages (reference count 1) for ``n_tokens`` tokens, or None if they do not all fit
        now; never a partial allocation."""
        n = self.pages_for(n_tokens)
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> list[int]:
        """Take one more reference on each (allocated) page; returns ``pages`` for chaining."""
        for p in pages:
            self._check_page(p)
            if self._refs[p] == 0:
                raise ValueError(f"cannot share page {p}: it is not allocated")
        for p in pages:
            self._refs[p] += 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference on each page; pages reaching zero return to the free list.

        Raises ``ValueError`` (and changes nothing) on a double free: a page that is not allocated,
        or listed more times than it has references.
        """
        drop: dict[int, int] = {}
        for p in pages:
            self._check_page(p)
            drop[p] = drop.get(p, 0) + 1
        for p, k in drop.items():
            if k > self._refs[p]:
                raise ValueError(f"double free of page {p}: {k} release(s), "
                                 f"{self._refs[p]} reference(s)")
        for p, k in drop.items():
            self._refs[p] -= k
            if self._refs[p] == 0:
                self._free.append(p)

    def _check_page(self, page: int) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise ValueError(f"page must be an integer in [0, {self.num_pages}), got {page!r}")

    def __repr__(self) -> str:
        return (f"PagePool(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"used={self.num_used})")
