"""device_checksum on CUDA (the Triton kernel) equals the PyTorch reference on CUDA and on the CPU
for the same bytes (wrapping int64 sums do not depend on reduction order), stays on the device,
and is fast: run ``python -m pytest -m gpu tests/gpu/test_checksum_gpu.py -q -s`` for the timing
lines (target: an 8 MiB page in < 20 us on an H200)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.cache.checksum import device_checksum, device_checksum_rows
from flash_dllm.kernels import checksum as K

DEV = torch.device("cuda")


@pytest.mark.parametrize("nbytes", [0, 1, 3, 4, 4099, 1 << 20, (9 << 20) + 5, 40 << 20])
def test_cuda_equals_cpu(nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    cpu = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    got = device_checksum(cpu.to(DEV))
    assert got.device.type == "cuda" and got.dtype == torch.int64 and got.shape == (2,)
    assert got.cpu().tolist() == device_checksum(cpu).tolist()


@pytest.mark.parametrize("nbytes", [5, 8191, 1 << 20, (8 << 20) + 3, (40 << 20) - 1, 40 << 20])
def test_kernel_equals_reference_on_cuda(nbytes):
    g = torch.Generator(device=DEV).manual_seed(nbytes)
    b = torch.randint(0, 256, (1, nbytes), dtype=torch.uint8, device=DEV, generator=g)
    got = K.checksum_rows_triton(b)
    assert torch.equal(got, K.checksum_rows_reference(b))            # torch on CUDA
    assert torch.equal(got.cpu(), K.checksum_rows_reference(b.cpu()))
    for block in (256, 1024, 4096, 8192):
        assert torch.equal(K.checksum_rows_triton(b, block=block), got)


def test_cuda_equals_cpu_for_typed_batched_and_strided_pages():
    page = torch.randn(4, 2, 16, 8, 128, dtype=torch.bfloat16)    # [layers, K/V, tokens, heads, D]
    assert device_checksum(page.to(DEV)).cpu().tolist() == device_checksum(page).tolist()
    group = torch.randint(0, 256, (64, 65536 + 3), dtype=torch.uint8)
    assert device_checksum_rows(group.to(DEV)).cpu().tolist() == \
        device_checksum_rows(group).tolist()
    rec = torch.randint(0, 256, (16, (1 << 20) + 4096 + 32), dtype=torch.uint8)  # records
    rec_d = rec.to(DEV)
    for a, b in ((0, 1 << 20), (1 << 20, (1 << 20) + 4096), (0, (1 << 20) + 4096), (4, 1001)):
        got = device_checksum_rows(rec_d[:, a:b])                  # row ranges, in place
        assert got.shape == (16, 2)
        assert torch.equal(got.cpu(), device_checksum_rows(rec[:, a:b]))


def test_every_bit_flip_and_cancelling_flips_detected_on_cuda():
    base = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=DEV)
    want = device_checksum(base)
    k = torch.arange(32768, device=DEV)
    flipped = base.repeat(32768, 1)                                # [32768, 4096] = 128 MiB
    flipped[k, k // 8] ^= (1 << (k % 8)).to(torch.uint8)
    sums = device_checksum_rows(flipped)
    assert not (sums[:, 0] == want[0]).any() and not (sums[:, 1] == want[1]).any()
    x = torch.randint(-2**31, 2**31 - 1, (1, 4096), dtype=torch.int32, device=DEV).repeat(2, 1)
    x[:, [100, 3001]] |= -2**31
    x[:, [101, 3000]] &= 0x7FFFFFFF
    x[1, [100, 101, 3000, 3001]] ^= -2**31
    s = device_checksum_rows(x)
    assert s[0, 0] == s[1, 0] and s[0, 1] != s[1, 1]


def _time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def test_timing_8mib_page():
    """Prints device time per call (no assertion: a shared GPU's timing is noisy)."""
    page = torch.randn(4 << 20, dtype=torch.bfloat16, device=DEV)        # 8 MiB: LLaDA-8B page
    b = page.view(torch.uint8).reshape(1, -1)
    clone = _time_us(lambda: page.clone())
    ref = _time_us(lambda: K.checksum_rows_reference(b), iters=20)
    line = [f"8 MiB page: clone {clone:.1f} us, torch reference {ref:.1f} us"]
    for block in (1024, 2048, 4096, 8192):
        t = _time_us(lambda block=block: K.checksum_rows_triton(b, block=block))
        line.append(f"kernel block={block}: {t:.1f} us ({8 / 1024 / (t * 1e-6):.0f} GB/s)")
    t = _time_us(lambda: device_checksum(page))
    line.append(f"device_checksum: {t:.1f} us (target < 20 us)")
    rec = torch.randint(0, 256, (16, (8 << 20) + 32), dtype=torch.uint8, device=DEV)
    t = _time_us(lambda: device_checksum_rows(rec[:, :8 << 20]), iters=50)
    line.append(f"16 strided records of 8 MiB: {t:.1f} us ({t / 16:.1f} us a page)")
    print("\n" + "\n".join(line))
