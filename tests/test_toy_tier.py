"""A new KV tier is one class plus one registration line: the toy dict store of
``tests/toy_tier.py``, registered in ``TIER_STORES``, serves prefix reuse through a real
``Engine`` in place of the disk tier (L2) and below it (L3); a record corrupted in it is a miss
that recomputes, never served; slow and failing stores leak nothing. The stores that ship
implement the same protocol, and the code that drives the tiers names none of them."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

from flash_dllm.cache import kv_manager, tier_manager, tiers
from flash_dllm.cache.disk_store import DiskStore
from flash_dllm.cache.host_store import HostStore
from flash_dllm.cache.io import kv_offload
from flash_dllm.cache.tier_store import TIER_STORES, TierStore
from flash_dllm.config import EngineConfig
from flash_dllm.engine import engine as engine_mod
from flash_dllm.engine.engine import Engine
from flash_dllm.server.metrics import _SnapshotCollector
from test_sampler import tiny
from test_tiers import OTHERS, PROMPT, PS, _no_reuse_output, _params, _run, check_ledger
from toy_tier import DictStore

# 2 disk slots (a 4 KiB superblock + 2 slots of 8 KiB for the tiny model's 4352-byte records)
TWO_DISK_SLOTS_GB = (4096 + 2 * 8192) / 2**30


@pytest.fixture
def toy(monkeypatch):
    """``register(slots, **kw)``: the toy tier, registered below the shipped ones; returns the
    list of the stores it builds."""
    def register(slots: int = 64, **kw) -> list:
        made = []

        def factory(config, record_bytes, compat):
            made.append(DictStore(slots, record_bytes, **kw))
            return made[-1]
        monkeypatch.setitem(TIER_STORES, "toy", factory)       # the registration: one line
        return made
    return register


def _turn2(eng, params, first):
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    _run(eng, OTHERS, params)              # unrelated traffic: the first prompt's pages go down
    return _run(eng, [p2], params)[0]


def _settle(eng):
    eng.kv_manager.ops_done(eng.runner.offload.drain())


def _reused_from_l0(model, params):
    """The follow-up turn with its prefix reused from L0 (no tiers): the tokens to match."""
    ref = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS))
    return _turn2(ref, params, _run(ref, [PROMPT], params)[0])


# ------------------------------------------------------------------------------- the protocol
@pytest.mark.parametrize("kind", ["host", "disk", "toy"])
def test_every_store_implements_the_protocol(tmp_path, kind):
    rb = 300
    store = {"host": lambda: HostStore(3, rb),
             "disk": lambda: DiskStore(tmp_path / "kv.bin", 4096 + 3 * 4096, rb, b"compat"),
             "toy": lambda: DictStore(3, rb, delay=2)}[kind]()
    try:
        assert isinstance(store, TierStore) and store.num_slots == 3 and store.num_free == 3
        a, b = store.alloc(), store.alloc()
        assert store.num_free == 1 and a != b
        key, payload = bytes(range(16)), bytes(i % 251 for i in range(7, 7 + rb))
        store.poll([store.write_async(a, key, payload)])
        out = torch.zeros(rb, dtype=torch.uint8)
        hit = store.read_async(a, key, out)
        store.poll([hit])
        assert hit.result() is not None and bytes(out.numpy()) == payload
        miss = store.read_async(a, bytes(16), torch.zeros(rb, dtype=torch.uint8))
        never = store.read_async(b, key, torch.zeros(rb, dtype=torch.uint8))
        store.poll([miss, never])
        assert miss.result() is None and never.result() is None     # another key, unwritten
        store.free(b)
        assert store.num_free == 2 and isinstance(store.stats, dict)
    finally:
        store.close()


def test_the_toy_store_completes_after_its_delay_and_fails_on_demand():
    store = DictStore(2, 8, delay=2)
    s = store.alloc()
    w = store.write_async(s, b"k" * 16, b"12345678")
    r = store.read_async(s, b"k" * 16, bytearray(8))
    store.poll()
    assert not w.done() and not r.done()
    store.poll()
    assert w.done() and r.done() and r.result() is not None
    store.fail_writes, store.fail_reads = True, True
    w = store.write_async(s, b"k" * 16, b"12345678")
    store.poll([w])
    assert isinstance(w.exception(), OSError) and s not in store.records     # nothing kept
    r = store.read_async(s, b"k" * 16, bytearray(8))
    store.poll([r])
    assert r.result() is None


def test_nothing_that_drives_the_tiers_names_a_store():
    """A store is known to its registration only: the ledger, the tier manager, the offloader,
    the runner's and engine's construction name neither the disk store nor the toy."""
    from flash_dllm.worker import runner
    for mod in (kv_manager, tier_manager, tiers, kv_offload, engine_mod, runner):
        used = set()                      # the names its code imports and refers to
        for node in ast.walk(ast.parse(inspect.getsource(mod))):
            if isinstance(node, ast.ImportFrom):
                used |= {node.module or "", *(a.name for a in node.names)}
            elif isinstance(node, ast.Import):
                used |= {a.name for a in node.names}
            elif isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
        for name in ("DiskStore", "flash_dllm.cache.disk_store", "disk_tier", "DictStore"):
            assert name not in used, f"{mod.__name__} names {name}"


# --------------------------------------------------------------------------- through an Engine
def test_toy_tier_in_place_of_disk_serves_prefix_reuse(toy):
    """Host memory (L1) and the toy (L2, no disk configured): the follow-up turn reuses its
    prefix from the toy, token for token what a reuse from L0 gives."""
    made = toy(slots=64)
    model = tiny("llada", seed=3)
    params = _params()
    want = _reused_from_l0(model, params)
    assert not made                                   # (kv_cpu_gb = 0: no tiers at all)
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS,
                                                num_kv_pages=24, kv_cpu_gb=0.00005))
    assert eng.runner.offload.stores[1] is made[0] and eng.kv_manager.tier_names[2] == "l2"
    got = _turn2(eng, params, _run(eng, [PROMPT], params)[0])
    _settle(eng)
    assert got.reused_len == want.reused_len == 36
    assert got.tokens.tolist() == want.tokens.tolist()
    st = eng.kv_manager.stats
    assert st["hit_tokens"][2] == 36, st["hit_tokens"]
    assert st["bytes_moved"][("l2", "down")] > 0 and st["bytes_moved"][("l2", "up")] > 0
    assert made[0].counts["hits"] >= 9
    check_ledger(eng)


def test_toy_tier_below_disk_is_l3_in_stats_and_metrics(toy, tmp_path):
    """Host memory, a disk of two slots, and the toy below it (L3): pages written through to
    every tier come back from the toy once host memory and disk have been reused."""
    made = toy(slots=64)
    assert not made                                   # (built with the engine)
    model = tiny("llada", seed=3)
    params = _params()
    eng = Engine(model, model.cfg, EngineConfig(
        prefix_reuse=True, page_size=PS, num_kv_pages=24, kv_cpu_gb=0.00005,
        kv_disk_path=str(tmp_path / "kv.bin"), kv_disk_gb=TWO_DISK_SLOTS_GB))
    assert eng.runner.offload.tier_slots == (12, 2, 64) and eng.runner.offload.stores[2] is made[0]
    assert eng.kv_manager.tier_names == ("l0", "l1", "l2", "l3")
    first = _run(eng, [PROMPT], params)[0]
    got = _turn2(eng, params, first)
    _settle(eng)
    st = eng.kv_manager.stats
    assert got.reused_len == 36 and st["hit_tokens"][3] > 0, st["hit_tokens"]
    assert got.tokens.tolist() == _reused_from_l0(model, params).tokens.tolist()
    check_ledger(eng)
    snapshot = _SnapshotCollector(None)._tiers(eng.stats_snapshot().tiers)  # what /metrics shows
    families = {f.name: f for f in snapshot}
    labels = {s.labels.get("tier") for s in families["flash_dllm_kv_pages_cached"].samples}
    assert labels == {"l0", "l1", "l2", "l3"}
    moved = {(s.labels["tier"], s.labels["direction"]): s.value
             for s in families["flash_dllm_kv_bytes_moved"].samples}
    assert moved[("l3", "down")] > 0 and moved[("l3", "up")] > 0


def test_a_record_corrupted_in_the_toy_is_a_miss_never_served(toy):
    """The toy returns the bad record (it has no checksum of its own, ``verifies`` False); the
    device check of the load refuses it, and the toy's copy counts as a failed read, dropped: the
    request recomputes (fetching the same bad copy again would stall it for ever)."""
    made = toy(slots=64)
    model = tiny("llada", seed=3)
    params = _params()
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS,
                                                num_kv_pages=24, kv_cpu_gb=0.00005))
    first = _run(eng, [PROMPT], params)[0]
    _run(eng, OTHERS, params)
    _settle(eng)
    assert made[0].corrupt() > 0                      # every record in the toy: one bit off
    p2 = first.tokens[:first.prompt_len + 8].tolist() + [11, 12, 13]
    r2 = _run(eng, [p2], params)[0]
    _settle(eng)
    st = eng.kv_manager.stats
    assert made[0].counts["hits"] >= 1                # it came back (the toy has no checksum)
    assert st["load_failures"] >= 1 and st["checksum_failures"] >= 1
    assert r2.reused_len == 0                         # nothing corrupt was reused
    assert r2.tokens.tolist() == _no_reuse_output(model, params)
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)


@pytest.mark.parametrize("fault", ["slow", "failing"])
def test_a_slow_or_failing_toy_leaks_nothing(toy, fault):
    """Writes that complete steps later publish only then; writes that fail and reads that miss
    publish nothing: the turn recomputes what it cannot reuse, the same tokens either way."""
    made = toy(slots=64, delay=3 if fault == "slow" else 0)
    model = tiny("llada", seed=3)
    params = _params()
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=PS,
                                                num_kv_pages=24, kv_cpu_gb=0.00005))
    if fault == "failing":
        made[0].fail_writes = made[0].fail_reads = True
    first = _run(eng, [PROMPT], params)[0]
    got = _turn2(eng, params, first)
    _settle(eng)
    assert made[0].stats["in_flight"] == 0
    if fault == "slow":
        assert got.reused_len == 36 and eng.kv_manager.stats["hit_tokens"][2] > 0
        assert got.tokens.tolist() == _reused_from_l0(model, params).tokens.tolist()
    else:
        assert made[0].counts["write_failures"] > 0 and not made[0].records
        assert eng.kv_manager.stats["hit_tokens"][2] == 0
    assert eng.kv_manager.num_used == 0
    check_ledger(eng)
