"""Record checksums: device_checksum's detection guarantees, its definition against an independent
numpy reference, and xxh3_64 over every kind of host buffer."""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from flash_dllm.cache import checksum
from flash_dllm.cache.checksum import (byte_view, device_checksum, device_checksum_rows, xxh3_64,
                                       xxh3_64_multi)

U64 = (1 << 64) - 1


def reference(data: bytes) -> int:
    """The docstring's definition, written independently with numpy uint64 (wrapping) arithmetic."""
    n = len(data)
    x = np.frombuffer(data + b"\0" * (-n % 4), "<i4").astype(np.int64).view(np.uint64)
    i = np.arange(len(x), dtype=np.uint64)
    u = lambda v: np.uint64(v & U64)  # noqa: E731
    with np.errstate(over="ignore"):
        r = ((i * u(checksum._C1)) ^ (i * u(checksum._C2) + u(checksum._C3))) * u(checksum._C4)
        w = i * np.uint64(2) + np.uint64(1) + r * np.uint64(1 << 33)
        s = int((x * w).sum(dtype=np.uint64))
    s = (s + n * (checksum._C_LEN & U64)) & U64
    return s - (1 << 64) if s >= 1 << 63 else s


def u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 1023, 4096, 4099])
def test_device_checksum_matches_definition_and_is_deterministic(n):
    data = np.random.default_rng(n).bytes(n)
    got = device_checksum(u8(data))
    assert got.dtype == torch.int64 and got.dim() == 0 and got.device.type == "cpu"
    assert int(got) == reference(data) == int(device_checksum(u8(data)))


def test_device_checksum_views_bytes_of_any_dtype_and_layout():
    t = torch.randn(6, 10, dtype=torch.float32)
    raw = t.numpy().tobytes()
    assert int(device_checksum(t)) == reference(raw)
    assert int(device_checksum(t.to(torch.bfloat16))) == reference(
        t.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
    col = t[:, 3]                                       # non-contiguous: logical-order bytes
    assert int(device_checksum(col)) == reference(col.contiguous().numpy().tobytes())
    b = u8(raw)[1:]                                     # storage offset not 4-byte aligned
    assert int(device_checksum(b)) == reference(raw[1:])


def test_device_checksum_length_is_folded_in():
    # zero padding alone would make b"abc" and b"abc\0" collide
    assert int(device_checksum(u8(b"abc"))) != int(device_checksum(u8(b"abc\0")))


def test_chunking_does_not_change_the_value(monkeypatch):
    data = np.random.default_rng(1).bytes(40_003)
    whole = int(device_checksum(u8(data)))
    monkeypatch.setattr(checksum, "CHUNK_WORDS", 7)     # many column and row chunks
    assert int(device_checksum(u8(data))) == whole
    rows = torch.from_numpy(np.frombuffer(np.random.default_rng(2).bytes(13 * 101),
                                          np.uint8).reshape(13, 101).copy())
    monkeypatch.setattr(checksum, "CHUNK_WORDS", 5)     # row chunks of 5, column chunks of 1
    got = device_checksum_rows(rows)
    assert got.tolist() == [reference(rows[r].numpy().tobytes()) for r in range(13)]


def test_rows_equal_per_row_checksums():
    t = torch.randint(0, 256, (9, 3, 7), dtype=torch.uint8)
    assert device_checksum_rows(t).tolist() == [int(device_checksum(t[r])) for r in range(9)]
    assert device_checksum_rows(torch.empty(0, 5)).shape == (0,)


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
    want = int(device_checksum(base))
    seen = 0
    for flipped, k in _flip_batches(base, 4096):
        sums = device_checksum_rows(flipped)
        assert not bool((sums == want).any()), f"undetected flip at bit {k[sums == want].tolist()}"
        seen += len(k)
    assert seen == 32768


def test_word_swaps_and_single_word_changes_are_detected():
    rng = np.random.default_rng(4)
    base = torch.from_numpy(np.frombuffer(rng.bytes(4096), np.int32).copy())   # 1024 words
    want = int(device_checksum(base))
    i = torch.from_numpy(rng.integers(0, 1024, 4000))
    j = torch.from_numpy(rng.integers(0, 1024, 4000))
    keep = base[i] != base[j]                                      # swaps of unequal words
    i, j = i[keep], j[keep]
    swapped = base.repeat(len(i), 1)                               # [swaps, words]
    rows = torch.arange(len(i))
    swapped[rows, i], swapped[rows, j] = base[j], base[i]
    assert not bool((device_checksum_rows(swapped) == want).any())
    changed = base.repeat(1000, 1)                                 # any one-word change
    pos = torch.from_numpy(rng.integers(0, 1024, 1000))
    delta = torch.from_numpy(rng.integers(1, 2**32, 1000)).to(torch.int32)
    changed[torch.arange(1000), pos] += delta
    assert not bool((device_checksum_rows(changed) == want).any())


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
