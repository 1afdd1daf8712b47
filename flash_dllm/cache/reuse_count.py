"""Prefix-cache lookups and hits, counted once an admission's loads passed their checks (no torch).

A reused page below L0 is a hit only once its load was verified. An admission with loads is
counted (prompt tokens looked up, hits per tier) when all its loads reported ok; one that failed
undoes the admission (``KVCacheManager.load_failed``) and the request's next admission counts
instead: a page that failed its check is a miss, and a prompt is looked up once however often it
is admitted.
"""
from __future__ import annotations

from flash_dllm.cache.tiers import Load


class ReuseCount:
    """Writes ``query_tokens`` and ``hit_tokens[tier]`` of the KV manager's ``stats``."""

    def __init__(self, stats: dict, page_size: int) -> None:
        self.stats, self.page_size = stats, page_size
        # request id -> (tokens looked up, tier per reused page, load -> ok (None: not yet))
        self._waiting: dict[str, tuple[int, list[int], dict[int, bool | None]]] = {}

    def admitted(self, request_id: str, looked_up: int, hit_tiers: list[int],
                 loads: list) -> None:
        if loads:
            self._waiting[request_id] = (looked_up, hit_tiers, {id(op): None for op in loads})
        else:
            self._count(looked_up, hit_tiers)

    def verified(self, results: list) -> None:
        """The runner's ``(op, ok, seconds)`` results: count the admissions whose loads all
        passed; forget those with a failed one."""
        if not self._waiting:
            return
        ok = {id(op): good for op, good, _ in results if isinstance(op, Load)}
        for rid, (looked_up, hit_tiers, loads) in list(self._waiting.items()):
            for k in loads.keys() & ok.keys():
                loads[k] = ok[k]
            if False in loads.values():
                del self._waiting[rid]
            elif None not in loads.values():
                del self._waiting[rid]
                self._count(looked_up, hit_tiers)

    def forget(self, request_id: str) -> None:
        """The admission was undone or released before its loads reported: not counted."""
        self._waiting.pop(request_id, None)

    def _count(self, looked_up: int, hit_tiers: list[int]) -> None:
        self.stats["query_tokens"] += looked_up
        for t in hit_tiers:
            self.stats["hit_tokens"][t] += self.page_size
