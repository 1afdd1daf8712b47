"""A step that raises fails only its own requests when the engine isolates step failures (the
server's single-process engine): they finish with an error that names the exception, their pages
are freed and never published for prefix reuse, and every other request finishes with the tokens
of a run without the fault. Without isolation (offline, tensor-parallel replicas), or at the third
failed step in a row (a broken device), the exception is raised as before. Faults are injected by
wrapping the real runner's ``execute``."""
from __future__ import annotations

import asyncio

import pytest
from test_sampler import tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.async_engine import AsyncEngine, EngineUnavailableError
from flash_dllm.engine.engine import MAX_FAILED_STEPS, Engine

# no two share a first token, so no request reuses another's prefix; longer than a page
PROMPTS = [[(k * i + 11 * k) % 90 + 5 for i in range(40)] for k in (1, 2, 3)]
PARAMS = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.5,
                        cache="dual")


def _faulty(engine: Engine, bad: set[str], times: int = 1):
    """Make ``execute`` raise (``times`` times) for a plan that holds a request of ``bad``."""
    real = engine.runner.execute
    left = [times]

    def execute(plan):
        if left[0] and any(r.request_id in bad for r in plan.requests):
            left[0] -= 1
            raise RuntimeError("injected fault")
        return real(plan)
    engine.runner.execute = execute


def _engine(isolate: bool, **config) -> Engine:
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(**{"max_num_seqs": 1, "prefix_reuse": True,
                                                   **config}))
    eng.isolate_step_failures = isolate
    return eng


def _run(eng: Engine, prompts) -> list:
    reqs = [eng.add_request(p, PARAMS) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [eng.output(r) for r in reqs]


def test_a_failed_step_fails_only_its_requests():
    clean = _run(_engine(True), PROMPTS)
    eng = _engine(True)
    free = eng.pool.num_free
    reqs = [eng.add_request(p, PARAMS) for p in PROMPTS]
    _faulty(eng, {reqs[1].request_id})
    while eng.has_unfinished():
        eng.step()
    outs = [eng.output(r) for r in reqs]
    assert outs[1].finish_reason == "error"
    assert "injected fault" in outs[1].error and reqs[1].request_id in outs[1].error
    for i in (0, 2):                       # before and after the failed one: as without it
        assert outs[i].finish_reason == clean[i].finish_reason
        assert outs[i].token_ids == clean[i].token_ids
    assert eng.stats["failed_steps"] == 1
    # every page is back but the published prefix copies of the two that finished ...
    assert eng.pool.num_free + eng.kv_manager.cached_pages()[0] == free
    assert eng.kv_manager.cached_pages()[0] == 2 * 3           # (40 + 8 tokens: 3 pages each)
    # ... and the failed request published nothing: a new request with its prompt reuses none
    # (where one that finished is reused)
    again = [eng.add_request(PROMPTS[i], PARAMS) for i in (1, 0)]
    while eng.has_unfinished():
        eng.step()
    assert again[0].reused_len == 0 and again[1].reused_len > 0
    assert eng.output(again[0]).token_ids == clean[1].token_ids


def test_without_isolation_a_step_failure_is_raised():
    eng = _engine(False)
    req = eng.add_request(PROMPTS[0], PARAMS)
    _faulty(eng, {req.request_id})
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.step()


def test_failures_in_a_row_are_raised_at_the_limit():
    eng = _engine(True)
    reqs = [eng.add_request(p, PARAMS) for p in PROMPTS[:MAX_FAILED_STEPS]]
    _faulty(eng, {r.request_id for r in reqs}, times=MAX_FAILED_STEPS)
    for _ in range(MAX_FAILED_STEPS - 1):
        outs = eng.step()
        assert [o.finish_reason for o in outs] == ["error"]
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.step()


def test_the_server_engine_keeps_serving_after_a_failed_step():
    eng = _engine(True)
    aeng = AsyncEngine(eng)
    state = {"armed": True}
    real = eng.runner.execute

    def execute(plan):
        if state["armed"]:
            state["armed"] = False
            raise RuntimeError("injected fault")
        return real(plan)
    eng.runner.execute = execute

    async def collect(prompt):
        outs = []
        try:
            async for out in aeng.submit(prompt, PARAMS):
                outs.append(out)
        except EngineUnavailableError as e:
            return outs, e
        return outs, None

    async def main():
        first = await asyncio.wait_for(collect(PROMPTS[0]), 30)
        second = await asyncio.wait_for(collect(PROMPTS[2]), 30)
        await aeng.shutdown(timeout=10)
        return first, second

    aeng.start()
    (outs1, err1), (outs2, err2) = asyncio.run(main())
    assert err1 is not None and "injected fault" in str(err1)
    assert err2 is None and outs2[-1].finished and outs2[-1].finish_reason in ("stop", "length")
    assert aeng.error is None
    # the failed step is counted, and exported from the published stats snapshot
    from flash_dllm.server.metrics import ServerMetrics
    assert aeng.stats.failed_steps == eng.stats["failed_steps"] == 1
    assert "flash_dllm_failed_steps_total 1.0" in ServerMetrics(aeng).render().decode()


def test_a_tensor_parallel_rank_never_isolates():
    """Rank 0 raises whatever its flag says (the other ranks would not know the batch was
    dropped); the followers are plain engines, which raise by default."""
    from flash_dllm.engine.tp_engine import TPEngine
    eng = _engine(True)
    req = eng.add_request(PROMPTS[0], PARAMS)
    _faulty(eng, {req.request_id})
    eng.__class__ = TPEngine     # (its _step_failed needs no process group; step is Engine's)
    with pytest.raises(RuntimeError, match="injected fault"):
        Engine.step(eng)
    assert Engine(eng.model, eng.cfg).isolate_step_failures is False


def _mid_forward_fault(eng: Engine, at: int) -> None:
    """The ``at``-th forward raises, inside the step (after the runner built its state)."""
    real, n = eng.runner.forward, [0]

    def forward(*a, **k):
        n[0] += 1
        if n[0] == at:
            raise RuntimeError("injected mid-forward")
        return real(*a, **k)
    eng.runner.forward = forward


def test_a_fault_inside_the_forward_fails_its_batch_and_spares_the_rest():
    """Batches of two with a third request waiting: the requests of the failed step (which
    have device state by then) fail; the waiting one finishes as without the fault; every
    arena row and page comes back."""
    prompts = PROMPTS + [[(7 * i + 3) % 90 + 5 for i in range(40)]]

    def run(fault):
        eng = _engine(True, max_num_seqs=2)
        if fault:
            _mid_forward_fault(eng, 3)
        reqs = [eng.add_request(p, PARAMS) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        return eng, reqs
    _, clean = run(False)
    eng, reqs = run(True)
    failed = [r for r in reqs if r.finish_reason == "error"]
    assert len(failed) == 2 and all(r.num_forwards >= 2 for r in failed)
    for r, c in zip(reqs, clean):
        if r.finish_reason != "error":
            assert r.tokens.tolist() == c.tokens.tolist()
    assert sorted(eng.runner._free_rows) == [0, 1] and not eng.runner._states


def test_a_fault_while_creating_device_state_returns_the_arena_row(monkeypatch):
    import flash_dllm.worker.runner as runner_mod
    eng = _engine(True)
    real, left = runner_mod.h2d, [1]

    def h2d(*a, **k):
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected h2d fault")
        return real(*a, **k)
    monkeypatch.setattr(runner_mod, "h2d", h2d)
    bad = eng.add_request(PROMPTS[0], PARAMS)
    good = eng.add_request(PROMPTS[1], PARAMS)
    while eng.has_unfinished():
        eng.step()
    assert bad.finish_reason == "error" and good.finish_reason in ("stop", "length")
    assert eng.runner._free_rows == [0] and not eng.runner._states


def test_never_isolated_with_host_kv_tiers():
    """(a step may have collected finished tier moves that its failure would drop)"""
    eng = _engine(True, kv_cpu_gb=0.01)
    assert eng.runner.offload is not None
    req = eng.add_request(PROMPTS[0], PARAMS)
    _faulty(eng, {req.request_id})
    with pytest.raises(RuntimeError, match="injected fault"):
        eng.step()


def test_a_failure_while_warming_up_is_raised():
    from flash_dllm.worker.warmup import warm_up
    eng = _engine(True)
    _mid_forward_fault(eng, 1)
    with pytest.raises(RuntimeError, match="injected mid-forward"):
        warm_up(eng, "minimal", [5, 6, 7])
    assert eng.isolate_step_failures is True           # put back afterwards


def test_failures_apart_do_not_add_up():
    """The limit counts failed steps in a row: a step that runs resets it."""
    eng = _engine(True)
    reqs = [eng.add_request(p, PARAMS) for p in PROMPTS]
    fail = {reqs[0].request_id, reqs[2].request_id}
    real = eng.runner.execute

    def execute(plan):
        if any(r.request_id in fail for r in plan.requests):
            fail.difference_update(r.request_id for r in plan.requests)
            raise RuntimeError("injected fault")
        return real(plan)
    eng.runner.execute = execute
    while eng.has_unfinished():
        eng.step()
    assert [r.finish_reason for r in reqs][::2] == ["error", "error"]
    assert reqs[1].finish_reason in ("stop", "length")
