"""The offloader's data path on its own (``cache/io/kv_offload``): page records are aligned, stores
and loads run in pipelined groups, and a record that fails its checksum or carries another key is
never written into the pool, whichever group it is in."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.cache.io.kv_offload import RECORD_ALIGN, KVOffloader
from flash_dllm.cache.tiers import Block, Store
from conftest import EXACT


def _pool(pages=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, pages, 4, 2, 16, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("offload", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("group", [1, 3, 64])
def test_grouped_store_and_load_round_trip_and_skip_bad_records(offload, group):
    kv = _pool(pages=16)
    off = KVOffloader(kv, 8, offload, group_pages=group)
    assert off.layout.nbytes % RECORD_ALIGN == 0
    blocks = [Block(i.to_bytes(16, "little")) for i in range(7)]
    src = [1, 2, 3, 4, 5, 6, 7]
    before = kv.clone()
    done = off.run([Store(b, p, slot) for slot, (b, p) in enumerate(zip(blocks, src))])
    done += off.drain()
    assert sorted(op.slot for op, ok, _ in done if ok) == list(range(7))
    keys = [b.key for b in blocks]
    assert off.load(list(range(7)), src, keys) == [True] * 7     # back where they came from
    if offload == "bf16":
        assert torch.equal(kv, before)
    else:                                   # lossy, but close: one scale per layer, k/v, head
        assert torch.allclose(kv.float(), before.float(), atol=0.1, rtol=0.15)
    back = kv.clone()                       # each page as a round trip gives it
    kv[:, :, 8:15] = 7.0
    off.host.view(2)[5] ^= 0x01             # a bit flip in record 2's payload
    keys[4] = b"another block..!"           # record 4 carries another block's key
    dst = [8, 9, 10, 11, 12, 13, 14]
    ok = off.load(list(range(7)), dst, keys)
    assert ok == [True, True, False, True, False, True, True]
    for i, (s, d) in enumerate(zip(src, dst)):
        if ok[i]:
            assert torch.equal(kv[:, :, d], back[:, :, s])
        else:
            assert (kv[:, :, d] == 7.0).all()                      # written nowhere
    assert torch.equal(kv[:, :, :8], back[:, :, :8]) and (kv[:, :, 15] == back[:, :, 15]).all()


def test_records_pad_is_zero_and_group_size_is_checked():
    kv = _pool(seed=4)
    off = KVOffloader(kv, 2, "bf16")
    lay = off.layout
    assert lay.nbytes > lay.sums_at + 16                 # this shape has pad bytes
    off.host.buffer.fill_(0xEE)
    off.run([Store(Block(b"k" * 16), 1, 0)])
    off.drain()
    assert not off.host.view(0)[lay.sums_at + 16:].any()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="group_pages"):
            KVOffloader(kv, 2, "bf16", group_pages=bad)


def test_a_bad_record_leaves_its_page_untouched():
    kv = _pool(seed=1)
    off = KVOffloader(kv, 4, "bf16", group_pages=2)
    blocks = [Block(bytes([i]) * 16) for i in range(4)]
    off.run([Store(b, p, p - 1) for b, p in zip(blocks, [1, 2, 3, 4])])
    off.drain()
    expect = kv[:, :, 1:5].clone()
    kv[:, :, 8:12] = 7.0
    off.host.view(1)[off.layout.payload - 1] ^= 0x80       # last payload byte of record 1
    ok = off.load([0, 1, 2, 3], [8, 9, 10, 11], [b.key for b in blocks])
    assert ok == [True, False, True, True]
    assert torch.equal(kv[:, :, 8], expect[:, :, 0])
    assert (kv[:, :, 9] == 7.0).all()                       # never written
    assert torch.equal(kv[:, :, 10:12], expect[:, :, 2:4])


def test_the_data_path_never_prints_a_tensor(monkeypatch):
    """Printing a CUDA tensor reads its values (a host sync each): an eagerly built error message
    with a tensor's repr made every checksum launch wait for the GPU. The whole data path (pack,
    checksum, copies, verify, unpack with a bad record, an engine run with every page moved
    down and up between steps) must run with printing tensors forbidden."""
    from test_sampler import tiny

    from flash_dllm.config import EngineConfig, SamplingParams
    from flash_dllm.engine.engine import Engine

    def forbidden(self, *a, **k):
        raise AssertionError("a tensor was printed on the data path")
    kv = _pool(seed=2)
    off = KVOffloader(kv, 4, "int8", group_pages=3)
    blocks = [Block(bytes([i]) * 16) for i in range(4)]
    model = tiny("llada", seed=3)
    eng = Engine(model, model.cfg, EngineConfig(page_size=4, kv_tier_stress=True))
    monkeypatch.setattr(torch.Tensor, "__repr__", forbidden)
    monkeypatch.setattr(torch.Tensor, "__format__", forbidden)
    monkeypatch.setattr(torch.Tensor, "__str__", forbidden)
    off.run([Store(b, p, p - 1) for b, p in zip(blocks, [1, 2, 3, 4])])
    off.drain()
    off.host.view(0)[3] ^= 0x01
    assert off.load([0, 1, 2, 3], [8, 9, 10, 11], [b.key for b in blocks]) == [False] + [True] * 3
    req = eng.add_request(list(range(3, 23)), SamplingParams(max_tokens=8, block_length=8, **EXACT))
    while eng.has_unfinished():
        eng.step()
    assert req.finish_reason in ("length", "stop")
