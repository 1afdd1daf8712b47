"""Per-request and per-engine counters of the decode policies and step extensions (host data).

A counters dict has flat integer entries (``verify_candidates``, ``positions_computed``, ...) and
per-name dicts (``sentinel_checks`` / ``sentinel_triggers``: an entry for each sentinel or
trigger in ``SENTINELS``, 0 until it counts). ``RequestOutput.metrics`` and ``Engine.stats`` hold
one each; a step hands back one per request that counted anything (``StepResult.counters``).
"""
from __future__ import annotations

# the sentinels and triggers whose checks and triggers are counted (and exported as metrics)
SENTINELS = ("entropy", "perturbation", "kv_consistency", "lazy_load", "drift")


def new_counters() -> dict:
    """Per-request (``RequestOutput.metrics``) and per-engine (``Engine.stats``) counters."""
    return {"verify_candidates": 0, "verify_accepted": 0, "positions_computed": 0,
            "sentinel_checks": dict.fromkeys(SENTINELS, 0),
            "sentinel_triggers": dict.fromkeys(SENTINELS, 0)}


def merge_counters(target: dict, delta: dict) -> None:
    """Add a ``new_counters``-layout dict into another."""
    for key, v in delta.items():
        if isinstance(v, dict):
            for name, n in v.items():
                target[key][name] = target[key].get(name, 0) + n
        else:
            target[key] += v


def count(counters: list, i: int, key: str, n: int, name: str | None = None) -> None:
    """Add ``n`` to request ``i``'s counters of this step (created at the first count)."""
    if not n:
        return
    if counters[i] is None:
        counters[i] = new_counters()
    if name is None:
        counters[i][key] += n
    else:
        d = counters[i][key]
        d[name] = d.get(name, 0) + n
