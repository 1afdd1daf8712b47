"""Multi-turn chat through /v1/chat/completions reuses the history's KV pages (the shipped demo
model, real HTTP app in-process), and the tier metrics say so in Prometheus."""
from __future__ import annotations

import asyncio

import httpx

from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.app import build_app
from test_server import metrics_of


def _app(**cfg):
    aeng, tok, _ = load_async_engine(config=EngineConfig(prefix_reuse=True, **cfg))
    return build_app(aeng, tok, "demo"), aeng


async def _chat(c: httpx.AsyncClient, messages: list[dict]) -> str:
    r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 32,
                                                     "cache": "dual", "decode": "threshold"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_second_turn_reuses_the_history_and_metrics_show_it():
    app, aeng = _app(kv_cpu_gb=0.01)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=120) as c:
            history = [{"role": "user", "content": "A jar has 2 cookies. Amy adds 22 more, then "
                                                   "takes out 5. How many are in the jar?"}]
            answer = await _chat(c, history)
            history += [{"role": "assistant", "content": answer},
                        {"role": "user", "content": "Ivy has 23 pens. Vic has 12 fewer. How "
                                                    "many do they have in all?"}]
            await _chat(c, history)
            return metrics_of((await c.get("/metrics")).text)
    m = asyncio.run(go())
    assert m['flash_dllm_prefix_cache_query_tokens_total'] > 0
    assert m['flash_dllm_prefix_cache_hit_tokens_total{tier="l0"}'] >= 16
    assert 0 < m["flash_dllm_prefix_cache_hit_rate"] <= 1
    assert m['flash_dllm_kv_pages_cached{tier="l0"}'] > 0
    assert m["flash_dllm_kv_pages_used"] == 0            # cached pages are not "used"
    for name in ("flash_dllm_kv_checksum_failures_total", "flash_dllm_l0_eviction_rate",
                 "flash_dllm_kv_tier_slower_than_recompute_total", "flash_dllm_l0_evictions_total",
                 'flash_dllm_kv_cached_bytes{tier="l1"}', "flash_dllm_kv_load_seconds_count",
                 "flash_dllm_kv_store_seconds_count", "flash_dllm_kv_prefetch_on_time_rate",
                 'flash_dllm_kv_prefetch_pages_total{outcome="issued"}'):
        assert name in m, name
    aeng.engine.stats  # noqa: B018 - the engine is alive
