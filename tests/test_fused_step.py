"""The fused step (the runner's ``step`` capture mode, ``worker/fused_step.py``: a whole steady
greedy step as one CUDA graph) run eagerly on the CPU against the general step path, and its
eligibility rules. tests/gpu checks the captured graphs."""
from __future__ import annotations

import pytest
import torch
from test_paged_engine import LONG
from test_sampler import PROMPTS, run_engine, tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.engine.engine import Engine
from flash_dllm.worker.graphs import GraphCache
from flash_dllm.worker.fused_step import FusedSteps as FusedStep


def _compare(model, prompts, params, **kw):
    ref, oref = run_engine(model, prompts, params, config=EngineConfig(fused_step=False, **kw))
    got, ogot = run_engine(model, prompts, params, config=EngineConfig(fused_step=True, **kw))
    for a, b, x, y in zip(ref, got, oref, ogot):
        assert torch.equal(a.canvas, b.canvas)
        assert x.num_forwards == y.num_forwards
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        for key in ("verify_candidates", "verify_accepted", "block_forwards"):
            assert x.metrics.get(key) == y.metrics.get(key), key
    return ogot


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decode", ["threshold", "vanilla"])
def test_fused_equals_general_path(family, cache, decode):
    model = tiny(family, seed=1)
    params = SamplingParams(max_tokens=24, block_length=8, cache=cache, decode=decode,
                            threshold=0.3, early_stop=False)
    _compare(model, PROMPTS, params)


@pytest.mark.parametrize("steps", [24, 6, 12])
def test_fused_vanilla_groups_and_schedules(steps):
    """vanilla with several tokens per step (k > 1, uneven schedules) over requests of different
    canvas lengths: the (canvas length, k) groups of select_top_k."""
    model = tiny("llada", seed=5)
    params = [SamplingParams(max_tokens=m, block_length=8, steps=s, cache="dual", decode="vanilla")
              for m, s in [(24, steps), (16, min(steps, 16) - min(steps, 16) % 2),
                           (24, steps), (8, 8)]]
    _compare(model, LONG, params)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_fused_mixed_lengths_and_thresholds(page_size):
    model = tiny("llada", seed=2)
    params = [SamplingParams(max_tokens=16, block_length=8, cache=c, decode="threshold",
                             threshold=t) for c, t in [("dual", 0.2), ("prefix", 0.05),
                                                       ("dual", 0.9), ("dual", 1.0)]]
    _compare(model, LONG, params, page_size=page_size)


def test_fused_mixes_with_general_requests():
    """A batch with one ineligible request (vanilla) takes the general path for that step;
    eligible steps before and after it still agree."""
    model = tiny("dream", seed=3)
    params = [SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                             threshold=0.2),
              SamplingParams(max_tokens=8, block_length=8, cache="dual", decode="vanilla")]
    _compare(model, PROMPTS[:2], params)


def test_fused_early_stop_and_demo_model():
    from flash_dllm.models.loader import DEMO_MODEL, load_model
    model, _ = load_model(DEMO_MODEL, device="cpu", dtype="float32")
    prompts = [[1, 30 + i, 40, 41, 42] for i in range(3)]
    params = SamplingParams(max_tokens=64, block_length=32, cache="dual", decode="threshold")
    _compare(model, prompts, params)


def test_eligibility():
    model = tiny("llada")
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True, fused_step_max_rows=16))
    ok = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold")
    reqs = [eng.add_request(PROMPTS[0], SamplingParams(max_tokens=16, block_length=8,
                                                       cache="dual", decode="threshold",
                                                       threshold=1.0))]
    assert not eng.runner.fused.eligible(reqs)          # the block's first step: a refresh
    eng.step()
    assert eng.runner.fused.eligible(reqs)
    eng.step()
    assert eng.runner.fused.stats["fused_steps"] == 1
    for bad in [dict(cache="none"), dict(temperature=0.5), dict(kv_jaccard_min=0.5),
                dict(decode="verify", entropy_max=1.0), dict(decode="verify", perturb_sigma=0.5)]:
        e = Engine(model, model.cfg, EngineConfig(fused_step=True))
        r = e.add_request(PROMPTS[0], SamplingParams(max_tokens=16, block_length=8,
                                                     **{"cache": "dual", "decode": "threshold",
                                                        **bad}))
        e.step()
        assert not e.runner.fused.eligible([r]), bad
    # rows cap: 3 requests x 8 > 16
    e = Engine(model, model.cfg, EngineConfig(fused_step=True, fused_step_max_rows=16))
    rs = [e.add_request(p, ok) for p in PROMPTS[:3]]
    e.step()
    assert not e.runner.fused.eligible(rs)
    assert e.runner.fused.eligible(rs[:2])
    # mixed policies: the general path
    e = Engine(model, model.cfg, EngineConfig(fused_step=True))
    rs = [e.add_request(PROMPTS[0], ok),
          e.add_request(PROMPTS[1], SamplingParams(max_tokens=16, block_length=8, cache="dual",
                                                   decode="vanilla"))]
    e.step()
    assert e.runner.fused.eligible(rs[1:]) and not e.runner.fused.eligible(rs)


def test_off_by_default_on_cpu_and_validated():
    model = tiny("llada")
    assert Engine(model, model.cfg).runner.fused is None
    with pytest.raises(ValueError, match="fused_step"):
        EngineConfig(fused_step="yes")
    with pytest.raises(ValueError, match="fused_step_max_rows"):
        EngineConfig(fused_step_max_rows=0)


def test_engine_is_freed_without_gc():
    """No reference cycle through the fused step: dropping the engine frees it (and on a GPU its
    KV pool and graphs) at once, not at the next garbage collection."""
    import gc
    import weakref
    model = tiny("llada")
    gc.disable()
    try:
        eng = Engine(model, model.cfg, EngineConfig(fused_step=True))
        eng.add_request(PROMPTS[0], SamplingParams(max_tokens=16, block_length=8, cache="dual",
                                                   decode="threshold", threshold=1.0))
        for _ in range(3):
            eng.step()
        assert eng.runner.fused.stats["fused_steps"] > 0
        ref = weakref.ref(eng)
        del eng
        assert ref() is None
    finally:
        gc.enable()


def test_graph_policy():
    """On CUDA: the first sighting of a step shape runs on the general path, the second is
    captured, later ones replay; oversized steps always go to the general path; without graphs
    the body runs eagerly."""
    f = FusedStep(GraphCache(4), max_rows=256, max_tokens=100)
    assert f._decide(("a",), 64, graphs=False) == "eager"
    assert f._decide(("a",), 64, graphs=True) == "general"
    assert f._decide(("a",), 64, graphs=True) == "capture"
    f.cache.graphs[("a",)] = object()
    assert f._decide(("a",), 64, graphs=True) == "replay"
    assert f._decide(("big",), 101, graphs=True) == "general"
    assert f._decide(("big",), 101, graphs=True) == "general"
    # long per-request queries (prefix mode: a new key every block) wait for a third sighting
    assert [f._decide(("long",), 90, True, max_q=129) for _ in range(3)] == \
        ["general", "general", "capture"]


def test_declined_step_runs_the_general_path():
    """run() returning None (the general path) must leave the step to Engine.step."""
    model = tiny("llada", seed=6)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                            threshold=1.0)
    ref, _ = run_engine(model, PROMPTS, params, config=EngineConfig(fused_step=False))
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True))
    eng.runner.fused._decide = lambda *args: "general"
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    assert eng.runner.fused.stats["fused_steps"] == 0
    for a, b in zip(ref, reqs):
        assert torch.equal(a.canvas, b.canvas)


def test_released_requests_are_not_kept_by_step_caches():
    model = tiny("llada", seed=7)
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True))
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                            threshold=1.0)
    reqs = [eng.add_request(p, params) for p in PROMPTS[:2]]
    for _ in range(3):
        eng.step()
    assert eng.runner.fused._last is not None and eng.runner._tables.cached
    eng.abort(reqs[0].request_id)
    assert eng.runner.fused._last is None and not eng.runner._tables.cached
    while eng.has_unfinished():
        eng.step()
    assert eng.runner.fused._last is None and not eng.runner._tables.cached


@pytest.mark.parametrize("decode", ["threshold", "vanilla"])
def test_fused_lm_head_at_masked_rows_only(monkeypatch, decode):
    """Above LM_ALL_ROWS block rows the fused step computes the LM head at the masked slots only
    (compacted on the device into a bucketed row count): same tokens as the general path."""
    monkeypatch.setattr(FusedStep, "LM_ALL_ROWS", 4)
    calls = []
    real = FusedStep._masked_proposal

    def spy(*args):
        calls.append(args[4])                                  # lm_rows
        return real(*args)
    monkeypatch.setattr(FusedStep, "_masked_proposal", staticmethod(spy))
    model = tiny("llada", seed=4)
    params = SamplingParams(max_tokens=24, block_length=8, cache="dual", decode=decode,
                            threshold=0.3, early_stop=False)
    _compare(model, PROMPTS, params)
    assert calls and min(calls) < len(PROMPTS) * 8             # compacted steps did run


def test_lm_head_rows_buckets():
    f = FusedStep.lm_head_rows
    assert f(32, 1) == 32 and f(256, 3) == 256               # small: every block row
    assert [f(2048, m) for m in (1, 256, 257, 1000, 2048)] == [256, 256, 512, 1024, 2048]
    assert f(512, 1) == 128 and f(512, 129) == 256            # bucket max(LM_ALL_ROWS/2, R/8)
    assert all(f(R, m) >= m for R in (300, 1024, 2048) for m in range(1, R + 1, 37))


def test_graph_cache_policy():
    """The capture policy both capture modes share: capture at the first_capture-th
    sighting (large shapes one later), least recently used graph dropped beyond max_graphs."""
    c = GraphCache(max_graphs=2)
    assert [c.sighted("a") for _ in range(2)] == [False, True]
    assert [c.sighted("big", large=True) for _ in range(3)] == [False, False, True]
    c.first_capture = 1
    assert c.sighted("now")
    c.add("a", 1)
    c.add("b", 2)
    assert c.get("a") == 1                  # "a" is now the most recently used
    c.add("c", 3)
    assert list(c.graphs) == ["a", "c"] and c.get("b") is None


def test_nothing_is_captured_after_ready():
    """Before ready a shape is captured at its second sighting (a large one at its third); once
    a warm-up made the server ready (``GraphCache.ready``) never: it runs eagerly."""
    c = GraphCache(max_graphs=8)
    c.set_model(4_000_000)
    assert [c.sighted("refresh", large=True, tokens=1500) for _ in range(3)] == \
        [False, False, True]
    assert [c.sighted("decode", tokens=32) for _ in range(2)] == [False, True]
    c.ready = True
    assert not any(c.sighted("decode2", tokens=32) for _ in range(5))
    assert not any(c.sighted("refresh2", large=True, tokens=1500) for _ in range(5))


# ------------------------------------------------------------------------- decode="verify"
def _fused_verify_steps(model, prompts, params, **kw) -> int:
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True, **kw))
    for i, p in enumerate(prompts):
        eng.add_request(p, params if isinstance(params, SamplingParams) else params[i])
    while eng.has_unfinished():
        eng.step()
    return eng.runner.fused.stats["fused_steps"]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("rule,max_verify", [("agree", None), ("cumprod", 3), ("agree", 1)])
def test_fused_verify_equals_general_path(family, cache, rule, max_verify):
    """The fused verify step (``decoding/policies/verify_fused.py``: drafts padded to the batch's
    max_verify, verification rows attended in one batched call, acceptance without host reads)
    commits exactly what the general path commits, with the same forwards and verify
    counters, over requests of different canvas lengths (Dream: the shifted mask views)."""
    model = tiny(family, seed=1)
    params = SamplingParams(max_tokens=24, block_length=8, cache=cache, decode="verify",
                            threshold=0.5, gamma=0.3, verify_rule=rule, max_verify=max_verify,
                            early_stop=False)
    out = _compare(model, LONG, params)
    assert sum(o.metrics["verify_accepted"] for o in out) > 0        # drafts did pass
    assert _fused_verify_steps(model, LONG, params) > 0


def test_fused_verify_mixed_knobs_and_demo_model():
    """Per-request gamma, tau, rule and max_verify in one fused batch (the padded draft slots
    of the requests with fewer drafts never pass), on the demo model and a tiny one."""
    from flash_dllm.models.loader import DEMO_MODEL, load_model
    model, _ = load_model(DEMO_MODEL, device="cpu", dtype="float32")
    prompts = [[1, 30 + i, 40, 41, 42] for i in range(4)]
    knobs = [dict(gamma=0.8), dict(gamma=0.5, verify_rule="cumprod", max_verify=4),
             dict(gamma=0.95, threshold=0.99, max_verify=2), dict(gamma=2.0, threshold=0.7)]
    params = [SamplingParams(max_tokens=64, block_length=32, cache="dual", decode="verify",
                             **k) for k in knobs]
    _compare(model, prompts, params)
    tiny_params = [SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="verify",
                                  threshold=0.4, gamma=g, max_verify=m, early_stop=False)
                   for g, m in [(0.2, 8), (0.4, 2), (0.3, 5), (0.9, 1)]]
    _compare(tiny("dream", seed=8), LONG, tiny_params)


def test_fused_and_general_verify_steps_alternate():
    """A request that joins mid-block makes the batch's next step a general one (its first step
    is a refresh) while the others' drafts are in the draft store; they come back out
    (``DraftStore.load``) and go back in at the next fused step: the same tokens as a run
    without fused steps on the same schedule."""
    model = tiny("llada", seed=9)
    params = SamplingParams(max_tokens=24, block_length=8, cache="dual", decode="verify",
                            threshold=0.5, gamma=0.3, early_stop=False)

    def run(fused):
        eng = Engine(model, model.cfg, EngineConfig(fused_step=fused))
        reqs = [eng.add_request(LONG[0], params), eng.add_request(LONG[1], params)]
        for i in range(40):
            if i in (3, 7):
                reqs.append(eng.add_request(LONG[2 + (i == 7)], params))
            if not eng.has_unfinished():
                break
            eng.step()
        while eng.has_unfinished():
            eng.step()
        return reqs, eng
    ref, _ = run(False)
    got, eng = run(True)
    st = eng.runner.fused.stats
    assert st["fused_steps"] > 0
    for a, b in zip(ref, got):
        assert torch.equal(a.canvas, b.canvas)
        assert a.counters == b.counters


def test_fused_verify_limits(monkeypatch):
    """Past ``DraftStore.WIDTH`` drafts or ``VerifyPolicy.MAX_ELEMENTS`` the verify step stays
    on the general path."""
    from flash_dllm.decoding.policies.verify_fused import DraftStore
    model = tiny("llada")
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True))
    wide = SamplingParams(max_tokens=128, block_length=128, cache="dual", decode="verify",
                          max_verify=DraftStore.WIDTH + 1)
    ok = SamplingParams(max_tokens=128, block_length=128, cache="dual", decode="verify",
                        max_verify=DraftStore.WIDTH)
    rw, ro = eng.add_request(PROMPTS[0], wide), eng.add_request(PROMPTS[1], ok)
    eng.step()
    sg = eng.runner.fused
    assert not sg.eligible([rw]) and sg.eligible([ro])
    monkeypatch.setattr(DECODE_POLICIES["verify"], "MAX_ELEMENTS", 1000)
    assert not sg.eligible([ro])


def test_draft_store_round_trip():
    from flash_dllm.decoding.policies.verify_fused import DraftStore
    store = DraftStore(3, torch.device("cpu"))
    pos, tok = torch.tensor([9, 4, 7]), torch.tensor([50, 51, 52])
    store.put(1, (pos, tok))
    store.put(2, None)
    got = store.load(1)
    assert torch.equal(got[0], pos) and torch.equal(got[1], tok)
    assert store.load(2) is None and store.load(0) is None
    p, t, valid, count = store.read(torch.tensor([1, 2]), 4, torch.tensor([3, 5]), mask_id=99)
    assert count.tolist() == [3, 0] and valid.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert p.tolist() == [[9, 4, 7, 3], [5, 5, 5, 5]] and t[0].tolist() == [50, 51, 52, 99]
    store.write(torch.tensor([0]), torch.tensor([2]), torch.tensor([[1, 2]]),
                torch.tensor([[60, 61]]))
    got = store.load(0)
    assert got[0].tolist() == [1, 2] and got[1].tolist() == [60, 61]


@pytest.mark.parametrize("page_size", [4, 16])
def test_fused_verify_ignores_unwritten_pool_bytes(page_size):
    """The verification rows read each request's canvas keys padded to a power of two of
    pages: slots nobody wrote (the pool is ``torch.empty``: NaN bits too) must weigh nothing,
    not turn the rows NaN (0 x NaN). A pool full of NaN gives the clean general path's tokens."""
    model = tiny("llada", seed=1)
    params = SamplingParams(max_tokens=24, block_length=8, cache="dual", decode="verify",
                            threshold=0.5, gamma=0.3, early_stop=False)

    def run(fused, poison):
        eng = Engine(model, model.cfg, EngineConfig(fused_step=fused, page_size=page_size))
        if poison:
            eng.runner.kv.fill_(float("nan"))
        reqs = [eng.add_request(p, params) for p in LONG]
        while eng.has_unfinished():
            eng.step()
        return [(r.canvas.tolist(), r.counters["verify_accepted"]) for r in reqs]
    assert run(True, True) == run(False, False)
