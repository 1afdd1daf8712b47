"""Metrics that say what happened (issue 44, item 3), with real files and a real server request.

- a replay over a disk tier whose every record was corrupted on disk: one
  ``kv_checksum_failures`` per failed page (not one for the failed read and one more for the
  load that never ran), and no ``prefix_cache_hit_tokens`` for pages that failed their check (a
  failed check is a miss that recomputes); the prompt is looked up once, not once per admission;
- a completion cut at a ``stop`` string counts as ``requests_finished_total{finish_reason="stop"}``,
  not as an abort (the server aborts its engine request to free the pages, but the client asked
  for the stop).
"""
from __future__ import annotations

import time

import pytest

from flash_dllm.config import EngineConfig
from flash_dllm.engine.engine import Engine
from flash_dllm.entrypoints.serve import load_async_engine
from test_sampler import tiny
from test_server import client, metrics_of, run
from test_tiers import OTHERS, PROMPT, PS, _params, _run, check_ledger


# ------------------------------------------------------------------------------- disk tier
def _replay(tmp_path, corrupt: bool):
    """The first turn, unrelated traffic that pushes its pages down to the disk file, then (its
    bytes corrupted on disk when ``corrupt``) the follow-up turn. Returns (engine, follow-up
    request, the tier stats before the follow-up, the snapshot's tier stats after it)."""
    model = tiny("llada", seed=3)
    params = _params()
    path = tmp_path / "kv.bin"
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS, num_kv_pages=24,
                                                kv_cpu_gb=0.00002, kv_disk_path=str(path),
                                                kv_disk_gb=0.01))
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    if corrupt:
        data = bytearray(path.read_bytes())
        for off in range(4096 + 300, len(data), 4096):   # a byte of every slot's payload
            data[off] ^= 0xFF
        path.write_bytes(bytes(data))
    before = eng.stats_snapshot().tiers
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    r2 = _run(eng, [p2], params)[0]
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    return eng, r2, before, eng.stats_snapshot().tiers


def test_a_corrupt_disk_page_is_one_checksum_failure_and_no_hit(tmp_path):
    eng, r2, before, after = _replay(tmp_path, corrupt=True)
    disk = eng.runner.offload.store(2).stats
    failed_pages = disk["checksum_failures"]          # the disk store refused each record once
    assert failed_pages >= 2 and r2.reused_len == 0
    assert after.checksum_failures - before.checksum_failures == failed_pages
    l2 = after.tier_names.index("l2")
    assert after.hit_tokens[l2] == before.hit_tokens[l2]          # failed checks: misses
    assert sum(after.hit_tokens) == sum(before.hit_tokens)
    # the follow-up was admitted twice (the failed load undid the first admission): its prompt
    # was looked up once
    assert after.query_tokens - before.query_tokens == r2.prompt_len
    check_ledger(eng)


def test_a_good_disk_page_is_a_hit_of_its_tier(tmp_path):
    eng, r2, before, after = _replay(tmp_path, corrupt=False)
    assert r2.reused_len > 0
    assert after.checksum_failures == before.checksum_failures == 0
    gained = [a - b for a, b in zip(after.hit_tokens, before.hit_tokens)]
    assert sum(gained) == r2.reused_len and gained[after.tier_names.index("l2")] > 0
    assert after.query_tokens - before.query_tokens == r2.prompt_len
    check_ledger(eng)


# --------------------------------------------------------------------- stop strings: server
QUESTION = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"
FINISHED = 'flash_dllm_requests_finished_total{{finish_reason="{}"}}'


@pytest.fixture(scope="module")
def demo():
    from flash_dllm.server.app import build_app

    aeng, tok, _ = load_async_engine(None, config=EngineConfig(num_kv_pages=256))
    return build_app(aeng, tok, "demo"), aeng


def _finished(app) -> dict[str, float]:
    async def go():
        async with client(app) as c:
            return metrics_of((await c.get("/metrics")).text)
    m = run(go())
    return {r: m.get(FINISHED.format(r), 0.0) for r in ("stop", "length", "abort", "error")}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_finish_counts_as_stop(demo, stream):
    app, aeng = demo
    before = _finished(app)
    body = {"prompt": QUESTION, "max_tokens": 64, "temperature": 0.0, "stop": ".",
            "stream": stream}

    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", json=body)
    r = run(go())
    assert r.status_code == 200, r.text
    if not stream:
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        assert "." not in r.json()["choices"][0]["text"]
    else:
        assert '"finish_reason":"stop"' in r.text.replace(" ", "")
    deadline = time.monotonic() + 20           # the abort is applied before the next step
    while aeng.num_unfinished or aeng.engine.pool.num_used:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    after = _finished(app)
    gained = {k: after[k] - before[k] for k in after}
    assert gained == {"stop": 1, "length": 0, "abort": 0, "error": 0}, gained


def test_a_lost_workers_gauges_hold_nothing():
    """A disaggregated worker killed while it held pages: its process and memory are gone, so
    its resource gauges read 0, not its last report (the soak saw 35 pages stay); up reads 0
    and its forwards keep their count."""
    from flash_dllm.core.stats import DisaggStats, WorkerStats
    from flash_dllm.server.metrics import _disagg

    live = WorkerStats(rank=1, role="decode", alive=True, prefilling=0, decoding=1,
                       reported=True, pages_used=7, staging_used=1, sends=1, recvs=1, steps=9)
    dead = WorkerStats(rank=2, role="decode", alive=False, prefilling=0, decoding=0,
                       reported=True, pages_used=35, staging_used=2, sends=1, recvs=2, steps=40)
    got = {}
    for fam in _disagg(DisaggStats(workers=(live, dead))):
        for sample in fam.samples:
            if sample.labels.get("worker"):
                got[(fam.name, sample.labels["worker"])] = sample.value
    p = "flash_dllm_pd_worker_"
    for name in ("kv_pages_used", "staging_segments", "sends_in_flight", "receives_pending"):
        assert got[(p + name, "2")] == 0, name
        assert got[(p + name, "1")] > 0, name
    assert got[(p + "up", "2")] == 0 and got[(p + "up", "1")] == 1
    assert got[(p + "forwards", "2")] == 40
