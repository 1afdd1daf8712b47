"""Latency histograms of tier I/O: Prometheus buckets plus recent samples for quantiles."""
from __future__ import annotations

import bisect
from collections import deque

# Prometheus-style latency buckets (seconds): NVMe page reads are ~50 us - 5 ms.
LATENCY_BUCKETS_S = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                     50e-3, 100e-3, 250e-3, 1.0, 2.5)


class LatencyHistogram:
    """Counts per Prometheus bucket (``le`` edges) plus the most recent samples for quantiles."""

    def __init__(self, edges: tuple[float, ...] = LATENCY_BUCKETS_S, keep: int = 4096) -> None:
        self.edges = tuple(edges)
        self.counts = [0] * (len(self.edges) + 1)          # last bucket: +Inf
        self.count = 0
        self.sum = 0.0
        self.samples: deque[float] = deque(maxlen=keep)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.edges, seconds)] += 1
        self.count += 1
        self.sum += seconds
        self.samples.append(seconds)

    def quantile(self, q: float) -> float | None:
        if not self.samples:
            return None
        s = sorted(self.samples)
        return s[min(len(s) - 1, int(q * len(s)))]

    def snapshot(self) -> dict:
        cum, buckets = 0, []
        for le, c in zip(self.edges + (float("inf"),), self.counts):
            cum += c
            buckets.append((le, cum))
        return {"buckets": buckets, "count": self.count, "sum": self.sum,
                "p50": self.quantile(0.5), "p99": self.quantile(0.99)}
