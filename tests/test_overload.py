"""Overload (issue 44, item 4): a request that would wait longer than ``--max-queue-wait`` seconds
for admission gets 429 with Retry-After instead of queueing; the estimate is the requests ahead
over the finish rate while requests waited (``engine/admission.py``)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import EXACT, write_tiny_checkpoint

from flash_dllm.config import EngineConfig
from flash_dllm.engine.admission import QueueWait
from flash_dllm.engine.streams import QueueFullError
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.app import build_app


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_estimate_is_the_backlog_over_the_saturated_finish_rate():
    clock = Clock()
    q = QueueWait(clock)
    assert q.estimate(0, free_slot=True) == 0.0           # a slot is free: no wait
    assert q.estimate(3, free_slot=False) is None          # no rate yet: admitted
    for _ in range(5):                                     # 4 finishes a second, queue behind
        q.finished(backlog=True)
        clock.t += 0.25
    assert q.estimate(3, free_slot=False) == pytest.approx(1.0)   # (3 + 1) / 4 per s
    q.check(1.5, 3, False)                                 # within the bound
    with pytest.raises(QueueFullError, match="over --max-queue-wait 0.5 s") as e:
        q.check(0.5, 7, False)                             # 2 s > 0.5 s
    assert e.value.retry_after == 2                        # ceil(2 - 0.5)
    q.check(0, 10_000, False)                              # 0: no time bound
    # a finish with nobody waiting ends the backlog: an idle hour never becomes a slow rate
    q.finished(backlog=False)
    clock.t += 3600
    q.finished(backlog=True)
    assert q.estimate(5, free_slot=False) is None


def test_a_request_that_would_wait_too_long_gets_429_with_retry_after(tmp_path):
    """One running slot, a backlog of exact (slow) requests: once two of them finished with
    others still waiting, a new request's estimated wait exceeds a tiny bound: 429 naming
    --max-queue-wait, with Retry-After; every request admitted before is answered."""
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", "llada")
    cfg = EngineConfig(num_kv_pages=64, max_num_seqs=1, max_queue_wait=0.001)
    aeng, tok, _ = load_async_engine(ckpt, config=cfg)
    app = build_app(aeng, tok, "tiny")
    body = {"prompt": "hello there", "max_tokens": 32, "block_length": 32, **EXACT}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=120) as c:
            first = [asyncio.create_task(c.post("/v1/completions", json=body))
                     for _ in range(5)]
            while not (len(aeng.queue_wait.finishes) >= 2 and aeng.num_waiting >= 1):
                assert not all(t.done() for t in first), "the backlog drained first"
                await asyncio.sleep(0.005)
            late = await c.post("/v1/completions", json=body)
            return await asyncio.gather(*first), late
    first, late = asyncio.run(go())
    assert [r.status_code for r in first] == [200] * 5
    assert late.status_code == 429, late.text
    err = late.json()["error"]
    assert err["code"] == "queue_full" and "--max-queue-wait 0.001 s" in err["message"]
    assert int(late.headers["Retry-After"]) >= 1


def test_the_default_bound_and_its_flag(capsys):
    from flash_dllm.entrypoints import cli
    assert EngineConfig().max_queue_wait == 60.0
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-queue-wait" in out and "proxy read timeout" in out
