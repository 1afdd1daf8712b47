"""benchmarks/placement/placement_trace.py: its simulation of a request larger than the pool,
replayed from the trace a real run left, loads the same host pages and counts the same L0 hits as
the engine did (every placement, lazy or exact, dual and prefix, LLaDA and Dream's shifted window);
and its scaling keeps the trace's shape (steps, the prompt's share of the mass, the answer's
pages)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from flash_dllm.config import EngineConfig
from flash_dllm.engine.engine import Engine
from test_kv_overflow import LONG, PS, _params, _run
from test_sampler import tiny

_PATH = (Path(__file__).resolve().parents[1] / "benchmarks" / "placement"
         / "placement_trace.py")
_spec = importlib.util.spec_from_file_location("placement_trace", _PATH)
pt = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("placement_trace", pt)
_spec.loader.exec_module(pt)


@pytest.mark.parametrize("family,cache,budget,placement", [
    ("llada", "dual", 0.5, "lru"), ("llada", "dual", 0.25, "ema"), ("llada", "dual", 0.5, "kag"),
    ("dream", "dual", 0.25, "ema"), ("llada", "prefix", 0.25, "ema"),
    ("llada", "dual", None, "lru")])
def test_the_simulation_replays_the_engine_s_loads_and_hits(family, cache, budget, placement):
    model = tiny(family, seed=5)
    eng = Engine(model, model.cfg, EngineConfig(
        page_size=PS, num_kv_pages=6, kv_overflow_gb=0.01, lazy_load_budget=budget,
        kv_placement=placement))
    with pt.recording() as traces:
        _run(eng, [LONG], _params(cache, "vanilla", max_tokens=32))
    (trace,) = traces.values()
    n = -(-trace["canvas_len"] // PS)
    sim = pt.simulate(trace, n - trace["spill"], budget, placement)
    ov = eng.runner.overflow
    st = ov.stats
    assert sim["pages_loaded"] * ov.num_layers * ov.page_layer_bytes == st["h2d_bytes"] > 0
    assert sim["lazy_wanted"] == st["lazy_wanted"] and sim["lazy_hits"] == st["lazy_hits"]
    assert len(trace["masses"]) == st["measuring_steps"]
    if budget is not None:
        assert sim["lazy_steps"] > 0 and (placement == "lru" or st["replacements"] > 0)


def test_scaling_stretches_the_prompt_and_keeps_the_answer():
    rng = np.random.default_rng(0)
    P, gen, ps = 40, 22, 4                               # the last recorded page: 2 tokens
    C = P + gen
    masses = [rng.random(-(-C // ps)) for _ in range(3)]
    trace = {"prompt_len": P, "canvas_len": C, "page_size": ps, "answer_tokens": 20,
             "steps": [([0, C], [40, 48]), ([40, 48], [40, 48]), ([0, C], [48, 56]),
                       ([47, 56], [47, 56])], "masses": [m.tolist() for m in masses]}
    long = pt.scale(trace, 4000, 16, sigma=1.0, seed=0)
    C2 = 4000 + gen
    assert long["canvas_len"] == C2 and long["num_pages"] == -(-C2 // 16) == 252
    assert long["steps"] == [([0, C2], [4000, 4008]), ([4000, 4008], [4000, 4008]),
                             ([0, C2], [4008, 4016]), ([4007, 4016], [4007, 4016])]
    for m, m2 in zip(masses, long["masses"]):
        assert m2.shape == (long["num_pages"],)
        assert m2.sum() == pytest.approx(m.sum())                   # no mass made or lost
        assert m2[:250].sum() == pytest.approx(m[:P // ps].sum())   # the prompt keeps its share
        # the answer's 22 tokens (1.4 long pages) carry the recorded answer pages' mass
        assert m2[250:].sum() == pytest.approx(m[P // ps:].sum())
    flat = pt.scale(trace, 4000, 16, sigma=0.0, seed=0)["masses"][0]
    # no salience noise: each of the 10 recorded prompt pages spreads evenly over 25 pages
    assert np.allclose(flat[:250].reshape(10, 25), (masses[0][:10] / 25)[:, None])


def test_the_report_draws(tmp_path):
    rows = [{"model": "m", "suite": "s", "prompt_tokens": 32768, "sigma": 1.0, "l0": l0,
             "lazy_load_budget": f, "kv_placement": pl, "gib_per_lazy_step": g,
             "hit_rate": 0.5}
            for l0 in (0.25, 0.1) for f in (0.25, 0.1) for pl, g in (("lru", 1.0), ("ema", 0.5))]
    pt.plot({"rows": rows + [{**rows[0], "lazy_load_budget": None, "gib_per_lazy_step": None,
                              "hit_rate": None}]}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
