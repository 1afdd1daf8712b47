"""Record checksum: the two 64-bit lanes of ``cache.checksum.device_checksum`` over rows of bytes.

``checksum_rows(b)`` takes ``b [R, nbytes]`` uint8 (each row's bytes contiguous, rows at any
stride) and returns ``[R, 2]`` int64: per row ``(S1, S2)`` as defined (and proved) in
``cache/checksum.py``. With ``x_i`` the row's little-endian int32 words (the last one
zero-padded), ``u_i = x_i mod 2^32``, ``n = nbytes`` and every operation mod 2^64:

- ``S1 = sum_i x_i * w_i + n * C_LEN`` with ``w_i = (2i + 1) + 2^33 * r_i`` and
  ``r_i = ((i * C1) ^ (i * C2 + C3)) * C4``;
- ``S2 = sum_i mix64(u_i ^ (i * C5)) + n * C_LEN2``, ``mix64`` the splitmix64 finaliser.

Both are wrapping sums of per-word terms, so any chunking and reduction order gives the same bits:
the Triton kernel, the PyTorch reference, CPU and CUDA agree exactly.

Kernel: one program per (row, ``BLOCK`` words) computes both lanes' partial sums in registers,
from the words and their indices (no weight tensors), and writes them to ``partials [R, chunks,
2]``; a torch int64 sum over the chunks (wrapping, like every other sum here) finishes. No host
sync. Rows are read in place: the row start and stride must be multiples of 4 bytes (int32 word
loads); the launcher copies into an aligned buffer otherwise. A row whose length is not a
multiple of 4 ends in a partial word, which the last program of the row assembles from bytes.

NOTE (the kernel's ``r_i``): only ``r_i mod 2^31`` reaches ``S1`` (it is multiplied by 2^33), and
the low 32 bits of a product or sum depend only on the low 32 bits of the operands, so the kernel
computes ``r_i`` in wrapping int32 arithmetic: 3 of its 7 multiplies per word are 32-bit.
"""
from __future__ import annotations

import torch

from flash_dllm.kernels._triton import (HAS_TRITON, check, check_device, describe, interpreting,
                                       use_triton)

INTERPRET = interpreting()  # see _triton: fixed when this module is imported

# 2M int32 words per reference chunk: the reference's int64 temporaries of a chunk are 16 MiB
# each, so they stay within ~128 MiB whatever the record size.
CHUNK_WORDS = 1 << 21
# S1's swap proof needs fewer than 2^31 words (8 GiB); records are pages of a few MiB.
MAX_CHECKSUM_BYTES = 1 << 33
BLOCK_WORDS = 2048          # words per kernel program (8 KiB)


def _i64(v: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch scalars are signed)."""
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _i32(v: int) -> int:
    """The low 32 bits of ``v`` as a signed int32."""
    v &= (1 << 32) - 1
    return v - (1 << 32) if v >= 1 << 31 else v


# Odd 64-bit mixing constants (golden ratio, splitmix64, murmur3 finalizer): any odd values work.
_C1 = _i64(0x9E3779B97F4A7C15)
_C2 = _i64(0xBF58476D1CE4E5B9)
_C3 = _i64(0x94D049BB133111EB)
_C4 = _i64(0xFF51AFD7ED558CCD)
_C_LEN = _i64(0xC4CEB9FE1A85EC53)
_SHIFT = 1 << 33                      # the second term lives above bit 32 of every weight
# S2: position constant, length constant, and splitmix64's finaliser multipliers
_C5 = _i64(0xD6E8FEB86659FD93)
_C_LEN2 = _i64(0x2545F4914F6CDD1D)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


# ---- reference ---------------------------------------------------------------------------------
def _weights(start: int, n: int, device: torch.device) -> torch.Tensor:
    """int64 [n]: w_i = (2i + 1) + 2^33 * r_i for word indices i in [start, start + n)."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    # r_i: a position hash (xor of two multiplies, then a multiply): nonlinear in i, so error
    # patterns that cancel in the linear term (Δ at word 0 and -Δ/3 at word 1) do not cancel here.
    r = torch.bitwise_xor(i * _C1, i * _C2 + _C3) * _C4
    return i * 2 + 1 + r * _SHIFT


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic): mask the sign copies."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits (a bijection of 64-bit values), elementwise."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _check_rows(fn: str, b: torch.Tensor) -> None:
    check(isinstance(b, torch.Tensor) and b.dim() == 2 and b.dtype == torch.uint8,
          f"{fn}: b must be a [rows, nbytes] uint8 tensor, got {describe(b)}")
    check(b.shape[1] < MAX_CHECKSUM_BYTES,
          f"{fn}: each row must be smaller than {MAX_CHECKSUM_BYTES} bytes for the checksum's "
          f"guarantees, got {b.shape[1]}")


def checksum_rows_reference(b: torch.Tensor) -> torch.Tensor:
    """PyTorch reference (CPU, and CUDA without Triton): ``b [R, nbytes]`` uint8 -> ``[R, 2]``
    int64 ``(S1, S2)`` per row. Chunked (``CHUNK_WORDS``) to bound the int64 temporaries."""
    _check_rows("checksum_rows_reference", b)
    rows, nbytes = b.shape
    if nbytes % 4:                                         # zero-pad rows to whole words (copies)
        b = torch.cat([b, b.new_zeros((rows, 4 - nbytes % 4))], dim=1)
    if b.numel() == 0:
        words = torch.empty((rows, 0), dtype=torch.int32, device=b.device)
    else:
        try:
            words = b.view(torch.int32)                    # [R, N] int32
        except RuntimeError:                               # rows not 4-byte aligned
            words = b.contiguous().view(torch.int32)
    n = words.shape[1]
    acc = torch.zeros((rows, 2), dtype=torch.int64, device=b.device)
    row_chunk = max(1, min(rows, CHUNK_WORDS))
    col_chunk = max(1, CHUNK_WORDS // row_chunk)
    for c0 in range(0, n, col_chunk):
        cols = min(col_chunk, n - c0)
        w = _weights(c0, cols, b.device)                                   # [cols] int64
        pos = torch.arange(c0, c0 + cols, dtype=torch.int64, device=b.device) * _C5
        for r0 in range(0, rows, row_chunk):
            x = words[r0:r0 + row_chunk, c0:c0 + cols].to(torch.int64)      # [r, cols]
            acc[r0:r0 + row_chunk, 0] += (x * w).sum(dim=1)
            u = x & 0xFFFFFFFF                                             # unsigned word
            acc[r0:r0 + row_chunk, 1] += mix64(u ^ pos).sum(dim=1)
    acc[:, 0] += _i64(nbytes * _C_LEN)
    acc[:, 1] += _i64(nbytes * _C_LEN2)
    return acc


# ---- Triton ------------------------------------------------------------------------------------
if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _shr64(z, K: tl.constexpr):
        return (z >> K) & ((1 << (64 - K)) - 1)

    @triton.jit
    def _terms(x, i, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
               C5: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr):
        """Per-word terms of both lanes: ``x`` int64 (the sign-extended word), ``i`` int64 index
        (tensors or scalars)."""
        i32 = i.to(tl.int32)                    # i < 2^31; wrapping int32: see the module NOTE
        r = (i32 * C1) ^ (i32 * C2 + C3)
        r = r * C4
        w = i * 2 + 1 + (r.to(tl.int64) << 33)
        t1 = x * w
        u = x & tl.full([], (1 << 32) - 1, tl.int64)          # the unsigned word
        z = u ^ (i * C5)
        z = (z ^ _shr64(z, 30)) * M1
        z = (z ^ _shr64(z, 27)) * M2
        t2 = z ^ _shr64(z, 31)
        return t1, t2

    @triton.jit
    def _checksum_kernel(src_ptr, part_ptr, stride_row, nbytes, n_words, chunks,
                         C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                         C5: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                         C_LEN: tl.constexpr, C_LEN2: tl.constexpr, BLOCK: tl.constexpr,
                         TAIL: tl.constexpr, EVEN: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        row = pid // chunks
        chunk = pid - row * chunks
        # int64 whatever Triton made of the ints (i32, or a constexpr when one equals 1)
        nbytes = tl.zeros((), tl.int64) + nbytes
        n_words = tl.zeros((), tl.int64) + n_words  # whole words; a partial one follows if TAIL
        base = src_ptr + row * stride_row
        i = chunk * BLOCK + tl.arange(0, BLOCK)                      # [BLOCK] int64 word index
        words = base.to(tl.pointer_type(tl.int32))
        if EVEN:                                  # every program has BLOCK whole words
            x = tl.load(words + i).to(tl.int64)
            t1, t2 = _terms(x, i, C1, C2, C3, C4, C5, M1, M2)
            s1 = tl.sum(t1, axis=0)
            s2 = tl.sum(t2, axis=0)
        else:
            m = i < n_words
            x = tl.load(words + i, mask=m, other=0).to(tl.int64)
            t1, t2 = _terms(x, i, C1, C2, C3, C4, C5, M1, M2)
            s1 = tl.sum(t1, axis=0)                                 # x = 0 where masked: 0
            s2 = tl.sum(tl.where(m, t2, 0), axis=0)
        if TAIL:          # the last, partial word (index n_words): its bytes, zero-padded
            last = chunk == chunks - 1
            k = tl.arange(0, 4)
            at = n_words * 4 + k
            # NOTE: `at < lim`, not `... & last`: the interpreter mis-broadcasts scalar bools
            lim = tl.where(last, nbytes, 0)
            v = tl.load(base + at, mask=at < lim, other=0).to(tl.int64)   # uint8: zero-extends
            u = tl.sum(v << (k.to(tl.int64) * 8), axis=0)
            tx = (u << 32) >> 32                                     # the signed word
            e1, e2 = _terms(tx, n_words, C1, C2, C3, C4, C5, M1, M2)
            s1 += tl.where(last, e1, 0)
            s2 += tl.where(last, e2, 0)
        first = chunk == 0
        s1 += tl.where(first, nbytes * C_LEN, 0)
        s2 += tl.where(first, nbytes * C_LEN2, 0)
        tl.store(part_ptr + pid * 2, s1)
        tl.store(part_ptr + pid * 2 + 1, s2)


def checksum_rows_triton(b: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``b [R, nbytes]`` uint8 (row bytes contiguous) -> ``[R, 2]`` int64, as the reference.
    ``block``: words per program (a power of 2). Rows are read in place when their start and
    stride are multiples of 4 bytes, else from an aligned copy."""
    check(HAS_TRITON, "checksum_rows_triton: triton is not importable")
    _check_rows("checksum_rows", b)
    check_device("checksum_rows", INTERPRET, b)
    rows, nbytes = b.shape
    block = block if block is not None else BLOCK_WORDS
    check(block >= 4 and block & (block - 1) == 0,
          f"checksum_rows: block must be a power of 2 >= 4, got {block}")
    if rows == 0 or nbytes == 0:
        return torch.zeros((rows, 2), dtype=torch.int64, device=b.device)
    if nbytes > 1 and b.stride(1) != 1:
        b = b.contiguous()
    stride = b.stride(0) if rows > 1 else 0
    if b.data_ptr() % 4 or stride % 4:                        # word loads need 4-byte alignment
        aligned = b.new_zeros((rows, -(-nbytes // 4) * 4))
        aligned[:, :nbytes] = b
        b, stride = aligned, aligned.stride(0)
    n_words, tail = divmod(nbytes, 4)
    chunks = -(-(n_words + (1 if tail else 0)) // block)
    check(rows * chunks < 2 ** 31, f"checksum_rows: {rows * chunks} programs exceed the grid")
    partials = torch.empty((rows, chunks, 2), dtype=torch.int64, device=b.device)
    _checksum_kernel[(rows * chunks,)](
        b, partials, stride, nbytes, n_words, chunks, C1=_i32(_C1), C2=_i32(_C2), C3=_i32(_C3),
        C4=_i32(_C4), C5=_C5, M1=_M1, M2=_M2, C_LEN=_C_LEN, C_LEN2=_C_LEN2, BLOCK=block,
        TAIL=bool(tail), EVEN=not tail and n_words % block == 0,
        num_warps=4 if block <= 2048 else 8)
    return partials.sum(dim=1) if chunks > 1 else partials[:, 0]


def checksum_rows(b: torch.Tensor) -> torch.Tensor:
    """``[R, 2]`` int64 checksums of the rows of ``b [R, nbytes]`` uint8: the Triton kernel on
    CUDA, the reference otherwise. No host sync."""
    if use_triton(b):
        return checksum_rows_triton(b)
    return checksum_rows_reference(b)


op = checksum_rows   # the one-op-per-file registry name
