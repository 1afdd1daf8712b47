"""Multi-step (``engine/multi_step.py``): one engine step launching several steady fused steps of
one plan before the host applied the ones before them. On the CPU the fused body runs eagerly,
so these tests check the host side (which steps are predicted, the order they are applied in,
merged outputs, admission and abort between calls) against an engine that runs one forward per
call; tests/gpu/test_multi_step_gpu.py checks the queued graph replays."""
from __future__ import annotations

import pytest
import torch
from test_paged_engine import LONG
from test_sampler import PROMPTS, tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import StepOutput
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.engine import multi_step
from flash_dllm.engine.engine import Engine


def _engine(model, n, **kw):
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True, multi_step=n, **kw))
    eng.multi_step_seconds = float("inf")       # (CPU step times would cap the calls)
    return eng


def _drive(eng, prompts, params, on_step=None):
    """Run to the end; each request's streamed tokens (concatenated StepOutputs) and the number
    of forwards each call ran."""
    reqs = [eng.add_request(p, params if isinstance(params, SamplingParams) else params[i])
            for i, p in enumerate(prompts)]
    streamed = {r.request_id: [] for r in reqs}
    per_call = []
    while eng.has_unfinished():
        before = eng.steps_run
        outs = eng.step()
        per_call.append(eng.steps_run - before)
        ids = [o.request_id for o in outs]
        assert len(ids) == len(set(ids)), "one StepOutput per request per call"
        for o in outs:
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
        if on_step is not None:
            on_step(eng, len(per_call))
    return reqs, streamed, per_call


def _same(model, prompts, params, n=4, **kw):
    one = _engine(model, 1, **kw)
    ref, sref, cref = _drive(one, prompts, params)
    eng = _engine(model, n, **kw)
    got, sgot, cgot = _drive(eng, prompts, params)
    for a, b in zip(ref, got):
        assert torch.equal(a.canvas, b.canvas)
        assert a.num_forwards == b.num_forwards and a.block_forwards == b.block_forwards
        assert a.finish_reason == b.finish_reason
        assert sref[a.request_id] == sgot[b.request_id] == one.output(a).token_ids
    assert set(cref) == {1} and sum(cref) == sum(cgot)
    return eng, cgot


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_multi_step_equals_one_step_per_call(family, cache):
    model = tiny(family, seed=1)
    params = SamplingParams(max_tokens=24, block_length=8, cache=cache, decode="vanilla",
                            early_stop=False)
    eng, calls = _same(model, PROMPTS, params)
    # block 8, 8 steps a block: the first step of a block is a refresh (one forward), the other
    # 7 run as calls of 4 and 3
    assert max(calls) == 4 and eng.stats["multi_step_calls"] > 0
    assert calls.count(4) == calls.count(3) == 3


@pytest.mark.parametrize("steps", [24, 6, 12, 9])
def test_uneven_schedules_and_mixed_requests(steps):
    """k > 1 and uneven schedules (the signature changes within a block), requests of different
    canvas lengths and block ends in different steps: a call stops at the first block end."""
    model = tiny("llada", seed=5)
    params = [SamplingParams(max_tokens=m, block_length=8, steps=s, cache="dual", decode="vanilla")
              for m, s in [(24, steps), (16, 6), (24, steps), (8, 8)]]
    _same(model, LONG, params, n=8)


def test_policies_that_cannot_say_their_next_steps_run_one_step_per_call():
    model = tiny("llada", seed=2)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                            threshold=0.3)
    _, calls = _same(model, PROMPTS, params)
    assert set(calls) == {1}
    assert DECODE_POLICIES["threshold"].fused_ahead(object(), 4) == []


def test_vanilla_fused_ahead_follows_the_schedule():
    class R:
        params = SamplingParams(max_tokens=16, block_length=8, steps=6, decode="vanilla")
        num_masked, step_in_block = 8, 0
    v = DECODE_POLICIES["vanilla"]
    # block 8 over 3 steps: k = 3, 3, 2; after step 0: 5 masked (k 3), after step 1: 2 (k 2)
    assert v.fused_ahead(R, 8) == [(3, 5), (2, 2)]
    assert v.fused_ahead(R, 1) == [(3, 5)]
    R.num_masked, R.step_in_block = 2, 2            # the last step ends the block
    assert v.fused_ahead(R, 8) == []
    R.num_masked, R.step_in_block = 6, 0            # a first block that starts with prompt
    assert v.fused_ahead(R, 8) == [(3, 3)]


def test_an_admission_due_ends_multi_step_and_a_full_batch_does_not():
    model = tiny("llada", seed=3)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="vanilla")
    eng = _engine(model, 4, max_num_seqs=1)
    seen = []

    def add_late(e, call):
        if call == 3:     # one waits, no slot free: the running request still multi-steps
            seen.append(e.add_request(PROMPTS[1], params))
    reqs, streamed, calls = _drive(eng, PROMPTS[:1], params, on_step=add_late)
    assert max(calls) > 1 and all(r.finished for r in reqs + seen)
    ref, _, _ = _drive(_engine(model, 1), PROMPTS[:2], params)
    assert [r.canvas.tolist() for r in reqs + seen] == [r.canvas.tolist() for r in ref]

    eng = _engine(model, 4, max_num_seqs=4)
    eng.add_request(PROMPTS[0], params)
    eng.step()                                        # the block's first step
    eng.add_request(PROMPTS[1], params)               # a free slot: it is admitted next call
    before = eng.steps_run
    eng.step()
    assert eng.steps_run - before == 1 and len(eng.running) == 2


def test_abort_between_calls_and_stats():
    model = tiny("dream", seed=4)
    params = SamplingParams(max_tokens=24, block_length=8, cache="dual", decode="vanilla")
    eng = _engine(model, 4)
    reqs = [eng.add_request(p, params) for p in PROMPTS[:3]]
    eng.step()
    eng.step()                                      # a multi-step call
    assert eng.stats["multi_step_calls"] == 1 and eng.stats["forwards"] == 5
    eng.abort(reqs[1].request_id)
    while eng.has_unfinished():
        eng.step()
    ref_eng = _engine(model, 1)
    ref = [ref_eng.add_request(p, params) for p in (PROMPTS[0], PROMPTS[2])]
    while ref_eng.has_unfinished():
        ref_eng.step()
    assert [r.canvas.tolist() for r in (reqs[0], reqs[2])] == [r.canvas.tolist() for r in ref]
    assert reqs[1].finish_reason == "abort" and eng.pool.num_free == eng.pool.num_pages


def test_a_wrong_prediction_is_an_error_not_a_wrong_answer(monkeypatch):
    """A policy whose fused_ahead claims a step past its block's end: the engine refuses to
    apply it (raised: offline engines raise a step's exception)."""
    model = tiny("llada", seed=6)
    v = DECODE_POLICIES["vanilla"]
    monkeypatch.setattr(type(v), "fused_ahead", lambda self, req, limit: [(1, 1)] * limit)
    eng = _engine(model, 4)
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=8, block_length=8, steps=4,
                                               cache="dual", decode="vanilla"))
    with pytest.raises(RuntimeError, match="fused_ahead was wrong"):
        while eng.has_unfinished():
            eng.step()


def test_defaults_and_merge():
    model = tiny("llada")
    assert Engine(model, model.cfg).multi_step == 1                 # no CUDA graphs: off
    assert Engine(model, model.cfg, EngineConfig(multi_step=3)).multi_step == 3
    with pytest.raises(ValueError, match="multi_step"):
        EngineConfig(multi_step=0)
    a = [StepOutput("a", [1], 1, 2, False, None), StepOutput("b", [], 0, 1, False, None)]
    b = [StepOutput("a", [2, 3], 3, 1, True, "stop")]
    assert multi_step.merge([a, b]) == [StepOutput("a", [1, 2, 3], 3, 3, True, "stop"), a[1]]
    assert multi_step.merge([a]) is a


def test_sdar_block_cache(tmp_path):
    """SDAR on its exact block cache (block 4, one token a step): each block's three steady
    steps run as one call and answer as one step per call does."""
    from family_checkpoints import tiny_sdar_config, write_family_checkpoint

    from flash_dllm import LLM
    folder = write_family_checkpoint(tmp_path / "sdar", tiny_sdar_config(), seed=12)
    params = SamplingParams(max_tokens=16, block_length=4, decode="vanilla", cache="block",
                            steps=16, early_stop=False)
    # prompts of one length mod 4: the requests' blocks end at the same steps (a request at its
    # block's first step sends the whole batch to the general path)
    prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 23)), [40, 41, 42]]
    out = []
    for n in (1, 4):
        llm = LLM(str(folder), dtype="float32",
                  engine_config=EngineConfig(fused_step=True, multi_step=n))
        llm.engine.multi_step_seconds = float("inf")
        out.append(_drive(llm.engine, prompts, params))
    (ref, sref, cref), (got, sgot, cgot) = out
    assert [r.canvas.tolist() for r in ref] == [r.canvas.tolist() for r in got]
    assert list(sref.values()) == list(sgot.values())
    assert max(cgot) == 3 and sum(cref) == sum(cgot)


def test_a_shape_is_sighted_once_per_forward(monkeypatch):
    """The capture policy counts each step once: a multi-step call whose first step has no
    graph yet leaves the count to the step path it falls back to (CUDA graphs pretended on for
    the fused step's decision; nothing is captured on the CPU)."""
    from flash_dllm.worker import fused_step, graphs
    decide = fused_step.FusedSteps._decide
    monkeypatch.setattr(fused_step.FusedSteps, "_decide",
                        lambda self, key, T, g, max_q=0, count=True:
                        decide(self, key, T, True, max_q, count))

    def sighted(self, key, large=False, tokens=0):
        self.seen[key] = self.seen.get(key, 0) + 1
        return False
    monkeypatch.setattr(graphs.GraphCache, "sighted", sighted)
    model = tiny("llada", seed=1)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="vanilla",
                            early_stop=False)
    counts = []
    for n in (1, 4):
        eng = _engine(model, n)
        _drive(eng, PROMPTS, params)
        counts.append(sum(eng.runner.fused.cache.seen.values()))
    assert counts[0] == counts[1] > 0


def test_a_call_that_fails_after_a_request_finished_keeps_its_answer(monkeypatch):
    """A policy that claims one step past the last block's end: the request finishes at the
    step before, then the check stops the call. Isolated (the server's engine), the finished
    request keeps its reason and its pages are freed once."""
    model = tiny("llada", seed=6)
    v = DECODE_POLICIES["vanilla"]
    real = type(v).fused_ahead
    monkeypatch.setattr(type(v), "fused_ahead",
                        lambda self, req, limit: real(self, req, limit) + [(1, 1)])
    eng = _engine(model, 8)
    eng.isolate_step_failures = True
    params = SamplingParams(max_tokens=8, block_length=8, steps=4, cache="dual", decode="vanilla")
    reqs = [eng.add_request(p, params) for p in PROMPTS[:2]]
    while eng.has_unfinished():
        eng.step()
    assert [r.finish_reason for r in reqs] == ["length", "length"]
    assert all(r.error is None for r in reqs) and eng.stats["failed_steps"] == 1
    assert eng.pool.num_free == eng.pool.num_pages
