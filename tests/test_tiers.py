"""Tiered KV memory and prefix reuse, end to end on the CPU with real stores (pinned-or-plain host
memory, a real file for the disk tier): reuse shares pages read-only, a page that went down to
host memory or disk and came back serves exactly the bytes it left with, a corrupt copy is a miss
that recomputes, and the page ledger never leaks."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from test_sampler import tiny

PS = 4
PROMPT = [(5 * i + 7) % 90 + 3 for i in range(30)]
OTHERS = [[(3 * i + k) % 90 + 3 for i in range(40)] for k in range(3)]


def _params(cache="dual", decode="threshold"):
    return SamplingParams(max_tokens=16, block_length=8, cache=cache, decode=decode,
                          threshold=0.5)


def _run(eng, prompts, params):
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return reqs


def check_ledger(eng):
    """Every pool reference is held by a request's block table or a cached block's L0 copy."""
    kv = eng.kv_manager
    refs = [0] * kv.num_pages
    for pages in kv._pages.values():
        for p in pages:
            refs[p] += 1
    for b in kv.tiers.blocks:
        if b.l0 is not None:
            refs[b.l0] += 1
    assert refs == [kv.pool.ref_count(p) for p in range(kv.num_pages)]
    assert kv.pool.num_free == sum(r == 0 for r in refs)
    for t in range(1, kv.tiers.num_tiers):          # every store tier: L1 host, L2 disk, ...
        held = [b.copies[t] for b in kv.tiers.blocks if t in b.copies]
        free = kv.tiers.free[t]
        assert len(set(held)) == len(held) and not set(held) & set(free)
        assert len(held) + len(free) == kv.tiers.slots[t]


def _turn2(eng, params, first):
    """A follow-up prompt: the first request's prompt and first answer block, then more."""
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    _run(eng, OTHERS, params)              # unrelated traffic between the turns
    return _run(eng, [p2], params)[0]


def test_reuse_shares_pages_read_only():
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS))
    first = _run(eng, [PROMPT], _params())[0]
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    r2 = eng.add_request(p2, _params())
    eng.step()                                  # admitted: reuses the published pages
    assert r2.reused_len == 36 and eng.kv_manager.stats["hit_tokens"][0] == 36
    shared = eng.kv_manager.pages(r2.request_id)[:9]
    before = eng.runner.kv[:, :, shared].clone()
    while eng.has_unfinished():
        eng.step()
    assert torch.equal(eng.runner.kv[:, :, shared], before)     # never written
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)


def test_reuse_off_for_cache_none_and_aborts_publish_nothing():
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS))
    _run(eng, [PROMPT], _params(cache="none"))
    assert eng.kv_manager.stats["published_pages"] == 0
    r = eng.add_request(PROMPT, _params())
    eng.step()
    eng.abort(r.request_id)
    assert eng.kv_manager.stats["published_pages"] == 0 and eng.kv_manager.num_used == 0
    check_ledger(eng)


@pytest.mark.parametrize("cache", ["dual", "prefix", "flash"])
def test_pages_that_left_l0_come_back_exact(tmp_path, cache):
    """The same follow-up turn reusing its prefix from L0, from host memory (L1) and from disk
    (L2, a real file): the same tokens (bf16 / fp32 offload moves the bytes unchanged)."""
    model = tiny("llada", seed=3)
    outs, hits = [], []
    for kw in (dict(), dict(num_kv_pages=24, kv_cpu_gb=0.0015),
               dict(num_kv_pages=24, kv_cpu_gb=0.00005, kv_disk_path=str(tmp_path / "kv.bin"),
                    kv_disk_gb=0.01)):
        eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS, **kw))
        first = _run(eng, [PROMPT], _params(cache))[0]
        r2 = _turn2(eng, _params(cache), first)
        eng.runner.offload and eng.kv_manager.ops_done(eng.runner.offload.drain())
        outs.append(r2.tokens.tolist())
        hits.append(eng.kv_manager.stats["hit_tokens"])
        assert r2.reused_len == 36
        check_ledger(eng)
    assert outs[0] == outs[1] == outs[2]
    assert hits[0][0] == 36 and hits[1][1] == 36 and hits[2][2] == 36


@pytest.mark.parametrize("cache,decode", [("dual", "threshold"), ("prefix", "vanilla"),
                                          ("flash", "threshold"), ("dual", "verify"),
                                          ("none", "vanilla")])
def test_stress_every_page_down_and_back_changes_nothing(cache, decode):
    """kv_tier_stress: after every step every running page goes to host memory and back
    (pack, copy, checksum, unpack): token for token the outputs without tiers."""
    model = tiny("dream", seed=4)
    params = _params(cache, decode)
    prompts = [PROMPT, OTHERS[0], OTHERS[1][:13]]
    ref = _run(Engine(model, model.cfg, EngineConfig(page_size=PS)), prompts, params)
    got = _run(Engine(model, model.cfg, EngineConfig(page_size=PS, kv_tier_stress=True)),
               prompts, params)
    assert [r.tokens.tolist() for r in ref] == [r.tokens.tolist() for r in got]


def _no_reuse_output(model, params):
    eng = Engine(model, model.cfg, EngineConfig(page_size=PS))
    first = _run(eng, [PROMPT], params)[0]
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    return _run(eng, [p2], params)[0].tokens.tolist()


def test_corrupt_host_copy_is_a_miss_that_recomputes():
    model = tiny("llada", seed=3)
    params = _params()
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS, num_kv_pages=24,
                                                kv_cpu_gb=0.0015))
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)                       # pushes the first request's pages to L1
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    host = eng.runner.offload.host.buffer
    host[:, 100] ^= 0x10                            # one bit flipped in every host record
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    r2 = _run(eng, [p2], params)[0]
    st = eng.kv_manager.stats
    assert st["checksum_failures"] >= 1 and st["load_failures"] >= 1
    assert r2.reused_len == 0                       # nothing corrupt was reused
    assert r2.tokens.tolist() == _no_reuse_output(model, params)
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)


def test_corrupt_disk_copy_is_a_miss_that_recomputes(tmp_path):
    model = tiny("llada", seed=3)
    params = _params()
    path = tmp_path / "kv.bin"
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS, num_kv_pages=24,
                                                kv_cpu_gb=0.00002, kv_disk_path=str(path),
                                                kv_disk_gb=0.01))
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    data = bytearray(path.read_bytes())
    for off in range(4096 + 300, len(data), 4096):  # flip a byte in every slot's payload
        data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    r2 = _run(eng, [p2], params)[0]
    assert eng.runner.offload.store(2).stats["checksum_failures"] >= 1      # the disk store
    assert eng.kv_manager.stats["load_failures"] >= 1
    assert r2.reused_len == 0                       # nothing corrupt was reused
    assert r2.tokens.tolist() == _no_reuse_output(model, params)
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)


def test_a_stale_host_record_of_another_block_is_never_served():
    """Two blocks' valid host records swapped (checksums fine): the key each record carries
    refuses both, so the reuse stops before them."""
    model = tiny("llada", seed=3)
    params = _params()
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS, num_kv_pages=24,
                                                kv_cpu_gb=0.0015))
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    chain = eng.kv_manager.tree("dual").match(p2)
    a, b = chain[2].block.copies.get(1), chain[3].block.copies.get(1)
    assert a is not None and b is not None
    host = eng.runner.offload.host.buffer
    host[a], host[b] = host[b].clone(), host[a].clone()
    r2 = _run(eng, [p2], params)[0]
    assert eng.kv_manager.stats["load_failures"] >= 1
    assert r2.reused_len <= 2 * PS
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)


def _disk_engine(tmp_path, **kw):
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(
        prefix_reuse=True, page_size=PS, num_kv_pages=24, kv_cpu_gb=0.00005,
        kv_disk_path=str(tmp_path / "kv.bin"), kv_disk_gb=0.01, **kw))
    return model, eng


def _prefix_on_disk(eng, params):
    """The first turn, then unrelated traffic that pushes its pages down to disk; the follow-up
    prompt."""
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)
    eng.kv_manager.ops_done(eng.runner.offload.drain())
    return first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]


def test_queue_ahead_prefetch_reads_disk_while_the_request_waits(tmp_path):
    """One running slot, busy with another request: the follow-up turn waits, and meanwhile its
    prefix's disk copies move to host memory; at admission it loads those from host memory (L1
    hits instead of L2), with the same tokens as without prefetch (``kv_prefetch=False``)."""
    params = _params()
    seen = {}
    for on in (True, False):
        model, eng = _disk_engine(tmp_path / str(on), max_num_seqs=1, kv_prefetch=on)
        p2 = _prefix_on_disk(eng, params)
        kv = eng.kv_manager
        hits0 = list(kv.stats["hit_tokens"])
        busy = eng.add_request(OTHERS[2][:30], params)
        r2 = eng.add_request(p2, params)
        while eng.has_unfinished():
            eng.step()
        kv.ops_done(eng.runner.offload.drain())
        assert busy.finished and r2.finished and r2.reused_len > 0
        hits = [a - b for a, b in zip(kv.stats["hit_tokens"], hits0)]
        pf = kv.stats["prefetch"]
        if on:
            # (at most half the host slots hold prefetched pages: the rest comes from disk)
            assert pf["issued"] >= 1 and pf["on_time"] == pf["issued"], pf
            assert pf["late"] == pf["useless"] == 0
            assert hits[1] >= pf["on_time"] * PS, (hits, pf)
        else:
            assert pf == {"issued": 0, "on_time": 0, "late": 0, "useless": 0}
        assert kv.num_used == 0 and not kv.tiers.prefetched and not kv.tiers.prefetch_for
        check_ledger(eng)
        seen[on] = (r2.tokens.tolist(), r2.reused_len, hits[2])
    assert seen[True][:2] == seen[False][:2]
    assert 0 < seen[True][2] < seen[False][2]      # what was prefetched no longer came from disk


def test_aborting_a_waiting_request_cancels_its_prefetch_at_once(tmp_path):
    """A queued request whose prefix prefetch was issued is aborted: it leaves the queue and
    its prefetch is cancelled in the abort itself (no step needed: the engine may stay idle);
    the running request finishes and the page ledger holds."""
    params = _params()
    model, eng = _disk_engine(tmp_path, max_num_seqs=1, kv_prefetch=True)
    p2 = _prefix_on_disk(eng, params)
    kv = eng.kv_manager
    busy = eng.add_request(OTHERS[2][:30], params)
    r2 = eng.add_request(p2, params)
    eng.step()                                        # busy runs; r2's prefetch is issued
    assert kv.stats["prefetch"]["issued"] >= 1 and kv.tiers.prefetch_for
    assert eng.abort(r2.request_id)
    assert r2 not in eng.scheduler.waiting and not eng.scheduler._prefetched
    assert not kv.tiers.prefetch_for
    while eng.has_unfinished():
        eng.step()
    kv.ops_done(eng.runner.offload.drain())
    assert busy.finished and busy.finish_reason != "abort"
    assert kv.num_used == 0 and not kv.tiers.prefetched and not kv.tiers.prefetch_for
    check_ledger(eng)


def test_prefetch_still_reading_is_late_and_an_unused_one_is_useless(tmp_path):
    """A request admitted while its prefetch still reads recomputes from there (late: nothing
    in flight is served); a prefetched copy evicted before any request used it is useless."""
    params = _params()
    model, eng = _disk_engine(tmp_path / "a")
    p2 = _prefix_on_disk(eng, params)
    kv, off = eng.kv_manager, eng.runner.offload
    n = kv.prefetch("late", p2, "dual")
    assert n >= 1
    pending = kv.take_ops()                       # issued, not run: still reading
    alloc = kv.allocate("late", len(p2) + 16, p2, mode="dual")
    assert alloc is not None and alloc.reused_len == 0
    assert kv.stats["prefetch"]["late"] == n and kv.stats["prefetch"]["useless"] == 0
    kv.ops_done(off.run(pending + kv.take_ops()))
    kv.ops_done(off.drain())
    kv.free("late")
    assert kv.num_used == 0
    check_ledger(eng)
    # a prefetch that completes, then unrelated traffic that needs the host slots
    model, eng = _disk_engine(tmp_path / "b")
    p2 = _prefix_on_disk(eng, params)
    kv, off = eng.kv_manager, eng.runner.offload
    n = kv.prefetch("later", p2, "dual")
    kv.ops_done(off.run(kv.take_ops()))
    kv.ops_done(off.drain())
    assert n >= 1 and len(kv.tiers.prefetched) == n and all(kv.tiers.prefetched.values())
    _run(eng, [[(7 * i + k) % 90 + 3 for i in range(40)] for k in range(4)], params)
    kv.ops_done(off.drain())
    pf = kv.stats["prefetch"]
    assert pf["useless"] >= 1 and pf["on_time"] == 0 and pf["late"] == 0, pf
    assert kv.num_used == 0
    check_ledger(eng)


def test_prefetch_is_a_no_op_without_a_disk_tier_or_for_short_prompts(tmp_path):
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS,
                                                num_kv_pages=24, kv_cpu_gb=0.0015))
    assert eng.kv_manager.prefetch("a", PROMPT, "dual") == 0
    _, eng = _disk_engine(tmp_path)
    assert eng.kv_manager.prefetch("b", PROMPT[:6], "dual") == 0 and not eng.kv_manager.tiers.ops


def test_prefill_sized_steps_teach_the_cost_model_its_recompute_rate():
    """The cost model's recompute rate follows the engine's own prefill-sized steps (it started
    from a fixed guess that nothing updated)."""
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS))
    eng.PREFILL_ROWS = 32
    before = eng.kv_manager.cost.prefill_tokens_per_s
    _run(eng, [PROMPT, OTHERS[0]], _params())
    assert eng.kv_manager.cost.prefill_tokens_per_s != before
    eng2 = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS))
    _run(eng2, [PROMPT[:10]], _params())                  # 26-position canvases: no prefill step
    assert eng2.kv_manager.cost.prefill_tokens_per_s == before
