"""Lazy loading's sentinel (``--lazy-load-sentinel``, ``cache/io/lazy_load.py``), on the CPU: the
overlap it measures, that a sentinel which never fires changes no token of a lazy run, that one
which fires forces the next step to load every page and measure again, counted per request, per
engine and in the server's sentinel metrics; bad values are named errors. And the quest predictor
(``--lazy-load-predictor quest``): its bound holds against the exact largest logit, it picks the
pages a query turns to, and a run re-chooses its pages after every step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kv_overflow import LONG, PS, _params, _run
from test_sampler import tiny

from flash_dllm.cache.io.lazy_load import (SENTINEL_TOP_K, key_summary, quest_scores,
                                           quest_scores_reference, sentinel_overlap)
from flash_dllm.config import EngineConfig
from flash_dllm.engine.engine import Engine

LAZY = dict(page_size=PS, num_kv_pages=6, kv_overflow_gb=0.01, lazy_load_budget=0.5)


def test_sentinel_overlap_is_the_jaccard_of_the_top_pages_then_and_now():
    keep = np.array([0, 1, 2, 3, 7, 8, 9, 20, 21])       # compacted table: logical pages
    watched = np.array([0, 1, 2, 3, 4, 5, 6])            # host pages it could have skipped
    ref = np.zeros(22)
    ref[[0, 1, 2]] = [5.0, 4.0, 3.0]                     # then: pages 0, 1, 2 (k = 3 of 7)
    same = np.array([9.0, 8.0, 7.0, 0, 0, 0, 0, 99, 99])  # resident pages are not watched
    assert sentinel_overlap(ref, keep, watched, same) == 1.0
    moved = np.array([0, 0, 0, 0, 3.0, 2.0, 1.0, 0, 0])
    assert sentinel_overlap(ref, keep, watched, moved) == 0.0
    half = np.array([9.0, 8.0, 0, 0, 7.0, 0, 0, 0, 0])   # {0, 1, 4} vs {0, 1, 2}: 2 / 4
    assert sentinel_overlap(ref, keep, watched, half) == 0.5
    # many pages: the top sets have SENTINEL_TOP_K pages (8), not half of them (20)
    assert SENTINEL_TOP_K == 8
    many, ref = np.arange(40), np.arange(40.0)           # then: pages 32..39
    now = ref.copy()
    now[31] = 32.5                                       # now: 31 and 33..39
    assert sentinel_overlap(ref, many, many, now) == 7 / 9


def test_a_sentinel_that_never_fires_changes_no_token(monkeypatch):
    import flash_dllm.cache.io.kv_overflow as ko
    model = tiny("llada", seed=5)
    params = _params("dual", "vanilla")
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(**LAZY)), [LONG], params)
    monkeypatch.setattr(ko, "sentinel_overlap", lambda *a: 1.0)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_sentinel=0.5, **LAZY))
    got, reqs = _run(eng, [LONG], params)
    st = eng.runner.overflow.stats
    assert got == ref
    assert st["sentinel_checks"] > 0 and st["sentinel_triggers"] == 0
    assert reqs[0].counters["sentinel_checks"]["lazy_load"] == st["sentinel_checks"]


def test_a_firing_sentinel_forces_a_measuring_step_that_loads_every_page(monkeypatch):
    import flash_dllm.cache.io.kv_overflow as ko
    model = tiny("llada", seed=5)
    params = _params("dual", "vanilla")
    plain = Engine(model, model.cfg, EngineConfig(**LAZY))
    _run(plain, [LONG], params)
    monkeypatch.setattr(ko, "sentinel_overlap", lambda *a: 0.0)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_sentinel=0.5, **LAZY))
    got, reqs = _run(eng, [LONG], params)
    st, st0 = eng.runner.overflow.stats, plain.runner.overflow.stats
    assert reqs[0].finished and len(got[0]) == len(LONG) + 16
    assert st["sentinel_triggers"] == st["sentinel_checks"] > 0
    # every lazy step fires, so the next step loads every page and measures again: lazy and
    # measuring steps alternate inside a block
    assert st["measuring_steps"] > st0["measuring_steps"]
    assert st["measuring_steps"] >= st["sentinel_triggers"]
    assert st["skipped_pages"] < st0["skipped_pages"] and st["h2d_bytes"] > st0["h2d_bytes"]
    assert eng.stats["sentinel_triggers"]["lazy_load"] == st["sentinel_triggers"]
    assert reqs[0].counters["sentinel_triggers"]["lazy_load"] == st["sentinel_triggers"]
    assert eng.runner.overflow_state is None and eng.kv_manager.num_used == 0


def test_the_real_sentinel_runs_and_its_counts_add_up():
    model = tiny("llada", seed=5)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_sentinel=1.0, **LAZY))
    got, reqs = _run(eng, [LONG], _params("dual", "vanilla"))
    st = eng.runner.overflow.stats
    assert reqs[0].finished and st["sentinel_checks"] > 0
    assert 0 <= st["sentinel_triggers"] <= st["sentinel_checks"]
    assert eng.stats["sentinel_checks"]["lazy_load"] == st["sentinel_checks"]


def test_bad_sentinel_values_are_named():
    with pytest.raises(ValueError, match="set lazy_load_budget"):
        EngineConfig(kv_overflow_gb=0.01, lazy_load_sentinel=0.5)
    for bad in (0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match=r"lazy_load_sentinel must be in \(0, 1\]"):
            EngineConfig(kv_overflow_gb=0.01, lazy_load_budget=0.5, lazy_load_sentinel=bad)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_the_quest_bound_is_an_upper_bound_and_ranks_the_page_a_query_turns_to(heads, kv_heads):
    """Per head, the bound from the page's key box and the rows' query box is >= every row's
    logit on every key of the page (property over random draws); the score is a positive sum
    over heads of exp(bound - the head's largest), so the page holding a key aligned with every
    head's queries ranks first."""
    gen = torch.Generator().manual_seed(0)
    D, ps, P, T = 16, 4, 12, 5
    for _ in range(20):
        q = torch.randn(T, heads, D, generator=gen)
        keys = torch.randn(P, ps, kv_heads, D, generator=gen)
        kmin, kmax = key_summary(keys)
        exact = quest_scores_reference(q, keys)                          # [H, P]
        lo = kmin.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        hi = kmax.repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        qlo, qhi = q.amin(0)[:, None], q.amax(0)[:, None]
        bound = (torch.maximum(torch.maximum(qlo * lo, qlo * hi),
                               torch.maximum(qhi * lo, qhi * hi)).sum(-1) * D ** -0.5)
        assert (bound >= exact - 1e-5).all()
        score = quest_scores(q, kmin, kmax)
        assert score.shape == (P,) and (score > 0).all() and (score <= heads + 1e-5).all()
    q = torch.randn(T, heads, D, generator=gen) * 0.1
    q[:, :, 0] = 5.0                                  # every row and head looks along channel 0
    keys = torch.randn(P, ps, kv_heads, D, generator=gen) * 0.1
    keys[7, 2, :, 0] = 6.0                            # one key of page 7 lies along it
    assert int(quest_scores(q, *key_summary(keys)).argmax()) == 7


def test_a_quest_run_rechooses_its_pages_after_every_step_and_budget_one_is_exact():
    model = tiny("llada", seed=5)
    params = _params("dual", "vanilla")
    exact = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6,
                                                  kv_overflow_gb=0.01))
    ref, _ = _run(exact, [LONG], params)
    full = Engine(model, model.cfg, EngineConfig(**{**LAZY, "lazy_load_budget": 1.0},
                                                 lazy_load_predictor="quest"))
    assert _run(full, [LONG], params)[0] == ref
    mass = Engine(model, model.cfg, EngineConfig(**LAZY))
    _run(mass, [LONG], params)
    quest = Engine(model, model.cfg, EngineConfig(lazy_load_predictor="quest", **LAZY))
    calls = []
    ov = quest.runner.overflow
    real = ov._lazy_step
    ov._lazy_step = lambda *a: calls.append(a[1].copy()) or real(*a)
    got, reqs = _run(quest, [LONG], params)
    st, st_mass = ov.stats, mass.runner.overflow.stats
    assert reqs[0].finished and len(got[0]) == len(ref[0])
    assert st["measuring_steps"] == st_mass["measuring_steps"] > 0
    assert st["skipped_pages"] > 0
    # a plan per lazy step (the mass predictor makes one per block), from positive bounds
    assert len(calls) > st["measuring_steps"] and all((c > 0).all() for c in calls)
    assert quest.runner.overflow_state is None and quest.kv_manager.num_used == 0


def test_quest_summaries_ignore_the_unwritten_slots_of_the_partial_last_page():
    """The canvas (86 tokens, pages of 4) ends half-way through its last page, whose other
    slots were never written: NaN there (the pool and the stage are ``torch.empty``) changes
    no bound, no plan and no token. Before the mend the last page's summary took them in and
    every other page's score was NaN or 0 (a CI failure of the test above)."""
    model = tiny("llada", seed=5)
    params = _params("dual", "vanilla")

    def run(poison):
        eng = Engine(model, model.cfg, EngineConfig(lazy_load_predictor="quest", **LAZY))
        ov = eng.runner.overflow
        if poison:
            eng.runner.kv.fill_(float("nan"))
            ov.stage.fill_(float("nan"))
        calls = []
        real = ov._lazy_step
        ov._lazy_step = lambda *a: calls.append(a[1].copy()) or real(*a)
        return _run(eng, [LONG], params)[0], calls

    ref, ref_calls = run(False)
    got, calls = run(True)
    assert got == ref and len(calls) == len(ref_calls) > 0
    for c, r in zip(calls, ref_calls):
        assert np.isfinite(c).all() and (c > 0).all()
        np.testing.assert_allclose(c, r, rtol=1e-5)
    kmin, kmax = key_summary(torch.tensor([[[[1.0]], [[float("nan")]]],
                                           [[[2.0]], [[-3.0]]]]), tail=(0, 1))
    assert kmin.flatten().tolist() == [1.0, -3.0] and kmax.flatten().tolist() == [1.0, 2.0]


def test_quest_summaries_live_in_memory_reserved_before_the_pool_is_sized():
    """The key summaries are written into the overflow stage's preallocated buffer (made before
    the pool is sized, so the pool's budget leaves room for them), not allocated per step."""
    model = tiny("llada", seed=5)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_predictor="quest", **LAZY))
    ov = eng.runner.overflow
    L, H, D = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
    assert ov.summary.shape == (L, 2, ov.max_pages, H, D)
    seen = []
    real = ov._lazy_step
    ov._lazy_step = lambda *a: seen.append(a[0].summary) or real(*a)
    _run(eng, [LONG], _params("dual", "vanilla"))
    base, end = ov.summary.data_ptr(), ov.summary.data_ptr() + ov.summary.nbytes
    assert seen and all(base <= t.data_ptr() < end for sm in seen for pair in sm for t in pair)
    mass = Engine(model, model.cfg, EngineConfig(**LAZY))
    assert mass.runner.overflow.summary is None


def test_bad_predictor_names_are_named():
    with pytest.raises(ValueError, match="lazy_load_predictor"):
        EngineConfig(kv_overflow_gb=0.01, lazy_load_budget=0.5, lazy_load_predictor="oracle")
    with pytest.raises(ValueError, match="set lazy_load_budget"):
        EngineConfig(kv_overflow_gb=0.01, lazy_load_predictor="quest")


def test_quest_per_layer_tables_that_keep_every_page_equal_the_exact_step(monkeypatch):
    """Quest plans a compacted block table per layer, swapped in before each layer's attention:
    given every page (in two ranges) at every layer, the tokens are the exact ones; given a
    different share per layer, each layer copies its own pages (the bytes add up per layer)."""
    import flash_dllm.cache.io.kv_overflow as ko
    import flash_dllm.cache.io.lazy_load as ll
    model = tiny("dream", seed=5)
    params = _params("dual", "vanilla")
    cfg = dict(page_size=PS, num_kv_pages=6, kv_overflow_gb=0.01)
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(**cfg)), [LONG], params)
    monkeypatch.setattr(ll, "select_pages", lambda score, budget, written, spill: ([(0, 5), (5, 16)], 1, 0))
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=0.5, lazy_load_predictor="quest",
                                                **cfg))
    got, _ = _run(eng, [LONG], params)
    assert eng.runner.overflow.stats["skipped_pages"] == 0
    assert got == ref

    # each layer's bounds favour its own page (layer i: page i): each layer loads that page
    L = model.cfg.num_layers
    calls = iter(range(10**6))

    def one_hot(q, kmin, kmax):
        out = torch.full((kmin.shape[0],), 1e-6)
        out[next(calls) % L] = 1.0
        return out
    monkeypatch.undo()                                   # the real select_pages again
    monkeypatch.setattr(ll, "quest_scores", one_hot)
    loads = []
    real = ko._StepCopies._load

    def spy(self, layer):
        if self.per_layer and layer < L:
            loads.append((layer, self.load_of(layer)))
        return real(self, layer)
    monkeypatch.setattr(ko._StepCopies, "_load", spy)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=0.05, lazy_load_predictor="quest",
                                                **cfg))
    _run(eng, [LONG], params)
    assert loads, "no lazy step planned per layer"
    for layer, ranges in loads:
        assert any(a <= layer < b for a, b in ranges), (layer, ranges)
