"""Load-aware role switching between prefill and decode workers (a policy: plain data, no I/O).

``RoleController.decide(now, workers)`` reads each worker's load (``WorkerLoad``: queue of first
steps, running requests, recent time to first token and step time) and returns the switches to
make, ``[(rank, new_role)]``. The front end (``disagg/router.py``) drains a switching worker
first: it stops placing work of the old role there and changes the role once that work is done.

Rules, with a cooldown between switches so a burst does not make roles flap:
- **more prefill** when first steps queue up (mean prefill queue >= ``queue_high``, or the recent
  TTFT is above ``ttft_slo_s``) while decode workers have room (mean decode load below
  ``decode_low`` of their slots): the least loaded decode worker becomes a prefill worker;
- **more decode** when decode workers are full (mean load >= ``decode_high`` of their slots, or
  their step time is above ``step_slo_s``) while prefill workers are idle (mean queue <=
  ``queue_low``): the least loaded prefill worker becomes a decode worker;
- never fewer than one worker of each role; one switch at a time.

``simulate`` runs the controller against a trace on a simulated clock (tests, ``bench pd``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class WorkerLoad:
    rank: int
    role: str
    queue: int                 # requests waiting for (or in) their first step here
    running: int               # requests decoding here (or moving here)
    slots: int                 # its max_num_seqs
    ttft_s: float | None = None
    step_s: float | None = None
    draining: bool = False


@dataclass
class RoleController:
    queue_high: float = 4.0
    queue_low: float = 0.5
    decode_low: float = 0.5
    decode_high: float = 0.9
    ttft_slo_s: float = math.inf
    step_slo_s: float = math.inf
    cooldown_s: float = 5.0
    last_switch: float = -math.inf
    switches: list = field(default_factory=list)      # (time, rank, new role)

    def decide(self, now: float, workers: list[WorkerLoad]) -> list[tuple[int, str]]:
        if now - self.last_switch < self.cooldown_s or any(w.draining for w in workers):
            return []
        pre = [w for w in workers if w.role == PREFILL]
        dec = [w for w in workers if w.role == DECODE]
        if not pre or not dec:
            return []
        q = sum(w.queue for w in pre) / len(pre)
        load = sum(w.running for w in dec) / max(1, sum(w.slots for w in dec))
        ttft = max((w.ttft_s for w in pre if w.ttft_s is not None), default=0.0)
        step = max((w.step_s for w in dec if w.step_s is not None), default=0.0)
        move = None
        if (q >= self.queue_high or ttft > self.ttft_slo_s) and load < self.decode_low \
                and len(dec) > 1:
            w = min(dec, key=lambda w: (w.running, -w.rank))
            # its requests must fit the other decode workers' free slots
            room = sum(x.slots - x.running for x in dec if x is not w)
            if room >= w.running:
                move = (w.rank, PREFILL)
        elif (load >= self.decode_high or step > self.step_slo_s) and q <= self.queue_low \
                and len(pre) > 1:
            w = min(pre, key=lambda w: (w.queue, -w.rank))
            move = (w.rank, DECODE)
        if move is None:
            return []
        self.last_switch = now
        self.switches.append((now, *move))
        return [move]


# ------------------------------------------------------------------------------- simulation
@dataclass
class SimResult:
    ttft: list[float]
    latency: list[float]
    switches: list
    roles_over_time: list          # (time, prefill workers)

    def summary(self) -> dict:
        def pct(xs, p):
            xs = sorted(xs)
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
        return {"requests": len(self.latency), "ttft_p50_s": pct(self.ttft, 0.5),
                "ttft_p99_s": pct(self.ttft, 0.99), "latency_p50_s": pct(self.latency, 0.5),
                "latency_p99_s": pct(self.latency, 0.99), "switches": len(self.switches)}


def simulate(trace: list[tuple[float, int, int]], workers: int, prefill: int,
             controller: RoleController | None, *, slots: int = 16,
             prefill_s_per_token: float = 1e-5, step_s: float = 0.01, dt: float = 0.005
             ) -> SimResult:
    """Requests ``(arrival time, prompt tokens, decode steps)`` on ``workers`` workers of which
    ``prefill`` start as prefill workers. A prefill worker runs one first step at a time
    (``prefill_s_per_token`` x prompt tokens); a decode worker runs a batch step of ``step_s``
    for up to ``slots`` requests. ``controller`` None: static roles. Time advances by ``dt``."""
    roles = [PREFILL if r < prefill else DECODE for r in range(workers)]
    draining: dict[int, str] = {}
    queue: dict[int, list] = {r: [] for r in range(workers)}     # prefill queues
    busy_until = [0.0] * workers
    current: dict[int, tuple] = {}                               # rank -> request in prefill
    running: dict[int, list] = {r: [] for r in range(workers)}   # decode: [req, steps left]
    next_step = [0.0] * workers
    pending = sorted(trace)
    ttft, latency, roles_t = [], [], []
    i, t = 0, 0.0
    horizon = (pending[-1][0] if pending else 0.0) + 600.0
    while (i < len(pending) or any(queue.values()) or current or any(running.values())) \
            and t < horizon:
        while i < len(pending) and pending[i][0] <= t:           # arrivals: least queued
            arr, n_tok, steps = pending[i]
            cands = [r for r in range(workers) if roles[r] == PREFILL and r not in draining]
            r = min(cands, key=lambda r: (len(queue[r]) + (r in current), r))
            queue[r].append((arr, n_tok, steps))
            i += 1
        for r in range(workers):
            if r in current and busy_until[r] <= t:              # first step done: move it
                arr, n_tok, steps = current.pop(r)
                ttft.append(t - arr)
                cands = [d for d in range(workers) if roles[d] == DECODE and d not in draining]
                d = min(cands, key=lambda d: (len(running[d]), d))
                running[d].append([arr, steps])
            if roles[r] == PREFILL and r not in current and queue[r]:
                req = queue[r].pop(0)
                current[r] = req
                busy_until[r] = t + req[1] * prefill_s_per_token
            if running[r] and next_step[r] <= t:
                batch = running[r][:slots]
                for item in batch:
                    item[1] -= 1
                done = [x for x in batch if x[1] <= 0]
                for x in done:
                    latency.append(t + step_s - x[0])
                    running[r].remove(x)
                next_step[r] = t + step_s
        for r, to in list(draining.items()):                     # finish drained switches
            old_work = (queue[r] or r in current) if roles[r] == PREFILL else running[r]
            if not old_work:
                roles[r] = to
                del draining[r]
        if controller is not None:
            loads = [WorkerLoad(r, roles[r], len(queue[r]) + (r in current), len(running[r]),
                                slots, draining=r in draining) for r in range(workers)]
            for r, to in controller.decide(t, loads):
                draining[r] = to
        roles_t.append((t, roles.count(PREFILL)))
        t += dt
    return SimResult(ttft, latency, list(controller.switches) if controller else [], roles_t)


def bursty_trace(seed: int = 0, seconds: float = 60.0) -> list[tuple[float, int, int]]:
    """10 s phases, alternating: quiet (12 short prompts of 200-2,000 tokens a second, each
    decoding 128-384 steps: decode-bound) and bursts (8 long prompts of 8K-32K tokens a second,
    8-64 steps each: prefill-bound)."""
    import random

    rng = random.Random(seed)
    out, t = [], 0.0
    while t < seconds:
        burst = int(t // 10) % 2 == 1
        t += rng.expovariate(8.0 if burst else 12.0)
        if burst:
            out.append((t, rng.randint(8000, 32000), rng.randint(8, 64)))
        else:
            out.append((t, rng.randint(200, 2000), rng.randint(128, 384)))
    return out
