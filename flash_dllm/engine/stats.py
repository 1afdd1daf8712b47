"""``engine_stats``: an ``Engine``'s ``EngineStats`` snapshot, read from its parts on its thread.

Everything the server's ``/metrics`` renders of a single-device (or tensor-parallel rank 0)
engine: its own counters (``Engine.stats``), the KV manager's ledger and tier counters, the
overflow streamer's and the offloader's counters, the runner's CUDA graph counts and the
process's Triton compiles. Each part is read through a small accessor and copied, so the
snapshot never changes after it was built.

NOTE: call it on the engine thread only: ``cached_pages`` and ``num_used`` scan the ledger
(O(pages)), which is why the async engine builds a snapshot at most every ``STATS_INTERVAL_S``
while busy instead of after every step.
"""
from __future__ import annotations

from flash_dllm.core.stats import (EngineStats, HistogramStats, OverflowStats, RuntimeStats,
                                   TierStats, frozen_map)
from flash_dllm.config import LM_HEAD_SUFFIX
from flash_dllm.worker.compile_watch import KERNEL_COMPILES, graph_counts

# ``Engine.stats`` entries with a field of their own; the rest are ``EngineStats.counters``
_OWN = ("forwards", "tokens_committed", "step_seconds", "last_batch_size", "failed_steps")


def engine_stats(engine) -> EngineStats:
    """The snapshot of ``engine`` (an ``Engine``) now."""
    st = engine.stats
    running, waiting = engine.counts()
    kv = engine.kv_manager
    runner = engine.runner
    ov = runner.overflow
    return EngineStats(
        running=running, waiting=waiting, pages_used=kv.num_used, pages_total=kv.num_pages,
        page_size=kv.page_size, forwards=st["forwards"],
        tokens_committed=st["tokens_committed"], step_seconds=st["step_seconds"],
        last_batch_size=st["last_batch_size"], failed_steps=st.get("failed_steps", 0),
        counters=frozen_map({k: v for k, v in st.items() if k not in _OWN}),
        tiers=tier_stats(kv, runner.offload),
        overflow=None if ov is None else OverflowStats(
            h2d_bytes=ov.stats["h2d_bytes"], d2h_bytes=ov.stats["d2h_bytes"],
            steps=ov.stats["steps"]),
        runtime=runtime_stats(runner), weight_bytes=runner.weight_bytes,
        # (--quantize-lm-head: "int4+head", as bench step names the mode)
        quantization=(runner.quantization or "none")
        + (LM_HEAD_SUFFIX if runner.weight_info.get("lm_head") else ""))


def tier_stats(kv, offload) -> TierStats:
    """The KV manager's tier and prefix-reuse counters; the offloader's latencies (if any)."""
    st = kv.stats
    # every (tier, direction) a copy can take, 0 until it happens (dashboards and alerts find
    # the series from the start)
    moved = {(t, d): 0 for t in kv.tier_names[1:] for d in ("down", "up")}
    moved.update(st["bytes_moved"])
    latency = {}
    if offload is not None:
        for name in ("load", "store"):
            snap = offload.latency[name].snapshot()
            latency[name] = HistogramStats(tuple((le, int(c)) for le, c in snap["buckets"]),
                                           snap["count"], snap["sum"])
    return TierStats(
        page_bytes=kv.page_bytes, tier_names=tuple(kv.tier_names),
        cached_pages=tuple(kv.cached_pages()),
        query_tokens=st["query_tokens"], hit_tokens=tuple(st["hit_tokens"]),
        bytes_moved=frozen_map(moved), checksum_failures=st["checksum_failures"],
        slower_than_recompute=kv.cost.slower_than_recompute, l0_evictions=st["l0_evictions"],
        prefetch=frozen_map(st["prefetch"]),
        kag=frozen_map(getattr(kv.policy, "stats", None)),
        load_seconds=latency.get("load"), store_seconds=latency.get("store"))


def runtime_stats(runner) -> RuntimeStats:
    """CUDA graph counts of ``runner`` (None: no model here) and this process's compiles."""
    graphs = graph_counts(runner) if runner is not None else {}
    comp = KERNEL_COMPILES.snapshot()
    return RuntimeStats(graph_captures=graphs.get("graph_captures", 0),
                        graph_replays=graphs.get("graph_replays", 0),
                        eager_forwards=graphs.get("eager_forwards", 0),
                        kernel_compiles=comp["compiles"],
                        kernel_compile_seconds=comp["compile_seconds"],
                        compiles_by_kernel=frozen_map(comp["by_kernel"]))
