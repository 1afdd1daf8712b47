"""Checksums for KV page records that leave the GPU (no torch.cuda here).

Two checksums, because the two places that verify a record have different budgets:

- ``device_checksum`` runs where the bytes are, at memory bandwidth, with plain torch ops: a page
  moved GPU -> pinned host -> GPU is checked on the GPU when it arrives, with no host sync. Hashing
  on the host instead would cap every L0 <-> L1 move at CPU hashing speed. It is a weighted sum of
  the record's 32-bit words (wrapping int64 arithmetic), so the result is the same on the CPU and
  on CUDA whatever order the reduction runs in, and provably catches the corruptions a copy makes:
  a flipped bit, a changed word, two swapped words (see the proof in its docstring). It is not a
  cryptographic hash and is not meant to stop an adversary.
- ``xxh3_64`` is the disk record's checksum: the disk tier (L2) reads and writes through the host
  anyway, and xxh3 hashes at many GB/s per core. ``HASH_NAME`` says whether the ``xxhash`` package
  is active or the ``zlib.crc32`` fallback (32 bits, slower, only if ``xxhash`` cannot be imported);
  records are only ever verified by the process that wrote them, so the two never mix.

``byte_view`` turns bytes-like objects, numpy arrays and CPU tensors into a flat ``memoryview`` of
their bytes (logical order, zero-copy when contiguous); the stores use it for payloads and buffers.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - the package is a declared dependency
    _xxhash = None

HASH_NAME = "xxh3_64" if _xxhash is not None else "crc32"

# 2M int32 words per chunk: each int64 temporary of a chunk (words, index, weights, product) is
# 16 MiB, so all of them together stay within 64 MiB whatever the record size.
CHUNK_WORDS = 1 << 21
# The swap proof below needs fewer than 2^31 words (8 GiB); records are pages of a few MiB.
MAX_CHECKSUM_BYTES = 1 << 33


def _i64(v: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch scalars are signed)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


# Odd 64-bit mixing constants (golden ratio, splitmix64, murmur3 finalizer): any odd values work.
_C1 = _i64(0x9E3779B97F4A7C15)
_C2 = _i64(0xBF58476D1CE4E5B9)
_C3 = _i64(0x94D049BB133111EB)
_C4 = _i64(0xFF51AFD7ED558CCD)
_C_LEN = _i64(0xC4CEB9FE1A85EC53)
_SHIFT = 1 << 33                      # the second term lives above bit 32 of every weight


def byte_view(data, writable: bool = False) -> memoryview:
    """A flat 1-D ``memoryview`` (format ``B``) of ``data``'s bytes in logical order.

    ``data``: bytes / bytearray / memoryview / mmap, a numpy array, or a CPU tensor of any dtype.
    Zero-copy when ``data`` is contiguous; a non-contiguous input is copied, so ``writable=True``
    (the view must alias ``data``) requires a contiguous, writable input and raises otherwise.
    """
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ValueError(f"data must be a CPU tensor (host bytes), got device {data.device}; "
                             f"use device_checksum for device tensors")
        t = data.detach()
        if writable and not t.is_contiguous():
            raise ValueError("data must be a contiguous tensor to be written into")
        t = t.contiguous().reshape(-1)
        data = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy()
    if isinstance(data, np.ndarray):
        if writable and not (data.flags.c_contiguous and data.flags.writeable):
            raise ValueError("data must be a C-contiguous, writable array to be written into")
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    mv = memoryview(data)
    if writable and mv.readonly:
        raise ValueError(f"data must be writable, got a read-only {type(data).__name__}")
    if not mv.c_contiguous:
        if writable:
            raise ValueError("data must be contiguous to be written into")
        mv = memoryview(mv.tobytes())
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def xxh3_64(data) -> int:
    """64-bit xxh3 of ``data``'s bytes (``byte_view`` inputs); crc32 under the fallback."""
    return xxh3_64_multi(data)


def xxh3_64_multi(*parts) -> int:
    """``xxh3_64`` of the concatenation of ``parts`` without concatenating them."""
    if _xxhash is None:  # pragma: no cover - fallback
        crc = 0
        for p in parts:
            crc = zlib.crc32(byte_view(p), crc)
        return crc
    if len(parts) == 1:
        return _xxhash.xxh3_64_intdigest(byte_view(parts[0]))
    h = _xxhash.xxh3_64()
    for p in parts:
        h.update(byte_view(p))
    return h.intdigest()


# ------------------------------------------------------------------------------ device checksum
def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: w_i = (2i + 1) + 2^33 * r_i for word indices i in [start, start + n)."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    # r_i: a position hash (xor of two multiplies, then a multiply): nonlinear in i, so error
    # patterns that cancel in the linear term (Δ at word 0 and -Δ/3 at word 1) do not cancel here.
    r = torch.bitwise_xor(i * _C1, i * _C2 + _C3) * _C4
    return i * 2 + 1 + r * _SHIFT


def _device_bytes(t: torch.Tensor) -> torch.Tensor:
    """t (any dtype, any shape, any device) -> uint8 [nbytes] in logical order, on t's device."""
    flat = t.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def device_checksum(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 checksum of ``t``'s bytes, computed on ``t``'s device with no host sync.

    Definition. Read the bytes (logical order) as little-endian signed int32 words x_0..x_{N-1},
    the last one zero-padded when the length is not a multiple of 4. With all arithmetic mod 2^64
    (int64 wrapping), ``S = sum_i x_i * w_i + nbytes * C``, where ``w_i = (2i + 1) + 2^33 * r_i``:
    the first term is the position sum ``sum_i x_i (2i + 1)``, the second ``2^33 * sum_i x_i r_i``
    adds a pseudo-random position hash ``r_i`` (any int64 sequence), and ``C`` folds in the length.
    Wrapping addition is associative and commutative, so chunking and reduction order (CPU loop,
    CUDA tree reduction) cannot change the value: CPU and CUDA agree bit for bit.

    Proof that the corruptions of a copy are caught (inputs of the same length, N < 2^31 words,
    i.e. below ``MAX_CHECKSUM_BYTES``; write v(a) for the number of trailing zero bits of a != 0,
    so a is nonzero mod 2^64 iff v(a) < 64):

    - Every weight is odd: 2i + 1 is odd and 2^33 r_i is even.
    - Any change of one word x_i -> x_i + d (d != 0) changes S by d * w_i. As |d| < 2^32,
      v(d) <= 31, and w_i is odd, so v(d * w_i) = v(d) <= 31 < 64: S changes. A single-bit flip is
      the case d = ±2^b (b <= 31, the sign bit included).
    - A swap of words i != j with x_i != x_j changes S by (x_j - x_i) * (w_i - w_j). Here
      v(x_j - x_i) <= 31 as above, and w_i - w_j = 2(i - j) + 2^33 (r_i - r_j) with
      v(2(i - j)) = 1 + v(i - j) <= 31 because 0 < |i - j| < 2^31; the second part is a multiple of
      2^33, so it cannot cancel those low bits: v(w_i - w_j) <= 31. Hence v(product) <= 62 < 64.

    Chunked so that the int64 temporaries stay within 64 MiB (``CHUNK_WORDS``).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    return device_checksum_rows(_device_bytes(t).reshape(1, -1))[0]


def device_checksum_rows(t: torch.Tensor) -> torch.Tensor:
    """int64 [R]: ``device_checksum(t[r])`` for every row r of ``t`` (shape [R, ...]) in one pass,
    e.g. a group of packed page records moved by one copy. No host sync."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise ValueError(f"t must be a tensor of shape [rows, ...], got {t!r:.60}")
    rows = t.shape[0]
    b = _device_bytes(t).reshape(rows, -1) if rows else t.new_empty((0, 0), dtype=torch.uint8)
    nbytes = b.shape[1]                                    # b: [R, nbytes] uint8
    if nbytes >= MAX_CHECKSUM_BYTES:
        raise ValueError(f"each row must be smaller than {MAX_CHECKSUM_BYTES} bytes for the "
                         f"checksum's guarantees, got {nbytes}")
    if nbytes % 4:                                         # zero-pad rows to whole words (copies)
        b = torch.cat([b, b.new_zeros((rows, 4 - nbytes % 4))], dim=1)
    if b.numel() == 0:
        words = torch.empty((rows, 0), dtype=torch.int32, device=b.device)
    else:
        try:
            words = b.view(torch.int32)                    # [R, N] int32
        except RuntimeError:                               # storage offset not 4-byte aligned
            words = b.clone().view(torch.int32)
    n = words.shape[1]
    acc = torch.zeros(rows, dtype=torch.int64, device=b.device)
    row_chunk = max(1, min(rows, CHUNK_WORDS))
    col_chunk = max(1, CHUNK_WORDS // row_chunk)
    for c0 in range(0, n, col_chunk):
        w = _weights(c0, min(col_chunk, n - c0), b.device)                 # [cols] int64
        for r0 in range(0, rows, row_chunk):
            x = words[r0:r0 + row_chunk, c0:c0 + col_chunk].to(torch.int64)  # [r, cols]
            acc[r0:r0 + row_chunk] += (x * w).sum(dim=1)
    return acc + _i64(nbytes * _C_LEN)
