"""The offloader's pipelined page moves on CUDA at the LLaDA-8B page shape (8 MiB a page).

Run on the GPU box: ``python -m pytest -m gpu tests/gpu/test_kv_offload_gpu.py -q``. Acceptance:
records aligned; grouped stores and loads (groups of 1, 5 and all pages) bring every page back
bit-exact in bf16 and as the CPU reference in fp8 / int8; a record with a flipped bit or another
block's key is written nowhere, in any group; stores overlap the step's stream (no host sync).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.cache.io.kv_offload import RECORD_ALIGN, KVOffloader
from flash_dllm.cache.tiers import Block, Store

DEV = torch.device("cuda")


@pytest.mark.parametrize("offload", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("group", [1, 5, 64])
def test_grouped_moves_on_cuda_are_exact_and_skip_bad_records(offload, group):
    g = torch.Generator(device=DEV).manual_seed(3)
    kv = torch.randn(32, 2, 24, 16, 32, 128, device=DEV, generator=g).to(torch.bfloat16)
    off = KVOffloader(kv, 11, offload, group_pages=group)
    assert off.layout.nbytes % RECORD_ALIGN == 0
    blocks = [Block(i.to_bytes(16, "little")) for i in range(11)]
    src = list(range(1, 12))
    cpu = kv.cpu()
    done = off.run([Store(b, p, s) for s, (b, p) in enumerate(zip(blocks, src))]) + off.drain()
    assert sorted(op.slot for op, ok, _ in done if ok) == list(range(11))
    keys = [b.key for b in blocks]
    assert off.load(list(range(11)), src, keys) == [True] * 11
    if offload == "bf16":
        assert torch.equal(kv.cpu(), cpu)
    else:                   # as the same round trip through the CPU reference path
        ref = KVOffloader(cpu.clone(), 11, offload)
        ref.run([Store(b, p, s) for s, (b, p) in enumerate(zip(blocks, src))])
        ref.drain()
        ref.load(list(range(11)), src, keys)
        assert torch.equal(kv.cpu(), ref.kv)
    back = kv.clone()
    kv[:, :, 12:23] = 7.0
    off.host.view(3)[12345] ^= 0x04
    keys[9] = b"another block..!"
    dst = list(range(12, 23))
    ok = off.load(list(range(11)), dst, keys)
    assert ok == [i not in (3, 9) for i in range(11)]
    for i, (s, d) in enumerate(zip(src, dst)):
        if ok[i]:
            assert torch.equal(kv[:, :, d], back[:, :, s])
        else:
            assert (kv[:, :, d] == 7.0).all()


def test_issuing_a_store_never_waits_for_the_gpu():
    """A store is issued between steps: packing, checksums and the queued copies must not sync
    with the device (an error message once printed a CUDA tensor, one sync per value)."""
    kv = torch.randn(32, 2, 20, 16, 32, 128, device=DEV).to(torch.bfloat16)
    off = KVOffloader(kv, 16, "bf16", group_pages=4)
    stores = [Store(Block(bytes([i]) * 16), i + 1, i) for i in range(16)]
    off.run(stores)                              # warm-up: Triton compiles outside the check
    off.drain()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        off.run(stores)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(ok for _, ok, _ in off.drain())
