"""How fragmented the KV staging buffer gets under a mixed workload (for ``flash-dllm bench pd``).

A staging buffer that holds one contiguous segment per in-flight request can refuse a request while
enough bytes are free in total, only scattered in holes too small for it. This simulates a random
workload against ``SegmentAllocator`` and counts exactly that. Each step, first the requests
whose lifetime ended free their segments, then Poisson(``arrival_rate``) requests arrive, each
either short (probability ``short_frac``, size uniform in ``short``) or long (size uniform in
``long``), and hold their segment for 1 + round(Exp(mean ``mean_lifetime`` - 1)) steps (the time
until the decode worker has unpacked it into its page pool). A request that does not fit is
dropped and counted, not queued: the figure is about the allocator, not about admission.

Sizes are in allocator units; the defaults read as pages of 16 tokens: short prompts of 16-512
tokens (1-32 pages), long ones of 2K-16K tokens (128-1024 pages), a 4096-page (64K-token) buffer.
"""
from __future__ import annotations

import math
import random

from flash_dllm.distributed.segment_allocator import SegmentAllocator


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method: fine for the small rates used here.
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def fragmentation_figure(seed: int = 0, steps: int = 2000, capacity: int = 4096, *,
                         arrival_rate: float = 1.5, short_frac: float = 0.8,
                         short: tuple[int, int] = (1, 32), long: tuple[int, int] = (128, 1024),
                         mean_lifetime: float = 12.0, align: int = 1) -> dict:
    """Run the workload for ``steps`` steps; returns a JSON-ready dict: per-step ``fragmentation``
    and ``utilisation`` (allocated / capacity) series, ``requests``, ``failed`` allocations,
    ``failed_with_enough_free`` (refused although total free space sufficed: the cost of
    fragmentation), ``peak_utilisation``, and means."""
    for name, v, lo in (("seed", seed, 0), ("steps", steps, 1), ("capacity", capacity, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if not 0.0 < arrival_rate <= 50.0:
        raise ValueError(f"arrival_rate must be in (0, 50], got {arrival_rate!r}")
    if not 0.0 <= short_frac <= 1.0:
        raise ValueError(f"short_frac must be in [0, 1], got {short_frac!r}")
    for name, (lo, hi) in (("short", short), ("long", long)):
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= capacity):
            raise ValueError(f"{name} must be integers (lo, hi) with 1 <= lo <= hi <= capacity "
                             f"({capacity}), got {(lo, hi)!r}")
    if not mean_lifetime >= 1.0:
        raise ValueError(f"mean_lifetime must be >= 1 step, got {mean_lifetime!r}")

    rng = random.Random(seed)
    alloc = SegmentAllocator(capacity, align)
    expiry: dict[int, list[int]] = {}           # step -> offsets to free then
    frag: list[float] = []
    util: list[float] = []
    requests = failed = failed_enough = 0
    for step in range(steps):
        for off in expiry.pop(step, ()):
            alloc.free(off)
        for _ in range(_poisson(rng, arrival_rate)):
            lo, hi = short if rng.random() < short_frac else long
            n = rng.randint(lo, hi)
            requests += 1
            off = alloc.alloc(n)
            if off is None:
                failed += 1
                failed_enough += alloc.total_free >= alloc.reserved_size(n)
                continue
            extra = rng.expovariate(1.0 / (mean_lifetime - 1.0)) if mean_lifetime > 1 else 0.0
            life = 1 + round(extra)
            expiry.setdefault(step + life, []).append(off)
        frag.append(round(alloc.fragmentation, 4))
        util.append(round(alloc.total_allocated / capacity, 4))
    return {
        "seed": seed, "steps": steps, "capacity": capacity, "align": align,
        "arrival_rate": arrival_rate, "short_frac": short_frac, "short": list(short),
        "long": list(long), "mean_lifetime": mean_lifetime,
        "requests": requests, "failed": failed, "failed_with_enough_free": failed_enough,
        "peak_utilisation": max(util), "mean_utilisation": round(sum(util) / steps, 4),
        "mean_fragmentation": round(sum(frag) / steps, 4), "max_fragmentation": max(frag),
        "fragmentation": frag, "utilisation": util,
    }
