"""Placement by attention (issue 14): the ema / kag policies order eviction by the attention
their pages received, the KV manager hands them a request's per-page mass once per block, and
the engine feeds it from cache="flash" steps (and nothing else changes)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import write_tiny_checkpoint
from flash_dllm.cache.kv_manager import KVCacheManager
from flash_dllm.cache.tiers import Block, EMAPolicy, KAGPolicy, LRUPolicy, make_policy
from flash_dllm.config import EngineConfig, SamplingParams

PS = 4


def blocks(n):
    return [Block(bytes([i]) * 16, last_access=float(i)) for i in range(n)]


def test_policies_order_by_evidence():
    bs = blocks(4)
    assert LRUPolicy().order(bs[::-1]) == bs                  # oldest first
    ema = make_policy("ema")
    ema.observe([bs[0], bs[1], bs[2]], [5.0, 1.0, 3.0])
    # no evidence (bs[3]) goes first, then least attended
    assert ema.order(bs) == [bs[3], bs[1], bs[2], bs[0]]
    kag = make_policy("kag")
    for _ in range(5):                                          # 0-1-2 attended together
        kag.observe([bs[0], bs[1], bs[2]], [1.0, 1.0, 1.0])
    kag.observe([bs[3]], [2.5])                                 # 3 alone, once
    order = kag.order(bs)
    assert order[0] == bs[3]                                    # least central goes first
    ema.forget(bs[0])
    assert ema.order([bs[0], bs[1]]) == [bs[0], bs[1]]          # forgotten: no evidence
    # a forgotten block's node is reused, never shared with a live block
    more = [Block(bytes([100 + i]) * 16) for i in range(3)]
    ema.observe(more, [1.0, 1.0, 1.0])
    ids = [ema._id(b) for b in bs[1:3] + more]
    assert len(set(ids)) == len(ids) and 0 in ids
    assert float(ema.graph.mass[ema._id(bs[2])]) == pytest.approx(3.0 * 0.9)   # one decay
    with pytest.raises(ValueError, match="kv_placement must be one of"):
        make_policy("fifo")


def _publish(mgr, rid, tokens):
    assert mgr.allocate(rid, len(tokens) + PS, tokens) is not None
    return rid


def test_kv_manager_hands_mass_to_the_policy():
    mgr = KVCacheManager(64, PS, prefix_reuse=True, placement="ema")
    assert mgr.wants_mass
    prompt = list(range(1, 17))                                  # 4 pages
    _publish(mgr, "a", prompt)
    mgr.observe("a", [1.0, 2.0, 3.0, 4.0, 0.0])                  # block 1
    mgr.observe("a", [1.0, 0.0, 0.0, 0.0, 0.0])                  # block 2
    mgr.free("a", publish=prompt)                                 # 4 blocks cached
    ema = mgr.policy
    cached = sorted(mgr.tiers.blocks, key=lambda b: ema._ids[b.key])
    assert [round(float(ema.graph.mass[ema._ids[b.key]]), 3) for b in cached] == \
        [2.0, 2.0, 3.0, 4.0]
    # a request reusing the prefix: its reused pages' mass goes to their blocks at once
    alloc = mgr.allocate("b", 16 + 8, prompt + [99, 98, 97, 96])
    assert alloc is not None and alloc.reused_len == 16           # the 4 cached pages
    before = float(ema.graph.mass[ema._ids[cached[0].key]])
    mgr.observe("b", [10.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert float(ema.graph.mass[ema._ids[cached[0].key]]) == pytest.approx(before * 0.9 + 10)
    mgr.free("b")                                                 # aborted: nothing published
    assert "b" not in mgr._fresh_mass
    lru = KVCacheManager(64, PS, prefix_reuse=True)
    assert not lru.wants_mass
    lru.observe("x", [1.0])                                       # ignored


def test_eviction_follows_attention_not_recency():
    """Two cached prompts; the older one was attended far more. Under pressure LRU evicts
    the older one, ema keeps it."""
    survivors = {}
    for placement in ("lru", "ema"):
        mgr = KVCacheManager(12, PS, prefix_reuse=True, placement=placement)
        hot, cold = list(range(1, 17)), list(range(101, 117))
        _publish(mgr, "hot", hot)
        mgr.observe("hot", [9.0, 9.0, 9.0, 9.0, 0.0])
        mgr.free("hot", publish=hot)
        _publish(mgr, "cold", cold)
        mgr.observe("cold", [0.1, 0.1, 0.1, 0.1, 0.0])
        mgr.free("cold", publish=cold)
        assert mgr.allocate("new", 7 * PS, list(range(201, 225))) is not None   # evicts 4
        survivors[placement] = len(mgr._match(mgr.tree("dual"), hot + [0]))
    assert survivors == {"lru": 0, "ema": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("place") / "tiny", "llada")


@pytest.mark.parametrize("placement", ["ema", "kag"])
def test_engine_feeds_flash_mass_and_answers_the_same(ckpt, placement):
    from flash_dllm.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.5,
                            cache="flash")
    prompts = ["Ivy has 23 pens and Vic has 12. " * 3, "Ivy has 23 pens and Vic has 12. " * 3
               + "How many?"]
    outs = {}
    for pl in ("lru", placement):
        llm = LLM(ckpt, engine_config=EngineConfig(num_kv_pages=512, prefix_reuse=True,
                                                   kv_placement=pl))
        outs[pl] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        outs[pl] += [o.token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)]
        eng = llm.engine
        if pl != "lru":
            pol = eng.kv_manager.policy
            assert eng.runner.collect_page_mass
            assert pol.graph.stats["updates"] > 0
            assert float(pol.graph.mass.sum()) > 0
            assert not eng.block_mass.pending and not eng.kv_manager._fresh_mass
        else:
            assert not eng.runner.collect_page_mass
    assert outs["lru"] == outs[placement]


def test_kag_metrics_exported(ckpt):
    import asyncio

    import httpx

    from flash_dllm.bench.serve import parse_metrics
    from flash_dllm.entrypoints.serve import load_async_engine
    from flash_dllm.server.app import build_app

    aeng, tok, _ = load_async_engine(ckpt, config=EngineConfig(
        num_kv_pages=512, prefix_reuse=True, kv_placement="kag"))
    app = build_app(aeng, tok, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            for _ in range(2):
                r = await c.post("/v1/completions", json={
                    "prompt": "Ivy has 23 pens and Vic has 12. " * 3, "max_tokens": 16,
                    "block_length": 8, "cache": "flash", "decode": "threshold",
                    "threshold": 0.5})
                assert r.status_code == 200, r.text
            return parse_metrics((await c.get("/metrics")).text)

    m = asyncio.run(go())
    assert m["flash_dllm_kag_updates_total"] > 0
    assert 0.0 <= m["flash_dllm_kag_stability_ratio"] <= 1.0
    assert m["flash_dllm_kag_update_seconds_total"] > 0
    assert "flash_dllm_sentinel_trigger_rate" in m and "flash_dllm_l0_eviction_rate" in m
    policy = aeng.engine.kv_manager.policy
    assert isinstance(policy, KAGPolicy) and policy.stats["updates"] == \
        m["flash_dllm_kag_updates_total"]


def test_kag_flags(ckpt):
    from flash_dllm.entrypoints.cli import build_parser
    from flash_dllm.entrypoints.llm import LLM

    assert EngineConfig(kag_update="every-3-steps").kag_update_steps == 3
    assert EngineConfig().kag_update_steps is None
    for bad in ("every-0-steps", "sometimes", "every-x-steps"):
        with pytest.raises(ValueError, match="kag_update must be"):
            EngineConfig(kag_update=bad)
    with pytest.raises(ValueError, match="kag_top_k"):
        EngineConfig(kag_top_k=0)
    a = build_parser().parse_args(["serve", "--kv-placement", "kag", "--kag-top-k", "4",
                                   "--kag-update", "every-2-steps"])
    assert (a.kag_top_k, a.kag_update) == (4, "every-2-steps")

    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.99,
                            cache="flash")
    updates = {}
    for every in ("every-block", "every-1-steps"):
        llm = LLM(ckpt, engine_config=EngineConfig(num_kv_pages=512, prefix_reuse=True,
                                                   kv_placement="kag", kag_update=every,
                                                   kag_top_k=4))
        for _ in range(2):                        # the second run reuses the first's pages
            llm.generate(["Ivy has 23 pens and Vic has 12. " * 3], params)
        pol = llm.engine.kv_manager.policy
        assert pol.graph.top_k == 4
        updates[every] = pol.stats["updates"]
    assert updates["every-1-steps"] > updates["every-block"] > 0
