"""``EngineStats``: what an engine looked like after a step, as immutable host data.

The engine thread builds one (``EngineCore.stats_snapshot()``) and ``AsyncEngine`` publishes it by
swapping one attribute; the HTTP thread renders ``/metrics`` from the published snapshot only, so
it never reads a live engine object (``docs/architecture.md``: only the engine thread touches the
engine). Every field is plain data: numbers, tuples and read-only mappings (``frozen_map``).

NOTE: this module imports nothing above ``core``: an engine (single device, tensor-parallel or
the disaggregated router) fills these from its own parts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

_EMPTY: Mapping = MappingProxyType({})


def frozen_map(d: Mapping | None) -> Mapping:
    """A read-only copy of ``d`` (nested dicts too): later changes to ``d`` do not show."""
    if not d:
        return _EMPTY
    return MappingProxyType({k: frozen_map(v) if isinstance(v, dict) else v
                             for k, v in d.items()})


@dataclass(frozen=True)
class HistogramStats:
    """A latency histogram: cumulative counts per upper bound ``le`` (the last ``inf``)."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float


@dataclass(frozen=True)
class TierStats:
    """Memory tiers and prefix reuse (the KV manager's counters, the offloader's latencies)."""

    page_bytes: int                          # bytes of one page (per tier-0 copy)
    tier_names: tuple[str, ...]              # "l0", "l1", "l2", ...: one per tier
    cached_pages: tuple[int, ...]            # published copies per tier
    query_tokens: int                        # prompt tokens looked up in the prefix cache
    hit_tokens: tuple[int, ...]              # ... whose KV was reused, by tier
    bytes_moved: Mapping[tuple[str, str], int]   # (tier, "down" | "up") -> bytes
    checksum_failures: int
    slower_than_recompute: int               # lower-tier hits slower than recomputing
    l0_evictions: int
    prefetch: Mapping[str, int]              # issued, on_time, late, useless
    kag: Mapping[str, float]                 # the placement policy's (stability_ratio, ...)
    load_seconds: HistogramStats | None = None    # per page, with an offloader only
    store_seconds: HistogramStats | None = None


@dataclass(frozen=True)
class OverflowStats:
    """Requests larger than the GPU pool (``--kv-overflow-gb``)."""

    h2d_bytes: int
    d2h_bytes: int
    steps: int


@dataclass(frozen=True)
class WorkerStats:
    """One disaggregated worker as the router sees it; the counters after ``decoding`` are its
    latest report (0 before the first)."""

    rank: int
    role: str
    alive: bool
    prefilling: int                 # requests placed there for their first step
    decoding: int                   # requests moving or moved there
    reported: bool = False          # a report arrived
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    staging_used: int = 0           # staging segments held
    sends: int = 0                  # KV sends not yet settled
    recvs: int = 0                  # KV receives posted or waiting for room
    steps: int = 0                  # forwards it ran
    step_seconds: float = 0.0
    prefill_steps: int = 0
    exit_code: int | None = None    # a lost worker's process: its return code once reaped
    #                                 (negative: killed by that signal, as ``Popen``'s)
    lost: str | None = None         # why the router lost it (one line)


@dataclass(frozen=True)
class DisaggStats:
    """The prefill/decode router's counters and its workers."""

    transfers: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_failures: int = 0
    checksum_failures: int = 0
    failed_requests: int = 0
    worker_deaths: int = 0
    role_switches: int = 0
    workers: tuple[WorkerStats, ...] = ()


@dataclass(frozen=True)
class RuntimeStats:
    """Start-up stalls: CUDA graphs of this engine's runner, Triton compiles of this process."""

    graph_captures: int = 0
    graph_replays: int = 0
    eager_forwards: int = 0
    kernel_compiles: int = 0
    kernel_compile_seconds: float = 0.0
    compiles_by_kernel: Mapping[str, int] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class EngineStats:
    """One engine after a step. ``counters``: the engine's decode-policy and sentinel counters
    in the ``core.counters.new_counters`` layout (``sentinel_checks`` / ``sentinel_triggers``:
    per-name mappings)."""

    running: int = 0                # requests in the running batch
    waiting: int = 0                # requests queued for admission
    pages_used: int = 0             # KV pages reserved by requests (cached pages excluded)
    pages_total: int = 0            # KV pages in the pool (disaggregated: every live worker's)
    page_size: int = 0
    forwards: int = 0
    tokens_committed: int = 0
    step_seconds: float = 0.0
    last_batch_size: int = 0
    failed_steps: int = 0           # steps that failed their batch (the engine went on)
    counters: Mapping[str, object] = field(default_factory=lambda: _EMPTY)
    tiers: TierStats | None = None          # None: no KV manager here (a disaggregated router)
    overflow: OverflowStats | None = None   # None: no --kv-overflow-gb
    disagg: DisaggStats | None = None       # None: not a disaggregated router
    runtime: RuntimeStats = field(default_factory=RuntimeStats)
    weight_bytes: int = 0                   # the model's weights as stored (0: not known here)
    quantization: str = "none"              # --quantization (fp8, int8, int4) or none
