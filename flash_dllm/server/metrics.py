"""Prometheus metrics of one server (own registry, prefix ``flash_dllm_``); the AsyncEngine's observer.

Gauges and engine counters are rendered from the async engine's published stats snapshot
(``AsyncEngine.stats``, an immutable ``core.stats.EngineStats`` the engine thread swaps in whole)
and its request counts; nothing here reads a live engine object. Event counters and histograms
are fed by the engine thread through the ``StepObserver`` hooks (``prometheus_client`` metrics
are thread-safe).

NOTE: ``flash_dllm_sentinel_triggers_total{sentinel=...}`` (and ``..._checks_total``) come from
the engine's counters (``Engine.stats["sentinel_triggers"]`` / ``["sentinel_checks"]``, in the
snapshot's ``counters``); an engine without sentinels exports every name of
``decoding.sentinels.SENTINELS`` at 0.
"""
from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from flash_dllm.core.request import RequestOutput
from flash_dllm.core.stats import DisaggStats, EngineStats, HistogramStats, TierStats
from flash_dllm.decoding.sentinels import SENTINELS
from flash_dllm.engine.async_engine import AsyncEngine

PREFIX = "flash_dllm_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TPF_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0)


class ServerMetrics:
    """Every metric of one server in its own registry (several apps can live in one process)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncEngine) -> None:
        r = self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(PREFIX + name, doc, registry=r).set_function(fn)

        gauge("requests_running", "Requests in the running batch.", lambda: engine.num_running)
        gauge("requests_waiting", "Requests queued for KV pages.", lambda: engine.num_waiting)
        self.forwards = Counter(PREFIX + "forwards", "Model forwards (denoising steps of the batch).",
                                registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens",
                                        "Tokens added to committed answer prefixes.", registry=r)
        self.finished = Counter(PREFIX + "requests_finished", "Finished requests by reason.",
                                ["finish_reason"], registry=r)
        self.tokens_per_forward = Histogram(
            PREFIX + "tokens_per_forward",
            "Per finished request: answer tokens / forwards that included it.",
            buckets=TPF_BUCKETS, registry=r)
        self.step_seconds = Histogram(PREFIX + "step_seconds", "Wall time of one engine step.",
                                      buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Requests in one forward.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Submission to the first committed answer token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram(PREFIX + "request_seconds",
                                         "Submission to finish (any reason).",
                                         buckets=LATENCY_BUCKETS, registry=r)
        r.register(_SnapshotCollector(engine))
        self.http_errors = Counter(PREFIX + "http_errors", "Error responses by HTTP status.",
                                   ["status"], registry=r)

    # ------------------------------------------------------------------ StepObserver (engine thread)
    def on_step(self, seconds: float, batch_size: int) -> None:
        self.forwards.inc()
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch_size)

    def on_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_finish(self, output: RequestOutput, seconds: float) -> None:
        self.finished.labels(finish_reason=output.finish_reason or "unknown").inc()
        self.request_seconds.observe(seconds)
        if output.num_forwards:
            self.tokens_per_forward.observe(output.tokens_per_forward)

    # ------------------------------------------------------------------------------------- export
    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Everything rendered from the engine's stats snapshot: ONE snapshot per scrape (read
    once), so the families of a scrape agree with each other."""

    def __init__(self, aeng: AsyncEngine) -> None:
        self.aeng = aeng
        self._evictions = (0, time.monotonic(), 0.0)     # (count, time, rate) for the EMA

    def describe(self):
        return []

    def collect(self):
        snap: EngineStats = self.aeng.stats
        g = GaugeMetricFamily(PREFIX + "kv_pages_used",
                              "KV pages reserved by admitted requests (cached pages excluded).")
        g.add_metric([], snap.pages_used)
        yield g
        g = GaugeMetricFamily(PREFIX + "kv_pages_total", "KV pages in the pool.")
        g.add_metric([], snap.pages_total)
        yield g
        yield _counter("failed_steps", "Engine steps that raised: only the requests of their "
                       "batch failed (each with an error naming the exception) and the engine "
                       "went on. A failure that stops the engine is not counted here.",
                       snap.failed_steps)
        if snap.weight_bytes:
            g = GaugeMetricFamily(PREFIX + "weight_bytes", "Bytes of the model's weights as "
                                  "stored, by --quantization (none: the checkpoint's dtype).",
                                  labels=["quantization"])
            g.add_metric([snap.quantization], snap.weight_bytes)
            yield g
        yield from _sentinels(snap)
        if snap.tiers is not None:
            yield from self._tiers(snap.tiers)
        if snap.overflow is not None:   # --kv-overflow-gb (``cache/io/kv_overflow.py``)
            fam = CounterMetricFamily(PREFIX + "kv_overflow_bytes",
                                      "KV bytes of requests larger than the GPU pool streamed "
                                      "from pinned host memory for a step (h2d) or written "
                                      "back to it (d2h).", labels=["direction"])
            fam.add_metric(["h2d"], snap.overflow.h2d_bytes)
            fam.add_metric(["d2h"], snap.overflow.d2h_bytes)
            yield fam
            yield _counter("kv_overflow_steps", "Steps of requests larger than the GPU pool.",
                           snap.overflow.steps)
        if snap.disagg is not None:
            yield from _disagg(snap.disagg)
        yield from _runtime(self.aeng, snap)

    def _tiers(self, t: TierStats):
        """Memory tiers and prefix reuse (the KV manager's and the offloader's counters)."""
        g = GaugeMetricFamily(PREFIX + "kv_pages_cached",
                              "Cached KV pages (prefix reuse) per tier.", labels=["tier"])
        gb = GaugeMetricFamily(PREFIX + "kv_cached_bytes", "Bytes of cached KV pages per tier.",
                               labels=["tier"])
        for tier, n in zip(t.tier_names, t.cached_pages):
            g.add_metric([tier], n)
            gb.add_metric([tier], n * t.page_bytes)
        yield g
        yield gb
        yield _counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
                       t.query_tokens)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hit_tokens",
                                   "Prompt tokens whose KV was reused, by the tier it came from.",
                                   labels=["tier"])
        for tier, n in zip(t.tier_names, t.hit_tokens):
            hits.add_metric([tier], n)
        yield hits
        rate = GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate",
                                 "Reused prompt tokens / prompt tokens looked up.")
        rate.add_metric([], sum(t.hit_tokens) / t.query_tokens if t.query_tokens else 0.0)
        yield rate
        moved = CounterMetricFamily(PREFIX + "kv_bytes_moved",
                                    "KV bytes moved between tiers (down: towards disk).",
                                    labels=["tier", "direction"])
        for (tier, direction), n in sorted(t.bytes_moved.items()):
            moved.add_metric([tier, direction], n)
        yield moved
        yield _counter("kv_checksum_failures", "Cached pages that failed verification (a miss "
                       "that recomputes; never served).", t.checksum_failures)
        yield _counter("kv_tier_slower_than_recompute", "Lower-tier hits whose load took longer "
                       "than recomputing them would have.", t.slower_than_recompute)
        yield _counter("l0_evictions", "Cached pages evicted from GPU memory.", t.l0_evictions)
        pf = t.prefetch
        fam = CounterMetricFamily(PREFIX + "kv_prefetch_pages",
                                  "Queue-ahead prefetch (disk -> host memory for waiting "
                                  "requests), in pages: issued; on time (in host memory at "
                                  "admission), late (still reading: recomputed), useless "
                                  "(not used by the admission, evicted or failed first).",
                                  labels=["outcome"])
        for outcome in ("issued", "on_time", "late", "useless"):
            fam.add_metric([outcome], pf.get(outcome, 0))
        yield fam
        used = pf.get("on_time", 0) + pf.get("late", 0)
        on_time = GaugeMetricFamily(PREFIX + "kv_prefetch_on_time_rate",
                                    "Prefetched pages in host memory when their request was "
                                    "admitted / those whose request was admitted (1 before "
                                    "any).")
        on_time.add_metric([], pf.get("on_time", 0) / used if used else 1.0)
        yield on_time
        ratio = GaugeMetricFamily(PREFIX + "kag_stability_ratio",
                                  "Share of the most central cached pages (KV access graph, "
                                  "--kv-placement kag) unchanged by the latest update; 1 "
                                  "without the graph.")
        ratio.add_metric([], float(t.kag.get("stability_ratio", 1.0)))
        yield ratio
        yield _counter("kag_updates", "KV access graph updates (one per decoded block of a "
                       "cache=flash request).", t.kag.get("updates", 0))
        yield _counter("kag_update_seconds", "Seconds spent updating the KV access graph and "
                       "its PageRank.", t.kag.get("update_seconds", 0.0))
        n, at, r = self._evictions
        now = time.monotonic()
        if now > at:
            inst = (t.l0_evictions - n) / (now - at)
            r = inst if at == 0 else 0.7 * r + 0.3 * inst
            self._evictions = (t.l0_evictions, now, r)
        ev = GaugeMetricFamily(PREFIX + "l0_eviction_rate",
                               "Cached pages evicted from GPU memory per second (smoothed over "
                               "scrapes).")
        ev.add_metric([], r)
        yield ev
        for name, h in (("load", t.load_seconds), ("store", t.store_seconds)):
            if h is not None:
                yield _histogram(f"kv_{name}_seconds",
                                 f"Seconds per page {name}ed between GPU and host memory.", h)



def _sentinels(snap: EngineStats):
    """``flash_dllm_sentinel_triggers_total{sentinel}`` and ``..._checks_total{sentinel}`` (their
    ratio over a window is the trigger rate per sentinel), and the rate since start."""
    totals = {}
    for key, doc in (("sentinel_triggers", "Slots a sentinel flagged (demoted to "
                                           "verification / refreshed)."),
                     ("sentinel_checks", "Slots a sentinel checked (for lazy_load and "
                                         "drift: steps).")):
        counts = snap.counters.get(key) or {}
        fam = CounterMetricFamily(PREFIX + key, doc, labels=["sentinel"])
        for name in sorted(set(SENTINELS) | set(counts)):
            fam.add_metric([name], float(counts.get(name, 0)))
        totals[key] = sum(counts.values())
        yield fam
    n_checks, n_trig = totals["sentinel_checks"], totals["sentinel_triggers"]
    rate = GaugeMetricFamily(PREFIX + "sentinel_trigger_rate",
                             "Sentinel triggers per check (a slot; for lazy_load a step), "
                             "all sentinels, since start.")
    rate.add_metric([], n_trig / n_checks if n_checks else 0.0)
    yield rate


def _disagg(d: DisaggStats):
    """Prefill/decode disaggregation (``disagg/router.py``): per worker, its role, liveness,
    pages, staging segments and transfers in flight (all 0 when idle: nothing leaked); KV
    transfers, their bytes and seconds, failures, lost workers, role switches."""
    for name, doc in (("transfers", "Requests whose KV moved from a prefill to a decode "
                                    "worker."),
                      ("transfer_bytes", "Bytes of KV moved between workers."),
                      ("transfer_seconds", "Seconds from a decode worker's receipt of a "
                                           "snapshot to the request's unpacked pages, "
                                           "summed."),
                      ("transfer_failures", "KV transfers that failed, timed out or "
                                            "arrived corrupted."),
                      ("checksum_failures", "KV segments that arrived corrupted (checksum "
                                            "mismatch; never served)."),
                      ("failed_requests", "Requests failed by a transfer or a lost worker."),
                      ("worker_deaths", "Workers lost (exited or disconnected)."),
                      ("role_switches", "Workers moved between the prefill and decode "
                                        "roles.")):
        yield _counter(f"pd_{name}", doc, getattr(d, name))
    # NOTE: a lost worker's last report is what it held when it died; its process (and
    # with it every page and staging segment) is gone, so it holds nothing (the soak saw a
    # killed worker's gauges stay at 35 pages)
    held = lambda v: (lambda w: v(w) if w.alive else 0)          # noqa: E731
    gauges = {
        "up": ("1 while the worker is alive.", lambda w: float(w.alive)),
        "kv_pages_used": ("KV pages the worker's requests hold.", held(lambda w: w.pages_used)),
        "staging_segments": ("Staging-buffer segments held (receives in flight).",
                             held(lambda w: w.staging_used)),
        "sends_in_flight": ("KV sends not yet settled.", held(lambda w: w.sends)),
        "receives_pending": ("KV receives posted or waiting for room.",
                             held(lambda w: w.recvs)),
        "forwards": ("Model forwards the worker ran.", lambda w: w.steps),
    }
    for name, (doc, fn) in gauges.items():
        g = GaugeMetricFamily(PREFIX + f"pd_worker_{name}", doc, labels=["worker", "role"])
        for w in d.workers:
            g.add_metric([str(w.rank), w.role], float(fn(w)))
        yield g


def _runtime(aeng: AsyncEngine, snap: EngineStats):
    """Start-up and stalls (issue 21): time to ready, the warm-up, and the kernel compiles and
    CUDA graph captures that happened after ready (at steady state these stay at 0)."""
    import flash_dllm

    rt = snap.runtime
    yield _counter("kernel_compiles", "Triton kernel specialisations compiled (or loaded from "
                   "Triton's disk cache) in this process.", rt.kernel_compiles)
    yield _counter("kernel_compile_seconds", "Seconds spent in those compiles.",
                   rt.kernel_compile_seconds)
    by = CounterMetricFamily(PREFIX + "kernel_compiles_by_kernel",
                             "Triton kernel specialisations compiled, per kernel.",
                             labels=["kernel"])
    for name, n in sorted(rt.compiles_by_kernel.items()):
        by.add_metric([name], n)
    yield by
    yield _counter("graph_captures", "CUDA graphs captured.", rt.graph_captures)
    yield _counter("graph_replays", "Steps replayed from a CUDA graph.", rt.graph_replays)
    yield _counter("eager_forwards", "Forwards run without a CUDA graph.", rt.eager_forwards)
    at = aeng.at_ready
    for name, doc in (("kernel_compiles", "Kernel compiles after the server became ready."),
                      ("graph_captures", "CUDA graph captures after the server became "
                                         "ready.")):
        after = 0 if at is None else getattr(rt, name) - getattr(at, name)
        yield _counter(f"{name}_after_ready", doc, after)
    ready = GaugeMetricFamily(PREFIX + "time_to_ready_seconds",
                              "From the package's import to ready (model load and warm-up "
                              "included); NaN until ready.")
    ready.add_metric([], float("nan") if aeng.ready_at is None
                     else aeng.ready_at - flash_dllm.IMPORTED_AT)
    yield ready
    rep = aeng.warmup_report
    warm = GaugeMetricFamily(PREFIX + "warmup_seconds", "Seconds the warm-up took (0: none).")
    warm.add_metric([], 0.0 if rep is None else rep.seconds)
    yield warm


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(PREFIX + name, doc)
    c.add_metric([], value)
    return c


def _histogram(name: str, doc: str, h: HistogramStats) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        PREFIX + name, doc, sum_value=h.sum,
        buckets=[("+Inf" if le == float("inf") else str(le), c) for le, c in h.buckets])
