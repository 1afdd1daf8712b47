"""Which pages of a request larger than the pool stay resident (``--kv-placement`` with
``--lazy-load-budget``, ``engine/overflow_placement.py``), on the CPU: the choice itself (the
active block resident, then by score; host pages by decreasing score), that any resident set,
moved at every block refresh, changes no token when every page is attended (full and compacted
tables), and that under lazy loading a placement by attention turns loads into L0 hits."""
from __future__ import annotations

import numpy as np
import pytest

from flash_dllm.config import EngineConfig
from flash_dllm.engine.engine import Engine
from flash_dllm.engine.overflow_placement import ResidentSet
from test_kv_overflow import LONG, PS, _params, _run
from test_sampler import tiny

CFG = dict(page_size=PS, num_kv_pages=6, kv_overflow_gb=0.01)


def test_choose_keeps_the_active_block_then_the_highest_scores_resident():
    rs = ResidentSet("ema", 10)
    assert rs.choose(6, (8, 10)) is None                  # no evidence yet: keep the split
    rs.observe(np.array([5.0, 0, 0, 4.0, 0, 0, 3.0, 0, 0, 0]))
    order = rs.choose(6, (8, 10))
    # 4 resident: the active block (8, 9), then pages 0 and 3; host: 6 first (its score), the
    # rest later pages first (ties keep the tail, as the positional split)
    assert order[6:].tolist() == [8, 9, 0, 3]
    assert order[:6].tolist() == [6, 7, 5, 4, 2, 1]
    assert sorted(order.tolist()) == list(range(10))
    # the evidence decays: a new block's mass takes over
    for _ in range(30):
        rs.observe(np.array([0, 0, 0, 0, 0, 1.0, 2.0, 0, 0, 0]))
    assert rs.choose(6, (8, 10))[6:].tolist() == [8, 9, 5, 6]
    # more active pages than room: as many as fit
    assert ResidentSet("lru", 10).choose(6, (0, 10)) is None
    one = ResidentSet("ema", 10)
    one.observe(np.ones(10))
    assert one.choose(8, (0, 10))[8:].tolist() == [0, 1]
    with pytest.raises(ValueError, match="kv_placement"):
        ResidentSet("random", 10)


def test_kag_ranks_by_pagerank_and_reports_stability():
    rs = ResidentSet("kag", 12, top_k=4)
    rs.observe(np.array([9.0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0]))
    assert set(rs.choose(9, (11, 12))[9:].tolist()) == {11, 0, 1}
    assert 0.0 <= rs.stability <= 1.0 and rs.graph.stats["pagerank_runs"] >= 1


def _shuffle_every_refresh(monkeypatch, seed=0):
    """Every block refresh moves the resident set to a random one."""
    import flash_dllm.engine.overflow_placement as op
    rng = np.random.default_rng(seed)

    def choose(self, spill, active):
        return rng.permutation(self.n)
    monkeypatch.setattr(op.ResidentSet, "choose", choose)
    monkeypatch.setattr(op.ResidentSet, "active", property(lambda self: True))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_any_resident_set_moved_at_every_refresh_changes_no_token(monkeypatch, family):
    model = tiny(family, seed=5)
    params = _params("dual", "vanilla", max_tokens=24)
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(page_size=PS)), [LONG], params)
    _shuffle_every_refresh(monkeypatch)
    # every page attended (budget 1: the full, remapped block table)
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=1.0, kv_placement="ema",
                                                **CFG))
    got, reqs = _run(eng, [LONG], params)
    st = eng.runner.overflow.stats
    assert got == ref
    assert st["replacements"] == 3 and st["pages_moved"] > 0    # the prefill and two refreshes
    # every page in two ranges: the compacted table of stage slots, the partial page last
    import flash_dllm.engine.lazy_load as ll
    monkeypatch.setattr(ll, "select_pages",
                        lambda score, budget, written, spill: ([(0, 3), (3, spill)], 1, 0))
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=0.5, kv_placement="ema",
                                                **CFG))
    got, _ = _run(eng, [LONG], params)
    assert got == ref and eng.runner.overflow.stats["replacements"] == 3
    assert eng.runner._overflow_req is None and eng.kv_manager.num_used == 0


def test_placement_without_lazy_loading_keeps_the_split_and_the_tokens():
    model = tiny("llada", seed=5)
    params = _params("dual", "threshold")
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(**CFG)), [LONG], params)
    eng = Engine(model, model.cfg, EngineConfig(kv_placement="kag", **CFG))
    assert _run(eng, [LONG], params)[0] == ref
    assert eng.runner.overflow.placement == "lru"
    assert eng.runner.overflow.stats["replacements"] == 0


@pytest.mark.parametrize("predictor", ["mass", "quest"])
def test_placement_by_attention_turns_lazy_loads_into_hits(predictor):
    """The same lazy budget: ema / kag keep the pages the measuring steps saw attended, so
    more of the pages a lazy step attends to are resident and fewer bytes cross."""
    model = tiny("llada", seed=5)
    params = _params("dual", "vanilla", max_tokens=32)
    st = {}
    for placement in ("lru", "ema", "kag"):
        eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=0.25,
                                                    lazy_load_predictor=predictor,
                                                    kv_placement=placement, **CFG))
        got, reqs = _run(eng, [LONG], params)
        assert reqs[0].finished and len(got[0]) == len(LONG) + 32
        st[placement] = dict(eng.runner.overflow.stats)
    assert st["lru"]["replacements"] == 0
    for p in ("ema", "kag"):
        assert st[p]["replacements"] >= 1
        assert st[p]["lazy_hits"] > st["lru"]["lazy_hits"]
        assert st[p]["h2d_bytes"] < st["lru"]["h2d_bytes"]
        assert st[p]["lazy_wanted"] == pytest.approx(st["lru"]["lazy_wanted"])
