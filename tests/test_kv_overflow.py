"""Requests larger than the GPU page pool (``--kv-overflow-gb``, ``cache/io/kv_overflow.py``), on the
CPU: such a request keeps the pages that fit in the pool and streams the rest from host memory
layer by layer, and its outputs equal token for token those of an engine whose pool holds it
whole; it runs alone, other requests wait and then run, nothing leaks, and what cannot stream is
refused with a message naming the reason."""
from __future__ import annotations

import pytest
from test_sampler import tiny
from test_server import metrics_of
from test_tiers import check_ledger

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine

PS = 4
LONG = [(7 * i + 3) % 90 + 3 for i in range(70)]          # 70 + 16 = 86 tokens: 22 pages
SHORT = [(5 * i + 1) % 90 + 3 for i in range(9)]


def _params(cache="dual", decode="threshold", **kw):
    return SamplingParams(**{"max_tokens": 16, "block_length": 8, "cache": cache,
                             "decode": decode, "threshold": 0.5, **kw})


def _run(eng, prompts, params):
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [r.tokens.tolist() for r in reqs], reqs


@pytest.mark.parametrize("family,cache,decode,pages", [
    ("llada", "dual", "threshold", 6),        # 16 of 22 pages in host memory
    ("dream", "prefix", "vanilla", 6),        # (Dream: a logit shift, grouped KV heads)
    ("llada", "dual", "vanilla", 20),         # 2 spilled pages
    ("dream", "dual", "threshold", 1),        # one resident page: the active block spills too
])
def test_overflow_request_equals_the_all_in_pool_run(family, cache, decode, pages):
    model = tiny(family, seed=5)
    params = _params(cache, decode)
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(page_size=PS)), [LONG], params)
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=pages,
                                                kv_overflow_gb=0.01))
    got, reqs = _run(eng, [LONG], params)
    assert got == ref
    assert reqs[0].overflow is not None and reqs[0].overflow.spill == 22 - pages
    ov = eng.runner.overflow
    assert ov.stats["steps"] == reqs[0].num_forwards
    # loads: every step but the two block refreshes (which rewrite every spilled page)
    assert ov.stats["d2h_bytes"] > 0 and ov.stats["h2d_bytes"] > 0
    check_ledger(eng)
    assert eng.kv_manager.num_used == 0 and eng.runner.overflow_state is None


def test_overflow_runs_alone_and_the_others_run_after_it():
    model = tiny("llada", seed=6)
    params = _params()
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(page_size=PS)), [SHORT, LONG, SHORT],
                  params)
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=8,
                                                kv_overflow_gb=0.01, prefix_reuse=True))
    reqs = [eng.add_request(p, params) for p in (SHORT, LONG, SHORT)]
    alone = []
    while eng.has_unfinished():
        eng.step()
        if reqs[1] in eng.running:
            alone.append(len(eng.running) == 1)
    assert alone and all(alone)
    assert [r.tokens.tolist() for r in reqs] == ref
    # the overflow request published nothing (its pages were never all in the pool)
    assert eng.kv_manager.stats["hit_tokens"] == [0, 0, 0]
    check_ledger(eng)


def test_abort_of_an_overflow_request_frees_everything():
    model = tiny("llada", seed=7)
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6,
                                                kv_overflow_gb=0.01))
    req = eng.add_request(LONG, _params())
    eng.step()
    eng.step()
    assert eng.abort(req.request_id)
    assert eng.kv_manager.num_used == 0 and eng.runner.overflow_state is None
    got, _ = _run(eng, [SHORT], _params())           # the engine goes on
    check_ledger(eng)


@pytest.mark.parametrize("config,params,match", [
    (dict(), _params(), "--kv-overflow-gb > 0"),
    (dict(kv_overflow_gb=1e-6), _params(), "more than --kv-overflow-gb"),
    (dict(kv_overflow_gb=0.01), _params(cache="none"), "cache='none'"),
    (dict(kv_overflow_gb=0.01), _params(cache="flash"), "cache='flash'"),
    (dict(kv_overflow_gb=0.01), _params(decode="verify"), "decode='verify'"),
    (dict(kv_overflow_gb=0.01), _params(kv_jaccard_min=0.5), "kv_jaccard_min"),
    (dict(kv_overflow_gb=0.01), _params(drift_min=0.9), "drift_min"),
])
def test_what_cannot_stream_is_refused_with_the_reason(config, params, match):
    model = tiny("llada", seed=8)
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6, **config))
    with pytest.raises(ValueError, match=match):
        eng.add_request(LONG, params)
    with pytest.raises(ValueError, match="kv_overflow_gb must be"):
        EngineConfig(kv_overflow_gb=-1)


def test_overflow_is_refused_with_disaggregation_before_any_worker_starts():
    from flash_dllm.entrypoints.args import EngineArgs
    from flash_dllm.entrypoints.pd_launch import launch
    with pytest.raises(ValueError, match="--kv-overflow-gb .* --disaggregate"):
        launch(EngineArgs(kv_overflow_gb=0.01))


def test_bench_overflow_on_the_cpu_runs_and_matches(tmp_path):
    """``flash-dllm bench overflow`` end to end on the demo model (a small prompt): the report
    says the request was refused without the flag, and its tokens equal the all-in-GPU run's."""
    import json

    from flash_dllm.cli import main
    out = tmp_path / "ov.json"
    assert main(["bench", "overflow", "--prompt-len", "120", "--gen-len", "16",
                 "--block-length", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens_equal"] and r["refused_without_overflow"]
    assert r["spilled_pages"] == r["pages"] - r["resident_pages"] > 0
    assert r["cases"]["overflow"]["steps"] == r["cases"]["all_in_gpu"]["steps"] == 16
    assert r["step_bound_s"] > 0 and r["non_resident_bytes_per_step"] > 0


def test_an_overflow_request_through_the_server_next_to_short_ones():
    """Over HTTP (the shipped demo model): a prompt larger than the GPU pool streams with
    --kv-overflow-gb while short requests wait for it and then run; without the flag it is a 400
    that names the flag."""
    import asyncio

    import httpx

    from flash_dllm.entrypoints.serve import load_async_engine
    from flash_dllm.server.app import build_app

    long_prompt = "Ivy has 23 pens; Vic has 12 fewer. " * 9      # ~320 tokens: 21+ pages of 16
    body = {"max_tokens": 32, "cache": "dual", "decode": "threshold"}

    async def go(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            reqs = [c.post("/v1/completions", json={"prompt": p, **body})
                    for p in ("2+2=", long_prompt, "3+4=")]
            return await asyncio.gather(*reqs)

    aeng, tok, _ = load_async_engine(config=EngineConfig(num_kv_pages=8, kv_overflow_gb=0.01))
    short, long_, short2 = asyncio.run(go(build_app(aeng, tok, "demo")))
    assert short.status_code == long_.status_code == short2.status_code == 200, long_.text
    assert long_.json()["usage"]["prompt_tokens"] > 8 * 16
    assert aeng.engine.runner.overflow.stats["steps"] > 0
    m = metrics_of(asyncio.run(_get(build_app(aeng, tok, "demo"), "/metrics")))
    assert m['flash_dllm_kv_overflow_bytes_total{direction="h2d"}'] > 0
    assert m["flash_dllm_kv_overflow_steps_total"] > 0
    aeng, tok, _ = load_async_engine(config=EngineConfig(num_kv_pages=8))
    _, refused, _ = asyncio.run(go(build_app(aeng, tok, "demo")))
    assert refused.status_code == 400 and "--kv-overflow-gb" in refused.text


async def _get(app, path):
    import httpx
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        return (await c.get(path)).text


def _w(n, *pages):
    import numpy as np
    w = np.zeros(n, dtype=bool)
    w[list(pages)] = True
    return w


def test_select_pages_takes_the_most_attended_and_the_written_pages():
    """Stage order: slots 0..7 in host memory, 8..9 resident. The step attends to the top
    ceil(F * unwritten) pages wherever they live and loads the host ones among them."""
    import numpy as np

    from flash_dllm.cache.io.lazy_load import select_pages
    mass = np.array([0.1, 5.0, 0.2, 0.3, 4.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    assert select_pages(mass, 1.0, _w(10, 9), 8) == ([(0, 8)], 9, 1)
    # top 3 of 9: pages 1, 4 (host) and 3 (host); none resident
    assert select_pages(mass, 0.3, _w(10, 9), 8) == ([(1, 2), (3, 5)], 3, 0)
    assert select_pages(mass, 0.1, _w(10, 6, 7), 8) == ([(1, 2), (6, 8)], 1, 0)  # + written
    # a resident page among the top: it is a hit and loads nothing
    hot = mass.copy()
    hot[8] = 9.0
    assert select_pages(hot, 0.2, _w(10, 9), 8) == ([(1, 2)], 2, 1)
    assert select_pages(hot, 0.1, _w(10, 9), 8) == ([], 1, 1)
    big = np.zeros(1001)
    big[700] = 1.0                                    # chunks of 4 pages (<= 256 chunks)
    assert select_pages(big, 0.001, _w(1001, 1000), 1000) == ([(700, 704)], 1, 0)


def test_lazy_loading_moves_fewer_bytes_and_at_budget_one_changes_nothing():
    model = tiny("llada", seed=5)
    params = _params("dual", "threshold")
    exact = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6,
                                                  kv_overflow_gb=0.01))
    ref, _ = _run(exact, [LONG], params)
    full = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6,
                                                 kv_overflow_gb=0.01, lazy_load_budget=1.0))
    assert _run(full, [LONG], params)[0] == ref
    assert full.runner.overflow.stats["skipped_pages"] == 0
    lazy = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=6,
                                                 kv_overflow_gb=0.01, lazy_load_budget=0.25))
    got, reqs = _run(lazy, [LONG], params)
    st, st_ref = lazy.runner.overflow.stats, exact.runner.overflow.stats
    assert reqs[0].finished and len(got[0]) == len(ref[0])
    assert st["skipped_pages"] > 0 and st["h2d_bytes"] < st_ref["h2d_bytes"] / 2
    assert lazy.runner.overflow_state is None and lazy.kv_manager.num_used == 0
    with pytest.raises(ValueError, match="set kv_overflow_gb"):
        EngineConfig(lazy_load_budget=0.5)
    with pytest.raises(ValueError, match=r"lazy_load_budget must be in \(0, 1\]"):
        EngineConfig(kv_overflow_gb=0.01, lazy_load_budget=0)


def test_a_lazy_step_that_keeps_every_page_equals_the_exact_step(monkeypatch):
    """The compacted block table of a lazy step (kept host pages, then the resident ones, the
    partial last page last): given every page in two ranges, the outputs are the exact ones."""
    import flash_dllm.cache.io.lazy_load as ll
    model = tiny("dream", seed=5)
    params = _params("dual", "vanilla")
    cfg = dict(page_size=PS, num_kv_pages=6, kv_overflow_gb=0.01)
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(**cfg)), [LONG], params)
    monkeypatch.setattr(ll, "select_pages", lambda score, budget, written, spill: ([(0, 5), (5, 16)], 1, 0))
    eng = Engine(model, model.cfg, EngineConfig(lazy_load_budget=0.5, **cfg))
    got, _ = _run(eng, [LONG], params)
    assert eng.runner.overflow.stats["skipped_pages"] == 0
    assert got == ref


def test_a_disaggregated_engine_refuses_a_request_larger_than_the_pool_with_a_400():
    """``PDEngine.validate`` checks a request against its smallest worker pool, which cannot
    stream an overflow: a prompt larger than the pool is a ValueError (HTTP 400) that says why,
    not an AttributeError; a single engine without --kv-overflow-gb refuses it too."""
    from flash_dllm.disagg.router import PREFILL, PDEngine, WorkerHandle
    model = tiny("llada", seed=8)
    config = EngineConfig(page_size=PS, num_kv_pages=6)
    eng = Engine(model, model.cfg, config)
    worker = WorkerHandle(0, PREFILL, proc=None, ready=True, num_pages=6, page_size=PS)
    pd = PDEngine(eng.cfg, config, [worker], listener=None, timeout_s=1.0)
    with pytest.raises(ValueError, match="not supported with --disaggregate"):
        pd.validate(LONG, _params())
    with pytest.raises(ValueError, match="send a shorter request"):
        eng.add_request(LONG, _params(cache="none"))


def test_select_pages_ranks_only_the_pages_it_does_not_load_anyway():
    """The written pages (the active block) draw most of the attention and are loaded anyway:
    the budget goes to the other pages."""
    import numpy as np

    from flash_dllm.cache.io.lazy_load import select_pages
    mass = np.array([0.3, 0.1, 0.2, 0.0, 9.0, 9.0, 0.0])
    assert select_pages(mass, 0.4, _w(7, 4, 5), 6) == ([(0, 1), (2, 3), (4, 6)], 2, 0)


def test_no_pinned_memory_fails_that_request_alone_and_the_engine_goes_on(monkeypatch):
    """Fault injection: pinning the host buffer fails (cudaHostAlloc out of memory). The
    overflow request finishes with an error naming the cause, its pages and tier ops are
    accounted for, and the next requests run."""
    from flash_dllm.cache.io.kv_overflow import OverflowKV

    def no_memory(self, nbytes):
        raise RuntimeError("CUDA error: out of memory")

    model = tiny("llada", seed=6)
    params = _params()
    ref, _ = _run(Engine(model, model.cfg, EngineConfig(page_size=PS)), [SHORT], params)
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS, num_kv_pages=8,
                                                kv_overflow_gb=0.01, prefix_reuse=True,
                                                kv_cpu_gb=0.001))
    _run(eng, [[7] * 15], params)                      # a cached block to demote at admission
    monkeypatch.setattr(OverflowKV, "_pin", no_memory)
    got, reqs = _run(eng, [LONG, SHORT], params)
    out = eng.output(reqs[0])
    assert out.finish_reason == "error" and "could not pin" in out.error
    assert "out of memory" in out.error
    assert got[1] == ref[0]                            # the short request behind it ran
    check_ledger(eng)
    assert eng.kv_manager.num_used == 0 and eng.runner.overflow_state is None
    assert len(eng.runner._free_rows) == eng.config.max_num_seqs
