"""The engine contract (issue 38): ``Engine``, the tensor-parallel engine and the disaggregated
router implement ``EngineCore``; ``AsyncEngine`` uses nothing else of its engine; the stats
snapshot is immutable and ``/metrics`` renders it without touching a live engine; the
disaggregated router fakes no engine part (no pool, KV manager or scheduler views): its snapshot
comes from its workers' reports."""
from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch
from test_sampler import PROMPTS, tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.stats import EngineStats
from flash_dllm.disagg import messages as W
from flash_dllm.disagg.router import DECODE, PREFILL, PDEngine, WorkerHandle
from flash_dllm.engine import async_engine
from flash_dllm.engine.async_engine import AsyncEngine
from flash_dllm.engine.core import EngineCore
from flash_dllm.engine.engine import Engine
from flash_dllm.engine.tp_engine import TPEngine
from flash_dllm.server.metrics import ServerMetrics
from conftest import EXACT

CONTRACT = {name for name, _ in inspect.getmembers(EngineCore) if not name.startswith("_")} \
    | set(EngineCore.__annotations__)


def _engine(**config) -> Engine:
    model = tiny("llada", seed=2)
    return Engine(model, model.cfg, EngineConfig(**{"num_kv_pages": 64, **config}))


def _router(engine: Engine, reports: bool = True) -> PDEngine:
    """A router over two workers that said hello (no processes: nothing is sent to them)."""
    ws = [WorkerHandle(r, role, proc=None, ready=True, num_pages=4 + 2 * r, page_size=16,
                       max_num_seqs=4) for r, role in enumerate((PREFILL, DECODE))]
    if reports:
        ws[0].stats = W.Stats(0, 1, 2, 3, 4, 1, 1, 0, 7, 0.5, 3)
        ws[1].stats = W.Stats(1, 3, 0, 5, 6, 2, 0, 1, 30, 1.5, 0)
    return PDEngine(engine.cfg, engine.config, ws, listener=None, timeout_s=1.0)


def test_every_engine_kind_implements_the_contract():
    eng = _engine()
    assert isinstance(eng, EngineCore) and isinstance(_router(eng), EngineCore)
    assert issubclass(TPEngine, Engine)
    assert {"validate", "add_request", "abort", "step", "has_unfinished", "output", "counts",
            "stats_snapshot", "close", "cfg", "config", "idle_poll_s", "steps_run"} == CONTRACT


def test_the_async_engine_uses_only_the_contract():
    """Every ``self.engine.<name>`` of ``engine/async_engine.py`` is a member of ``EngineCore``
    (the warm-up callable gets the engine itself: it is the entrypoint's, engine-specific)."""
    tree = ast.parse(Path(async_engine.__file__).read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == "engine" and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"}
    assert used and used <= CONTRACT, used - CONTRACT


def test_the_router_fakes_no_engine_part_and_validates_against_its_smallest_worker():
    eng = _engine()
    pd = _router(eng)
    for name in ("pool", "kv_manager", "scheduler", "runner"):
        assert not hasattr(pd, name), name
    params = SamplingParams(max_tokens=16, block_length=8, **EXACT)
    pd.validate(PROMPTS[0], params)
    with pytest.raises(ValueError, match="needs 5 KV pages of 16 tokens, but the pool has only "
                                         "4; requests larger than the pool are not supported"):
        pd.validate([5] * 60, params)
    with pytest.raises(ValueError, match="vocabulary"):
        pd.validate([10**6], params)
    pd.workers[0].alive = False           # (what ``_lost`` does, less the messages)
    pd.limits = pd._limits()
    pd.validate([5] * 60, params)                 # the smallest live pool holds 6 pages now


def test_the_router_snapshot_comes_from_its_workers_reports():
    pd = _router(_engine())
    snap = pd.stats_snapshot()
    assert (snap.running, snap.waiting) == pd.counts() == (0, 2 + 0 + 0 + 1)
    assert (snap.pages_used, snap.pages_total, snap.page_size) == (8, 10, 16)
    assert snap.tiers is None and snap.overflow is None
    w0, w1 = snap.disagg.workers
    assert (w0.rank, w0.role, w0.alive, w0.reported, w0.pages_used, w0.staging_used,
            w0.sends, w0.steps) == (0, PREFILL, True, True, 3, 1, 1, 7)
    assert (w1.rank, w1.role, w1.recvs, w1.steps) == (1, DECODE, 1, 30)
    text = ServerMetrics(AsyncEngine(pd)).render().decode()
    for line in ("flash_dllm_kv_pages_used 8.0", "flash_dllm_kv_pages_total 10.0",
                 'flash_dllm_pd_worker_kv_pages_used{role="decode",worker="1"} 5.0',
                 'flash_dllm_pd_worker_forwards{role="prefill",worker="0"} 7.0',
                 "flash_dllm_pd_transfers_total 0.0", "flash_dllm_failed_steps_total 0.0"):
        assert line in text, line
    assert "flash_dllm_kv_pages_cached" not in text        # no KV manager here: no tier metrics
    none = _router(_engine(), reports=False).stats_snapshot()     # before the first report
    assert none.pages_used == 0 and not any(w.reported for w in none.disagg.workers)


def test_a_snapshot_is_immutable_and_never_changes_after_it_was_built():
    eng = _engine()
    before = eng.stats_snapshot()
    eng.add_request(PROMPTS[1], SamplingParams(max_tokens=16, block_length=8, **EXACT))
    with torch.inference_mode():
        eng.step()
    during = eng.stats_snapshot()
    assert (before.forwards, before.pages_used, before.running) == (0, 0, 0)
    assert during.forwards == 1 and during.pages_used > 0 and during.running == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        during.forwards = 2
    with pytest.raises(TypeError):
        during.counters["sentinel_checks"]["entropy"] = 1          # read-only, nested too
    with pytest.raises(TypeError):
        during.tiers.prefetch["issued"] = 1
    eng.stats["sentinel_checks"]["entropy"] += 5                   # the engine counts on
    assert during.counters["sentinel_checks"]["entropy"] == 0


class _Untouchable:
    """An engine whose state may not be read: only its immutable configuration."""

    def __init__(self, engine) -> None:
        self.cfg, self.config = engine.cfg, engine.config

    def __getattr__(self, name):
        raise AssertionError(f"the HTTP thread read the engine's {name!r}")


def test_metrics_render_only_the_published_snapshot():
    eng = _engine(prefix_reuse=True)
    aeng = AsyncEngine(eng)
    metrics = ServerMetrics(aeng)

    async def go():
        return [o async for o in aeng.generate(PROMPTS[0], SamplingParams(max_tokens=16,
                                                                          block_length=8, **EXACT))]
    outs = asyncio.run(go())
    assert outs[-1].finished
    live = aeng.engine
    aeng.engine = _Untouchable(live)          # a scrape may not touch the engine any more
    try:
        text = metrics.render().decode()
    finally:
        aeng.engine = live
    assert isinstance(aeng.stats, EngineStats) and aeng.stats.forwards == eng.stats["forwards"]
    assert f"flash_dllm_kv_pages_total {float(eng.kv_manager.num_pages)}" in text
    assert "flash_dllm_kv_pages_used 0.0" in text                 # final: the engine went idle
    assert 'flash_dllm_kv_pages_cached{tier="l0"}' in text
    assert not hasattr(__import__("flash_dllm.server.metrics", fromlist=["_read"]), "_read")
