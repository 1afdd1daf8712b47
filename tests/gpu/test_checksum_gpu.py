"""device_checksum on CUDA equals the CPU value for the same bytes (wrapping int64 sums do not
depend on reduction order), and stays on the device."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flash_dllm.cache import checksum
from flash_dllm.cache.checksum import device_checksum, device_checksum_rows

DEV = torch.device("cuda")


@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 4099, 1 << 20, (9 << 20) + 5, 40 << 20])
def test_cuda_equals_cpu(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    cpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    got = device_checksum(cpu.to(DEV))
    assert got.device.type == "cuda" and got.dtype == torch.int64 and got.dim() == 0
    assert int(got) == int(device_checksum(cpu))


def test_cuda_equals_cpu_for_typed_and_batched_pages():
    page = torch.randn(4, 2, 16, 8, 128, dtype=torch.bfloat16)    # [layers, K/V, tokens, heads, D]
    assert int(device_checksum(page.to(DEV))) == int(device_checksum(page))
    group = torch.randint(0, 256, (64, 65536 + 3), dtype=torch.uint8)
    assert device_checksum_rows(group.to(DEV)).cpu().tolist() == \
        device_checksum_rows(group).tolist()


def test_cuda_chunking_does_not_change_the_value(monkeypatch):
    cpu = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    want = int(device_checksum(cpu))
    monkeypatch.setattr(checksum, "CHUNK_WORDS", 1000)
    assert int(device_checksum(cpu.to(DEV))) == want


def test_every_bit_flip_detected_on_cuda():
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=DEV)
    want = device_checksum(base)
    k = torch.arange(32768, device=DEV)
    flipped = base.repeat(32768, 1)                                # [32768, 4096] = 128 MiB
    flipped[k, k // 8] ^= (1 << (k % 8)).to(torch.uint8)
    assert not bool((device_checksum_rows(flipped) == want).any())
