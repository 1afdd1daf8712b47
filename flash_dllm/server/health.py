"""What ``/health`` and ``/ready`` say of the engine's parts beyond its thread: the disaggregated
workers (``disagg/router.py``), read from the published stats snapshot like ``/metrics``.

A worker is "up" or "down" (lost: exited, killed or disconnected; with its exit code, or the
signal that killed it, once reaped). The engine can serve while every role (prefill, decode)
keeps a live worker; ``health`` says "degraded" when some are down but none of the roles is
empty, and ``unservable`` names the first empty role.
"""
from __future__ import annotations

import signal

from flash_dllm.core.stats import EngineStats, WorkerStats


def workers(snap: EngineStats) -> list[dict] | None:
    """Every disaggregated worker's state (None: not a disaggregated engine)."""
    if snap.disagg is None:
        return None
    return [_worker(w) for w in snap.disagg.workers]


def unservable(snap: EngineStats) -> str | None:
    """Why the engine cannot take requests (a role with no live worker), or None."""
    if snap.disagg is None:
        return None
    for role in dict.fromkeys(w.role for w in snap.disagg.workers):   # (in rank order)
        ws = [w for w in snap.disagg.workers if w.role == role]
        if not any(w.alive for w in ws):
            lost = "; ".join(f"worker {w.rank}: {w.lost or 'lost'}" for w in ws)
            return f"no live {role} worker left ({lost})"
    return None


def _worker(w: WorkerStats) -> dict:
    code = w.exit_code
    sig = None
    if code is not None and code < 0:
        try:
            sig = signal.Signals(-code).name
        except ValueError:
            sig = str(-code)
        code = None
    out = {"worker": w.rank, "role": w.role, "state": "up" if w.alive else "down",
           "exit_code": code, "signal": sig}
    if not w.alive:
        out["reason"] = w.lost
    return out
