"""The drift trigger (``SamplingParams.drift_min``, ``decoding/drift.py``): Elastic-Cache-style
cache refresh on attention drift instead of at every block."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_paged_engine import _same
from test_sampler import PROMPTS, tiny

from flash_dllm.cache.modes import query_range
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.decoding import drift
from flash_dllm.worker.extensions.drift import DriftTrigger
from flash_dllm.engine.engine import Engine


def test_query_range_refresh_choice():
    # default (None): Fast-dLLM, a whole-canvas refresh at every block's first step
    assert query_range("dual", 100, 40, 48, True, 0, first_block=False) == (0, 100)
    # the drift trigger keeps the cache at a block start: previous + active block
    assert query_range("dual", 100, 40, 48, True, 0, False, refresh=False) == (32, 48)
    assert query_range("dual", 100, 40, 48, True, 1, False, refresh=False) == (31, 48)
    assert query_range("prefix", 100, 40, 48, True, 0, False, refresh=False) == (32, 100)
    # ... and refreshes whenever it says so, mid-block too
    assert query_range("dual", 100, 40, 48, False, 0, False, refresh=True) == (0, 100)
    assert query_range("dual", 100, 40, 48, False, 1, False, refresh=False) == (39, 48)
    with pytest.raises(ValueError, match="cache mode"):
        query_range("bogus", 100, 40, 48, False, 0)


def test_drift_min_is_validated():
    with pytest.raises(ValueError, match="drift_min needs cache"):
        SamplingParams(max_tokens=16, cache="none", drift_min=0.9, decode="vanilla")
    with pytest.raises(ValueError, match="drift_min"):
        SamplingParams(max_tokens=16, cache="dual", drift_min=1.5, decode="vanilla")
    SamplingParams(max_tokens=16, cache="prefix", drift_min=0.9, drift_defer=True, decode="vanilla")
    with pytest.raises(ValueError, match="decode='verify'"):
        SamplingParams(max_tokens=16, cache="dual", decode="verify", drift_min=0.9)
    with pytest.raises(ValueError, match="drift_defer must be a bool"):
        SamplingParams(max_tokens=16, cache="dual", drift_min=0.9, drift_defer=1, decode="vanilla")


def _req(L, block=1, kv_top_k=2, drift_min=0.9):
    p = SimpleNamespace(drift_min=drift_min, kv_top_k=kv_top_k)
    return SimpleNamespace(params=p, canvas_len=L, block=block, overflow=None, request_id="r")


def test_drift_statistic_by_hand():
    """The test compares the previous step's top-k cached keys' mass, now and then (cosine);
    only steps with the same window (query rows) in the same block are compared."""
    L, win = 10, (4, 6)
    req, st = _req(L), SimpleNamespace(drift_prev=None)
    prev = torch.tensor([[0., 5., 1., 3., 9., 9., 0., 0., 2., 0.]])
    counters = [None]
    flags = drift.test([req], [st], [win], prev, counters)
    assert flags.tolist() == [0] and counters == [None]           # nothing to compare with
    # top-2 cached keys of the previous step (the window's 9s excluded): 1 and 3 -> (5, 3)
    now = torch.tensor([[0., 3., 7., 5., 1., 1., 0., 0., 2., 0.]])   # now (3, 5)
    cos = (5 * 3 + 3 * 5) / (5 ** 2 + 3 ** 2)
    assert cos < 0.9
    flags = drift.test([req], [st], [win], now, counters)
    assert flags.tolist() == [1] and counters[0]["sentinel_checks"]["drift"] == 1
    # the flags ride on the step's read-back; the extension reads them there
    step = SimpleNamespace(batch=[req])
    drifted = DriftTrigger().read_back(None, step, [0], np.array([1]), counters)
    assert drifted == {"r"} and counters[0]["sentinel_triggers"]["drift"] == 1
    # the same mass again: similarity 1, no refresh
    assert drift.test([req], [st], [win], now, counters).tolist() == [0]
    # another window (a block's first step, a refresh) is not compared
    assert drift.test([req], [st], [(0, 10)], prev, counters).tolist() == [0]
    assert counters[0]["sentinel_checks"]["drift"] == 2
    # no drift request in the batch: no test, no extra column
    off = _req(L, drift_min=None)
    assert drift.test([off], [st], [win], now, [None]) is None
    assert not DriftTrigger().active(off)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["dual", "prefix"])
@pytest.mark.parametrize("drift_min", [1e-6, 0.999, 1.0])
@pytest.mark.parametrize("defer", [True, False])
def test_drift_paged_equals_dense(family, cache, drift_min, defer):
    """The paged path's per-key mass and windows against the dense oracle's exact softmax:
    the same tokens and forwards with the trigger never, sometimes and nearly always firing."""
    model = tiny(family, seed=5)
    params = SamplingParams(max_tokens=32, block_length=8, decode="threshold", threshold=0.3,
                            cache=cache, drift_min=drift_min, drift_defer=defer, kv_top_k=3,
                            early_stop=False)
    outs = _same(model, PROMPTS, params)
    checks = sum(o.metrics["sentinel_checks"]["drift"] for o in outs)
    triggers = sum(o.metrics["sentinel_triggers"]["drift"] for o in outs)
    assert checks > 0
    if drift_min == 1e-6:
        assert triggers == 0
    if drift_min == 1.0:
        assert triggers > 0


def _positions_by_step(model, params, prompt):
    """Run one request step by step; the window each step recomputed and whether it was
    stale (the drift test had failed) when planned."""
    eng = Engine(model, model.cfg, EngineConfig())
    req = eng.add_request(prompt, params)
    seen = []
    while eng.has_unfinished():
        plan = eng.scheduler.schedule()
        seen.append((plan.seqs[0].window, req.stale, req.first_step, req.block))
        eng.step()
    return req, eng, seen


def test_refreshes_follow_the_trigger():
    model = tiny("llada", seed=6)
    prompt = PROMPTS[1]
    bl = 8
    # never fires: after the prefill, a block start recomputes two blocks, other steps one
    params = SamplingParams(max_tokens=32, block_length=bl, decode="threshold", threshold=0.3,
                            cache="dual", drift_min=1e-6, early_stop=False)
    req, eng, seen = _positions_by_step(model, params, prompt)
    L = req.canvas_len
    for (q0, q1), stale, first, block in seen:
        bs = req.prompt_len + block * bl
        if first and block == 0:
            assert (q0, q1) == (0, L)
        elif first:
            assert (q0, q1) == (bs - bl, bs + bl)
        else:
            assert (q0, q1) == (bs, bs + bl) and not stale
    assert req.counters["positions_computed"] == sum(q1 - q0 for (q0, q1), *_ in seen)
    assert eng.stats["positions_computed"] == req.counters["positions_computed"]
    # nearly always fires, refreshing mid-block: every stale step recomputes the whole canvas,
    # and only those
    params = SamplingParams(max_tokens=32, block_length=bl, decode="threshold", threshold=0.3,
                            cache="dual", drift_min=1.0, drift_defer=False, early_stop=False)
    req, eng, seen = _positions_by_step(model, params, prompt)
    stale_steps = sum(s for _, s, *_ in seen)
    assert stale_steps == req.counters["sentinel_triggers"]["drift"] > 0
    for (q0, q1), stale, first, block in seen:
        assert ((q0, q1) == (0, req.canvas_len)) == (stale or (first and block == 0))


def test_deferred_refreshes_wait_for_the_block_start():
    """drift_defer: a failed test makes the NEXT BLOCK's first step recompute the whole canvas;
    no step inside a block does; a block start does iff a test failed in the block before."""
    model = tiny("llada", seed=6)
    params = SamplingParams(max_tokens=32, block_length=8, decode="threshold", threshold=0.3,
                            cache="dual", drift_min=1.0, drift_defer=True, kv_top_k=3,
                            early_stop=False)
    req, eng, seen = _positions_by_step(model, params, PROMPTS[1])
    L = req.canvas_len
    full = [(q0, q1) == (0, L) for (q0, q1), *_ in seen]
    assert any(full[1:]) and req.counters["sentinel_triggers"]["drift"] > 0
    for i, ((q0, q1), stale, first, block) in enumerate(seen):
        assert full[i] == (first and (block == 0 or stale))
        if not first:
            assert not full[i]
