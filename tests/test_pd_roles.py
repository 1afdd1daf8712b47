"""Load-aware role switching (``disagg/roles.py``) on a simulated clock: the rules, and a bursty
trace on which switching beats every static split without flapping."""
from __future__ import annotations

from flash_dllm.disagg.roles import (DECODE, PREFILL, RoleController, WorkerLoad, bursty_trace,
                                     simulate)


def _w(rank, role, queue=0, running=0, slots=16, **kw):
    return WorkerLoad(rank, role, queue, running, slots, **kw)


def test_prefill_backlog_takes_an_idle_decode_worker():
    c = RoleController(cooldown_s=5.0)
    ws = [_w(0, PREFILL, queue=9), _w(1, DECODE, running=2), _w(2, DECODE, running=1)]
    assert c.decide(0.0, ws) == [(2, PREFILL)]          # the least loaded decode worker
    assert c.decide(1.0, ws) == []                      # cooldown
    assert c.decide(6.0, ws) == [(2, PREFILL)]


def test_full_decode_takes_an_idle_prefill_worker():
    c = RoleController()
    ws = [_w(0, PREFILL), _w(1, PREFILL, queue=1), _w(2, DECODE, running=15)]
    assert c.decide(0.0, ws) == [(0, DECODE)]


def test_never_leaves_a_role_empty_and_waits_for_a_drain():
    c = RoleController()
    assert c.decide(0.0, [_w(0, PREFILL, queue=50), _w(1, DECODE)]) == []   # one decode left
    assert c.decide(0.0, [_w(0, PREFILL), _w(1, DECODE, running=16)]) == []  # one prefill left
    ws = [_w(0, PREFILL, queue=50), _w(1, DECODE), _w(2, DECODE, draining=True)]
    assert c.decide(0.0, ws) == []                      # one switch at a time


def test_slo_signals_trigger_switches():
    c = RoleController(ttft_slo_s=1.0, cooldown_s=0.0)
    ws = [_w(0, PREFILL, queue=1, ttft_s=3.0), _w(1, DECODE), _w(2, DECODE)]
    assert c.decide(0.0, ws) == [(2, PREFILL)]
    c = RoleController(step_slo_s=0.05, cooldown_s=0.0)
    ws = [_w(0, PREFILL), _w(1, PREFILL), _w(2, DECODE, running=4, step_s=0.2)]
    assert c.decide(0.0, ws) == [(1, DECODE)]


def test_switching_beats_every_static_split_on_a_bursty_trace():
    trace = bursty_trace(seed=0, seconds=60.0)
    static = {p: simulate(trace, 4, p, None).summary() for p in (1, 2, 3)}
    c = RoleController(cooldown_s=1.0)
    dyn = simulate(trace, 4, 2, c)
    s = dyn.summary()
    assert s["requests"] == len(trace)
    for p, st in static.items():
        assert s["latency_p50_s"] < st["latency_p50_s"], (p, st, s)
        assert s["latency_p99_s"] < st["latency_p99_s"], (p, st, s)
    # it follows the 10 s phases: a few switches per phase change, not a flap every tick
    assert 2 <= s["switches"] <= 16
    assert min(n for _, n in dyn.roles_over_time) >= 1
    assert max(n for _, n in dyn.roles_over_time) <= 3
