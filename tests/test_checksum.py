"""Record checksums: device_checksum's detection guarantees, its definition against an independent
numpy reference, and xxh3_64 over every kind of host buffer."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from flash_dllm.cache import checksum
from flash_dllm.kernels import checksum as checksum_kernel
from flash_dllm.cache.checksum import (byte_view, device_checksum, device_checksum_rows, xxh3_64,
                                       xxh3_64_multi)

U64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= U64
    return v - (1 << 64) if v >= 1 << 63 else v


def reference(data: bytes) -> tuple[int, int]:
    """The docstring's definition (S1, S2), written independently with numpy uint64 (wrapping)
    arithmetic, where ``>>`` is a logical shift."""
    n = len(data)
    x = np.frombuffer(data + b"\0" * (-n % 4), "<i4").astype(np.int64).view(np.uint64)
    ux = np.frombuffer(data + b"\0" * (-n % 4), "<u4").astype(np.uint64)
    i = np.arange(len(x), dtype=np.uint64)
    u = lambda v: np.uint64(v & U64)  # noqa: E731
    with np.errstate(over="ignore"):
        r = ((i * u(checksum._C1)) ^ (i * u(checksum._C2) + u(checksum._C3))) * u(checksum._C4)
        w = i * np.uint64(2) + np.uint64(1) + r * np.uint64(1 << 33)
        s1 = int((x * w).sum(dtype=np.uint64))
        z = ux ^ (i * u(checksum._C5))
        z = (z ^ (z >> np.uint64(30))) * u(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * u(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
        s2 = int(z.sum(dtype=np.uint64))
    return (_signed(s1 + n * (checksum._C_LEN & U64)), _signed(s2 + n * (checksum._C_LEN2 & U64)))


def mix64_python(v: int) -> int:
    """splitmix64's finaliser on a Python int (unbounded ints, masked: a third implementation)."""
    v &= U64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & U64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & U64
    return v ^ (v >> 31)


def u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 1023, 4096, 4099])
def test_device_checksum_matches_definition_and_is_deterministic(n):
    data = np.random.default_rng(n).bytes(n)
    got = device_checksum(u8(data))
    assert got.dtype == torch.int64 and got.shape == (2,) and got.device.type == "cpu"
    assert tuple(got.tolist()) == reference(data) == tuple(device_checksum(u8(data)).tolist())


def test_mix64_matches_splitmix64():
    vals = [0, 1, 2, 2**31, 2**32 - 1, 2**63, U64, 0x0123456789ABCDEF, 0x9E3779B97F4A7C15]
    got = checksum.mix64(torch.tensor([_signed(v) for v in vals], dtype=torch.int64))
    assert [v & U64 for v in got.tolist()] == [mix64_python(v) for v in vals]
    assert mix64_python(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF   # splitmix64(seed 0), 1st


def test_device_checksum_views_bytes_of_any_dtype_and_layout():
    t = torch.randn(6, 10, dtype=torch.float32)
    raw = t.numpy().tobytes()
    assert tuple(device_checksum(t).tolist()) == reference(raw)
    assert tuple(device_checksum(t.to(torch.bfloat16)).tolist()) == reference(
        t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    col = t[:, 3]                                       # non-contiguous: logical-order bytes
    assert tuple(device_checksum(col).tolist()) == reference(col.contiguous().numpy().tobytes())
    b = u8(raw)[1:]                                     # storage offset not 4-byte aligned
    assert tuple(device_checksum(b).tolist()) == reference(raw[1:])
    assert tuple(device_checksum(t[2, 3]).tolist()) == reference(t[2, 3].numpy().tobytes())


def test_device_checksum_length_is_folded_in():
    # zero padding alone would make b"abc" and b"abc\0" collide, in both lanes
    a, b = device_checksum(u8(b"abc")), device_checksum(u8(b"abc\0"))
    assert (a != b).all()


def test_chunking_does_not_change_the_value(monkeypatch):
    data = np.random.default_rng(1).bytes(40_003)
    whole = device_checksum(u8(data)).tolist()
    monkeypatch.setattr(checksum_kernel, "CHUNK_WORDS", 7)   # many column and row chunks
    assert device_checksum(u8(data)).tolist() == whole
    rows = torch.from_numpy(np.frombuffer(np.random.default_rng(2).bytes(13 * 101),
                                          np.uint8).reshape(13, 101).copy())
    monkeypatch.setattr(checksum_kernel, "CHUNK_WORDS", 5)   # row chunks of 5, column chunks of 1
    got = device_checksum_rows(rows)
    assert [tuple(r) for r in got.tolist()] == [reference(rows[r].numpy().tobytes())
                                                for r in range(13)]


def test_rows_equal_per_row_checksums():
    t = torch.randint(0, 256, (9, 3, 7), dtype=torch.uint8)
    got = device_checksum_rows(t)
    assert got.shape == (9, 2) and got.dtype == torch.int64
    assert got.tolist() == [device_checksum(t[r]).tolist() for r in range(9)]
    assert device_checksum_rows(torch.empty(0, 5)).shape == (0, 2)
    rec = torch.randint(0, 256, (5, 64 + 40 + 32), dtype=torch.uint8)    # records: row ranges
    for a, b in ((0, 64), (64, 104), (0, 104), (3, 50)):
        assert device_checksum_rows(rec[:, a:b]).tolist() == \
            [list(reference(rec[r, a:b].numpy().tobytes())) for r in range(5)]


def _flip_batches(base: torch.Tensor, batch: int):
    """Yield (copies of base with one bit flipped each, bit positions), all 8 * len(base) bits."""
    nbits = base.numel() * 8
    for start in range(0, nbits, batch):
        k = torch.arange(start, min(start + batch, nbits))
        flipped = base.repeat(len(k), 1)                          # [batch, nbytes]
        flipped[torch.arange(len(k)), k // 8] ^= (1 << (k % 8)).to(torch.uint8)
        yield flipped, k


def test_every_single_bit_flip_is_detected():
    base = torch.from_numpy(np.frombuffer(np.random.default_rng(3).bytes(4096),
                                          np.uint8).copy())
    want = device_checksum(base)
    seen = 0
    for flipped, k in _flip_batches(base, 4096):
        sums = device_checksum_rows(flipped)                       # [batch, 2]
        assert not (sums[:, 0] == want[0]).any(), "S1 (proved) missed a flip"
        assert not (sums[:, 1] == want[1]).any()
        seen += len(k)
    assert seen == 32768


def test_word_swaps_and_single_word_changes_are_detected():
    rng = np.random.default_rng(4)
    base = torch.from_numpy(np.frombuffer(rng.bytes(4096), np.int32).copy())   # 1024 words
    want = device_checksum(base)[0]                                 # S1: the proved lane
    i = torch.from_numpy(rng.integers(0, 1024, 4000))
    j = torch.from_numpy(rng.integers(0, 1024, 4000))
    keep = base[i] != base[j]                                      # swaps of unequal words
    i, j = i[keep], j[keep]
    swapped = base.repeat(len(i), 1)                               # [swaps, words]
    rows = torch.arange(len(i))
    swapped[rows, i], swapped[rows, j] = base[j], base[i]
    assert not bool((device_checksum_rows(swapped)[:, 0] == want).any())
    changed = base.repeat(1000, 1)                                 # any one-word change
    pos = torch.from_numpy(rng.integers(0, 1024, 1000))
    delta = torch.from_numpy(rng.integers(1, 2**32, 1000)).to(torch.int32)
    changed[torch.arange(1000), pos] += delta
    assert not bool((device_checksum_rows(changed)[:, 0] == want).any())


def _undetected(sums: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (sums == want).all(dim=1)


def test_reviewers_four_sign_flips_are_detected():
    """+,-,-,+ flips of bit 31 at words i, i+1, j, j+1 cancel in S1 (2^31 times a multiple of
    2^33 plus (2i+1) - (2i+3) - (2j+1) + (2j+3) = 0): four bf16 sign flips. S2 sees them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31 - 1, (4096,), dtype=torch.int32, generator=g)
    i, j = 100, 3000
    x[i] |= -2**31                                      # words i, j+1 negative, i+1, j not:
    x[j + 1] |= -2**31                                  # the deltas are +2^31, -2^31, -2^31, +2^31
    x[i + 1] &= 0x7FFFFFFF
    x[j] &= 0x7FFFFFFF
    y = x.clone()
    for k in (i, i + 1, j, j + 1):
        y[k] ^= -2**31
    a, b = device_checksum(x), device_checksum(y)
    assert a[0] == b[0]                                 # S1 alone: blind to this pattern
    assert a[1] != b[1]                                 # the checksum is not
    assert tuple(b.tolist()) == reference(y.numpy().tobytes())


def test_structured_multi_word_sign_and_exponent_flips_are_detected():
    """Random structured patterns: 2-4 words (often adjacent pairs), each flipping the same high
    bit(s) (fp32 / bf16 signs and exponent bits), any signs. S1 misses a share of them."""
    rng = np.random.default_rng(5)
    base = torch.from_numpy(rng.integers(-2**31, 2**31, 2048).astype(np.int32))  # 2048 words
    want = device_checksum(base)
    bits = [31, 30, 29, 28, 23, 24, 15, 14, 7]          # fp32 sign/exponent, bf16 (both halves)
    trials, s1_missed = 6000, 0
    flipped = base.repeat(trials, 1)                    # [trials, words]
    for t in range(trials):
        i, j = rng.integers(0, 2047, 2)
        words = [i, i + 1, j, j + 1][: int(rng.integers(2, 5))]
        mask = 0
        for b in rng.choice(bits, int(rng.integers(1, 3)), replace=False):
            mask |= 1 << int(b)
        for w in set(int(v) for v in words):
            flipped[t, w] ^= np.int32(np.uint32(mask).view(np.int32))
    changed = (flipped != base).any(dim=1)
    sums = device_checksum_rows(flipped)
    assert not _undetected(sums[changed], want).any()
    s1_missed = int((sums[changed, 0] == want[0]).sum())
    assert s1_missed > 0                                # the patterns S2 was added for
    # the reviewer's pattern at every high bit and many (i, j): S1 cancels at bits 30-31
    i = torch.arange(0, 1000, 7)
    j = i + 1001
    for b in (28, 30, 31):
        d = 1 << b
        y = base.repeat(len(i), 1).to(torch.int64)      # exact +d, -d, -d, +d deltas (wrapped)
        r = torch.arange(len(i))
        for k, sgn in ((i, 1), (i + 1, -1), (j, -1), (j + 1, 1)):
            y[r, k] += sgn * d
        y = ((y + 2**31) % 2**32 - 2**31).to(torch.int32)
        sums = device_checksum_rows(y)
        assert not _undetected(sums, want).any()


def test_device_checksum_rejects_non_tensors():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        device_checksum(b"abc")


# ----------------------------------------------------------------------------------------- xxh3
def test_hash_backend_is_reported():
    assert checksum.HASH_NAME in ("xxh3_64", "crc32")


@pytest.mark.parametrize("n", [0, 1, 3, 4097])
def test_xxh3_agrees_across_buffer_kinds(n):
    data = np.random.default_rng(n).bytes(n)
    h = xxh3_64(data)
    assert isinstance(h, int) and 0 <= h < 2**64
    assert xxh3_64(bytearray(data)) == h == xxh3_64(memoryview(data))
    assert xxh3_64(np.frombuffer(data, np.uint8)) == h
    assert xxh3_64(u8(data)) == h
    mm = mmap.mmap(-1, max(n, 1))
    mm[:n] = data
    assert xxh3_64(memoryview(mm)[:n]) == h
    assert xxh3_64(data) == xxh3_64(data)
    assert xxh3_64_multi(data[: n // 3], data[n // 3:]) == h


def test_xxh3_of_typed_tensors_and_arrays_hashes_their_bytes():
    t = torch.randn(5, 8)
    raw = t.numpy().tobytes()
    assert xxh3_64(t) == xxh3_64(raw) == xxh3_64(t.numpy())
    assert xxh3_64(t.to(torch.bfloat16)) == xxh3_64(t.to(torch.bfloat16).view(torch.uint8))
    assert xxh3_64(t[:, 1]) == xxh3_64(t[:, 1].contiguous().numpy().tobytes())   # strided
    assert xxh3_64(raw) != xxh3_64(raw[:-1] + bytes([raw[-1] ^ 1]))


def test_byte_view_writable_aliases_the_target():
    t = torch.zeros(4, dtype=torch.int32)
    byte_view(t, writable=True)[:4] = b"\x01\x00\x00\x00"
    assert t.tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="writable"):
        byte_view(b"abc", writable=True)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(t[::2], writable=True)
