"""Warm-up before ready (issue 21): the warm-up runs the engine's real steps and leaves no trace;
the server answers 503 (``/ready``: warming_up) until it is done; the start-up metrics; and the
Triton compile counter's hooks."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest
from conftest import EXACT, write_tiny_checkpoint

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.serve import attach_warmup, load_async_engine
from flash_dllm.server.app import build_app
from flash_dllm.worker.compile_watch import KernelCompiles, graph_counts, runtime_counts
from flash_dllm.worker.warmup import WARMUP_LEVELS, batch_sizes, cases, default_level, warm_up


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("warm") / "tiny", "llada")


def engine_of(ckpt, **kw):
    conf = EngineConfig(num_kv_pages=512, max_num_seqs=4, prefix_reuse=True, **kw)
    aeng, tok, _ = load_async_engine(ckpt, config=conf)
    return aeng, tok


def test_levels_and_sizes():
    assert WARMUP_LEVELS == ("full", "minimal", "none")
    assert default_level("cpu") == "none" and default_level("cuda:0") == "full"
    assert batch_sizes("full", 64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes("full", 48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes("minimal", 64) == [1, 64] and batch_sizes("minimal", 1) == [1]
    assert cases("minimal") == [SamplingParams()]
    # the default request (threshold, the family's cache: resolved with a model's config) is
    # threshold + dual on a LLaDA model: one case less
    assert [(p.decode, p.cache) for p in cases("full")] == [("threshold", None),
                                                             ("threshold", "dual"),
                                                             ("verify", "dual")]
    cfg = SimpleNamespace(arch="llada", attention=SimpleNamespace(block_causal=False))
    assert [(p.decode, p.cache) for p in cases("full", cfg)] == [("threshold", "dual"),
                                                                  ("verify", "dual")]
    # a server's own default (serve --decode vanilla --cache none) is warmed first
    exact = SamplingParams(**EXACT)
    assert [(p.decode, p.cache) for p in cases("full", cfg, exact)] == [
        ("vanilla", "none"), ("threshold", "dual"), ("verify", "dual")]
    # a block-causal family: its exact block cache, and no verify (it does not run there)
    l2 = SimpleNamespace(arch="llada2", attention=SimpleNamespace(block_causal=True))
    assert [(p.decode, p.cache) for p in cases("full", l2)] == [("threshold", "block")]
    assert [(p.decode, p.cache) for p in cases("full", l2, exact)] == [
        ("vanilla", "none"), ("threshold", "block")]
    with pytest.raises(ValueError, match="warmup must be one of"):
        warm_up(None, "fast", [1])


def test_warm_up_leaves_no_trace(ckpt):
    """A full warm-up runs every case through the real engine; afterwards the engine is idle,
    holds no pages, has cached nothing, its counters are as before, and it answers exactly as a
    fresh engine does."""
    aeng, tok = engine_of(ckpt)
    eng = aeng.engine
    before = dict(eng.stats)
    lines = []
    rep = warm_up(eng, "full", tok.encode("warm up text"), lines.append,
                  SamplingParams(**EXACT))
    assert rep.cases == 3 * 3 * len(batch_sizes("full", 4)) and not rep.skipped
    assert rep.steps > rep.cases and len(lines) == rep.cases
    assert "warm-up 1/" in lines[0] and "vanilla/none prompt 24 batch 1" in lines[0]
    assert not eng.has_unfinished() and eng.kv_manager.num_used == 0
    assert eng.kv_manager.prefix_reuse and eng.kv_manager.stats["query_tokens"] == 0
    assert eng.stats == before

    fresh, _ = engine_of(ckpt)
    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.5,
                            cache="dual")
    prompt = tok.encode("Ivy has 3 pens.")
    assert _answer(eng, prompt, params) == _answer(fresh.engine, prompt, params)


def _answer(engine, prompt, params):
    req = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return engine.output(req).token_ids


def test_warm_up_skips_a_case_that_cannot_fit(ckpt):
    aeng, tok = engine_of(ckpt)
    eng = aeng.engine
    eng.cfg = eng.cfg.__class__(**{**eng.cfg.__dict__, "max_position": 100})
    rep = warm_up(eng, "full", tok.encode("abc"))           # 100 - 64: prompts of 24, 25 and 36
    # the default request is threshold + dual here, the full level's second case: 2 cases
    assert not rep.skipped and rep.cases == 2 * 3 * len(batch_sizes("full", 4))
    eng.cfg = eng.cfg.__class__(**{**eng.cfg.__dict__, "max_position": 60})
    rep = warm_up(eng, "minimal", tok.encode("abc"))        # 64 tokens cannot fit in 60
    assert rep.cases == 0 and len(rep.skipped) == 2 and "leaves no room" in rep.skipped[0]


def test_server_is_not_ready_while_warming(ckpt):
    """/ready answers 503 warming_up and requests 503 with a message until the warm-up ends;
    then 200, and the start-up metrics are exported."""
    aeng, tok = engine_of(ckpt)
    gate = threading.Event()

    def slow_warmup(engine):
        gate.wait(30)                                   # fault injection: a long warm-up
        return warm_up(engine, "minimal", tok.encode("abc"))

    aeng.set_warmup(slow_warmup)
    app = build_app(aeng, tok, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            ready0 = await c.get("/ready")
            busy = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
            health = await c.get("/health")
            gate.set()
            for _ in range(600):
                r = await c.get("/ready")
                if r.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8})
            metrics = (await c.get("/metrics")).text
            return ready0, busy, health, r, ok, metrics

    ready0, busy, health, ready1, ok, metrics = asyncio.run(go())
    assert ready0.status_code == 503 and ready0.json() == {"status": "warming_up"}
    assert ready0.headers["Retry-After"]
    assert busy.status_code == 503 and "warming up" in busy.json()["error"]["message"]
    assert health.status_code == 200
    assert ready1.status_code == 200 and ok.status_code == 200
    assert aeng.warmup_report.cases == 2 * 2 and aeng.ready_at is not None
    for name in ("kernel_compiles_total", "graph_captures_total", "graph_replays_total",
                 "eager_forwards_total", "kernel_compiles_after_ready_total",
                 "graph_captures_after_ready_total", "time_to_ready_seconds",
                 "warmup_seconds"):
        assert f"flash_dllm_{name}" in metrics, name
    assert "flash_dllm_graph_captures_after_ready_total 0.0" in metrics
    assert "flash_dllm_time_to_ready_seconds nan" not in metrics.lower()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_failed_warm_up_is_an_error_not_ready(ckpt):
    aeng, tok = engine_of(ckpt)

    def broken(engine):
        raise RuntimeError("no memory for graphs")

    aeng.set_warmup(broken)
    app = build_app(aeng, tok, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            aeng.start()
            for _ in range(200):
                if not aeng.alive:
                    break
                await asyncio.sleep(0.02)
            return await c.get("/ready"), await c.get("/health")

    ready, health = asyncio.run(go())
    aeng._thread.join(5)                     # its exception is reported inside this test
    assert ready.status_code == 503 and ready.json() == {"status": "error"}
    assert health.status_code == 503 and "no memory for graphs" in health.json()["error"]


def test_attach_warmup_defaults(ckpt):
    aeng, tok = engine_of(ckpt)
    assert attach_warmup(aeng, tok, None) == "none" and aeng.ready     # CPU: start at once
    aeng2, tok = engine_of(ckpt)
    assert attach_warmup(aeng2, tok, "minimal") == "minimal" and not aeng2.ready
    assert aeng2.warming


def test_serve_flag():
    from flash_dllm.entrypoints.cli import build_parser

    a = build_parser().parse_args(["serve", "--warmup", "minimal"])
    assert a.warmup == "minimal"
    assert build_parser().parse_args(["serve"]).warmup is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--warmup", "fast"])


def test_kernel_compile_hooks_chain(monkeypatch):
    """The counter chains onto hooks already set, passes their answers on (a true answer from
    jit_cache_hook skips a compile), and counts what the post-compile hook reports."""
    knobs = pytest.importorskip("triton.knobs")
    calls = []

    def prev_start(**kw):
        calls.append("start")
        return None

    def prev_end(**kw):
        calls.append("end")

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", prev_start)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", prev_end)
    kc = KernelCompiles()
    assert kc.install() and kc.install()                    # idempotent
    fn = type("Info", (), {"name": "my_kernel"})()
    assert knobs.runtime.jit_cache_hook(key=("k", 1), fn=fn) is None
    knobs.runtime.jit_post_compile_hook(key=("k", 1), fn=fn)
    snap = kc.snapshot()
    assert snap["compiles"] == 1 and snap["by_kernel"] == {"my_kernel": 1}
    assert snap["compile_seconds"] >= 0 and calls == ["start", "end"]


def test_runtime_counts_on_cpu(ckpt):
    aeng, _ = engine_of(ckpt)
    counts = runtime_counts(aeng.engine)
    assert counts == {**graph_counts(aeng.engine.runner), "kernel_compiles": counts[
        "kernel_compiles"]}
    assert counts["graph_captures"] == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_bench_server_fails_fast_when_the_warm_up_fails(ckpt):
    """bench serve's in-process server waits for /ready; a failed warm-up ends the wait at
    once with the engine's error, instead of waiting out the timeout."""
    import time

    from flash_dllm.bench.serve import InProcessServer

    aeng, tok = engine_of(ckpt)

    def broken(engine):
        raise RuntimeError("no memory for graphs")

    aeng.set_warmup(broken)
    app = build_app(aeng, tok, "tiny")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="engine failed: .*no memory for graphs"):
        with InProcessServer(app, aeng):
            pass
    assert time.monotonic() - t0 < 60
    if aeng._thread is not None:
        aeng._thread.join(5)
