"""Moving running requests between engines (``disagg/migrate.py``): the base of prefill/decode
disaggregation. A request exported after any step and imported into another engine (running
other requests) must finish exactly as if it had stayed, for every cache mode x decode policy,
with sentinels and a seeded sampled request; the KV segment is one contiguous page-first tensor
and round-trips bit-exact."""
from __future__ import annotations

import pytest
import torch
from test_sampler import PROMPTS, tiny

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, EngineConfig, SamplingParams
from flash_dllm.disagg import migrate
from flash_dllm.engine.engine import Engine
from flash_dllm.kernels.kv_pages import packed_shape
from conftest import EXACT

CFG = EngineConfig(max_num_seqs=32, num_kv_pages=256, page_size=4)


def _params() -> list[SamplingParams]:
    ps = [SamplingParams(max_tokens=16, block_length=8, cache=c, decode=d, threshold=0.3,
                         early_stop=False) for c in CACHE_MODES for d in DECODE_POLICIES
          if not CACHE_MODES[c].needs_block_causal]  # (block: block-causal models)
    ps.append(SamplingParams(max_tokens=16, block_length=8, temperature=0.9, seed=3,
                             cache="dual", decode="threshold"))
    ps.append(SamplingParams(max_tokens=16, block_length=8, decode="verify", cache="dual",
                             entropy_max=1.0, perturb_sigma=0.5, kv_jaccard_min=0.9))
    # the drift trigger: its last step's mass moves with the request (decoding/drift.py)
    ps += [SamplingParams(max_tokens=32, block_length=8, cache=c, decode="threshold",
                          threshold=0.3, drift_min=0.999, drift_defer=d, kv_top_k=3,
                          early_stop=False)
           for c, d in (("dual", False), ("dual", True), ("prefix", False))]
    return ps


def _colocated(model, prompts, params):
    eng = Engine(model, model.cfg, CFG)
    reqs = [eng.add_request(p, q, request_id=str(i)) for i, (p, q) in
            enumerate(zip(prompts, params))]
    while eng.has_unfinished():
        eng.step()
    return [eng.output(r) for r in reqs]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("after", [1, 3])
def test_migrated_requests_finish_as_if_they_stayed(family, after):
    model = tiny(family, seed=4)
    ps = _params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ps))]
    ref = _colocated(model, prompts, ps)
    a, b = Engine(model, model.cfg, CFG), Engine(model, model.cfg, CFG)
    # b already runs a request of its own: imports join a live batch
    other = b.add_request(PROMPTS[1], SamplingParams(max_tokens=8, block_length=8,
                                                     **EXACT), "other")
    b.step()
    for i, (p, q) in enumerate(zip(prompts, ps)):
        a.add_request(p, q, request_id=str(i))
    moved = {}
    with torch.inference_mode():
        for _ in range(after):
            a.step()
        for r in list(a.running):
            snap, seg = migrate.export_request(a, r.request_id)
            assert seg.is_contiguous()                          # one segment per request
            assert tuple(seg.shape) == tuple(packed_shape(a.runner.kv.shape, snap.num_pages))
            moved[r.request_id] = migrate.import_request(b, snap, seg.clone())
        assert a.kv_manager.num_used == 0 and not a.runner._states   # nothing stranded on a
        while b.has_unfinished():
            b.step()
    assert moved, "every request finished before it could move: make the test longer"
    for i, want in enumerate(ref):
        req = moved.get(str(i))
        if req is None:            # finished on a within `after` steps
            continue
        got = b.output(req)
        assert got.token_ids == want.token_ids, (i, ps[i])
        assert got.num_forwards == want.num_forwards
        assert got.metrics["block_forwards"] == want.metrics["block_forwards"]
        assert got.finish_reason == want.finish_reason
        assert got.metrics["sentinel_triggers"] == want.metrics["sentinel_triggers"], (i, ps[i])
    assert other.finished and b.kv_manager.num_used == 0


def test_segment_round_trip_is_bit_exact():
    model = tiny("dream", seed=5)
    a, b = Engine(model, model.cfg, CFG), Engine(model, model.cfg, CFG)
    a.add_request(PROMPTS[1], SamplingParams(max_tokens=16, block_length=8, **EXACT), "r")
    b.add_request(PROMPTS[0], SamplingParams(max_tokens=32, block_length=8,
                                             **EXACT), "pad")  # other pages
    with torch.inference_mode():
        a.step()
        b.step()
        pages_a = list(a.kv_manager.pages("r"))
        before = a.runner.kv[:, :, pages_a].clone()
        snap, seg = migrate.export_request(a, "r")
        req = migrate.import_request(b, snap, seg.view(torch.uint8).clone())   # bytes on the wire
    pages_b = b.kv_manager.pages("r")
    assert set(pages_b).isdisjoint(b.kv_manager.pages("pad"))
    assert torch.equal(b.runner.kv[:, :, pages_b].view(torch.int32),
                       before.view(torch.int32))
    assert req.block == 0 and req.num_forwards == 1


def test_bad_moves_are_named_errors():
    model = tiny("llada", seed=6)
    a = Engine(model, model.cfg, CFG)
    b = Engine(model, model.cfg, EngineConfig(max_num_seqs=8, num_kv_pages=64, page_size=8))
    with pytest.raises(migrate.MigrationError, match="not running"):
        migrate.export_request(a, "nope")
    a.add_request(PROMPTS[0], SamplingParams(max_tokens=16, block_length=8, **EXACT), "r")
    with torch.inference_mode():
        a.step()
        snap, seg = migrate.export_request(a, "r")
    with pytest.raises(migrate.MigrationError, match="does not fit this pool"):
        migrate.import_request(b, snap, seg)
    assert b.kv_manager.num_used == 0


def test_import_waits_when_pages_do_not_fit():
    model = tiny("llada", seed=6)
    a = Engine(model, model.cfg, CFG)
    b = Engine(model, model.cfg, EngineConfig(max_num_seqs=8, num_kv_pages=8, page_size=4))
    b.add_request(PROMPTS[0], SamplingParams(max_tokens=24, block_length=8, **EXACT), "big")
    a.add_request(PROMPTS[1], SamplingParams(max_tokens=16, block_length=8, **EXACT), "r")
    with torch.inference_mode():
        a.step()
        b.step()
        snap, seg = migrate.export_request(a, "r")
        assert migrate.reserve(b, snap) is None            # full: the caller keeps it queued
        while b.has_unfinished():
            b.step()
        assert migrate.import_request(b, snap, seg) is not None


def test_request_with_drafts_in_the_fused_store_migrates():
    """A verify request whose drafts a fused step left in the runner's draft store
    (``decoding/policies/verify_fused.py``) moves with them: it finishes as if it had stayed."""
    from dataclasses import replace
    model = tiny("dream", seed=4)
    fused = replace(CFG, fused_step=True)
    p = SamplingParams(max_tokens=24, block_length=8, decode="verify", cache="dual",
                       threshold=0.4, gamma=0.3, early_stop=False)
    ref = _colocated(model, PROMPTS, [p] * len(PROMPTS))
    a, b = Engine(model, model.cfg, fused), Engine(model, model.cfg, fused)
    for i, q in enumerate(PROMPTS):
        a.add_request(q, p, request_id=str(i))
    moved = {}
    with torch.inference_mode():
        for _ in range(3):                 # a refresh, then fused steps
            a.step()
        assert a.runner.fused.stats["fused_steps"] > 0
        for r in list(a.running):
            snap, seg = migrate.export_request(a, r.request_id)
            moved[r.request_id] = migrate.import_request(b, snap, seg.clone())
        while b.has_unfinished():
            b.step()
    assert len(moved) == len(PROMPTS)
    for i, want in enumerate(ref):
        got = b.output(moved[str(i)])
        assert got.token_ids == want.token_ids and got.num_forwards == want.num_forwards
        assert got.metrics["verify_accepted"] == want.metrics["verify_accepted"]
