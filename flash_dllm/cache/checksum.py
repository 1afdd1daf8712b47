"""Checksums for KV page records that leave the GPU (no torch.cuda here).

Two checksums, because the two places that verify a record have different budgets:

- ``device_checksum`` runs where the bytes are, at memory bandwidth (a Triton reduction kernel on
  CUDA, ``kernels/checksum.py``; wrapping torch ops on the CPU): a page moved GPU -> pinned host
  -> GPU is checked on the GPU when it arrives, with no host sync. Hashing on the host instead
  would cap every L0 <-> L1 move at CPU hashing speed. It is 128 bits, two int64 lanes of
  wrapping sums over the record's 32-bit words, so the result is the same on the CPU and on CUDA
  whatever order the reduction runs in: a weighted sum that provably catches the corruptions a
  copy makes (a flipped bit, a changed word, two swapped words: see the proof in its docstring),
  and a sum of nonlinearly mixed words that catches structured multi-word errors the weighted sum
  lets cancel. It is not a cryptographic hash and is not meant to stop an adversary.
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

# The definition's constants and the implementations live with the kernel (kernels/checksum.py);
# re-exported here for the proofs below and for tests.
from flash_dllm.kernels.checksum import (  # noqa: F401
    _C1,
    _C2,
    _C3,
    _C4,
    _C5,
    _C_LEN,
    _C_LEN2,
    _M1,
    _M2,
    MAX_CHECKSUM_BYTES,
    checksum_rows,
    mix64,
)

try:
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - the package is a declared dependency
    _xxhash = None

HASH_NAME = "xxh3_64" if _xxhash is not None else "crc32"


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
def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """t [R, ...] (any dtype, any device) -> uint8 [R, nbytes per row] in logical order, a view
    whenever each row's bytes are contiguous (rows may be strided, e.g. a column range of a
    batch of records); else a copy."""
    rows = t.shape[0]
    t = t.detach()
    flat = t.reshape(rows, -1)                      # a view when possible
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    if flat.dtype == torch.uint8:
        return flat
    if flat.shape[1] == 1 and flat.stride(1) != 1:
        flat = flat.as_strided(flat.shape, (flat.stride(0), 1))
    return flat.view(torch.uint8)


def device_checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] checksum ``(S1, S2)`` of ``t``'s bytes, computed on ``t``'s device with no host
    sync (a Triton kernel on CUDA, wrapping torch ops on the CPU: bit-identical).

    Definition. Read the bytes (logical order) as little-endian signed int32 words x_0..x_{N-1},
    the last one zero-padded when the length is not a multiple of 4, and let u_i = x_i mod 2^32.
    With all arithmetic mod 2^64 (int64 wrapping) and n = nbytes:

    - ``S1 = sum_i x_i * w_i + n * C_LEN``, ``w_i = (2i + 1) + 2^33 * r_i``: the first term is the
      position sum ``sum_i x_i (2i + 1)``, the second ``2^33 * sum_i x_i r_i`` adds a
      pseudo-random position hash ``r_i = ((i C1) ^ (i C2 + C3)) C4``, and ``C_LEN`` folds in
      the length;
    - ``S2 = sum_i mix64(u_i ^ (i * C5)) + n * C_LEN2``, with ``mix64`` splitmix64's finaliser
      (xor-shift-multiply, a bijection of 64-bit values).

    Wrapping addition is associative and commutative, so chunking and reduction order (CPU loop,
    CUDA partial sums) cannot change the value: CPU and CUDA agree bit for bit.

    Why two lanes. S1 is linear in the words, and its proofs (below) cover the corruptions a copy
    makes. But a linear sum lets structured multi-word errors cancel: flipping bit 31 of words
    i, i+1, j, j+1 in the pattern +,-,-,+ changes S1 by 2^31 (w_i - w_{i+1} - w_j + w_{j+1}),
    which is 0 mod 2^64 because the 2^33 r terms vanish when multiplied by 2^31 and the 2i + 1
    terms cancel: four bf16 sign flips went undetected. S2 runs every word through a nonlinear
    mixer, so such patterns change it except with probability ~2^-64 (a heuristic, not a proof).
    (Until S2 was added the checksum was S1 alone, one int64.)

    Proof that S1 catches the corruptions of a copy (inputs of the same length, N < 2^31 words,
    i.e. below ``MAX_CHECKSUM_BYTES``; write v(a) for the number of trailing zero bits of a != 0,
    so a is nonzero mod 2^64 iff v(a) < 64):

    - Every weight is odd: 2i + 1 is odd and 2^33 r_i is even.
    - Any change of one word x_i -> x_i + d (d != 0) changes S1 by d * w_i. As |d| < 2^32,
      v(d) <= 31, and w_i is odd, so v(d * w_i) = v(d) <= 31 < 64: S1 changes. A single-bit flip
      is the case d = ±2^b (b <= 31, the sign bit included).
    - A swap of words i != j with x_i != x_j changes S1 by (x_j - x_i) * (w_i - w_j). Here
      v(x_j - x_i) <= 31 as above, and w_i - w_j = 2(i - j) + 2^33 (r_i - r_j) with
      v(2(i - j)) = 1 + v(i - j) <= 31 because 0 < |i - j| < 2^31; the second part is a multiple of
      2^33, so it cannot cancel those low bits: v(w_i - w_j) <= 31. Hence v(product) <= 62 < 64.

    It is not a cryptographic hash and is not meant to stop an adversary.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    flat = t.detach().reshape(-1)
    if flat.numel() > 1 and flat.stride(0) != 1:
        flat = flat.contiguous()
    return device_checksum_rows(flat.reshape(1, -1) if flat.numel() else
                                flat.new_empty((1, 0)))[0]


def device_checksum_rows(t: torch.Tensor) -> torch.Tensor:
    """int64 [R, 2]: ``device_checksum(t[r])`` for every row r of ``t`` (shape [R, ...]) in one
    pass, e.g. a group of packed page records moved by one copy. Rows are read in place when
    each row's bytes are contiguous (any row stride, e.g. ``rec[:, a:b]`` of a batch of
    records). No host sync."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise ValueError(f"t must be a tensor of shape [rows, ...], got {t!r:.60}")
    rows = t.shape[0]
    b = _row_bytes(t) if rows else t.new_empty((0, 0), dtype=torch.uint8)
    if b.shape[1] >= MAX_CHECKSUM_BYTES:
        raise ValueError(f"each row must be smaller than {MAX_CHECKSUM_BYTES} bytes for the "
                         f"checksum's guarantees, got {b.shape[1]}")
    return checksum_rows(b)
