"""The record checksum's Triton kernel (kernels/checksum.py) against its PyTorch reference under
the interpreter: odd lengths (a partial last word), many chunks, rows read in place at a stride,
unaligned rows (copied), extreme words, and the cancelling pattern the second lane catches."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flash_dllm.kernels import checksum as K
from flash_dllm.kernels._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not (HAS_TRITON and K.INTERPRET),
                                reason="needs triton under TRITON_INTERPRET=1")


def _rand(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n,block", [(n, blk) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 63, 64, 65,
                                                          66, 67) for blk in (4, 16, None)]
                         + [(1023, 64), (4097, 256), (4097, None)])
def test_kernel_equals_reference_odd_lengths_and_chunks(n, block):
    b = _rand(3, n, seed=n)
    got = K.checksum_rows_triton(b, block=block)
    assert got.dtype == torch.int64 and got.shape == (3, 2)
    assert torch.equal(got, K.checksum_rows_reference(b))


def test_kernel_many_chunks_and_extreme_words():
    b = _rand(2, 10_003, seed=1)                           # 2501 words: 40 chunks of 64
    assert torch.equal(K.checksum_rows_triton(b, block=64), K.checksum_rows_reference(b))
    ext = torch.tensor([[0xFF] * 4 * 33 + [0x80, 0xFF, 0xFF],       # -1 words, a partial word
                        [0x00, 0x00, 0x00, 0x80] * 33 + [0, 0, 0x80],   # INT32_MIN words
                        [0] * (4 * 33 + 3)], dtype=torch.uint8)
    assert torch.equal(K.checksum_rows_triton(ext, block=8), K.checksum_rows_reference(ext))


class _Spy:
    """Stands in for the jitted kernel: records the tensor each launch reads, then launches."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(src, *args, **kw):
            self.seen.append((src.data_ptr(), src.shape))
            return self.kernel[grid](src, *args, **kw)
        return launch


def test_strided_rows_are_read_in_place(monkeypatch):
    """Row ranges of a batch of records (row stride a multiple of 4 bytes), odd widths
    included, are checksummed without a copy; unaligned ones through an aligned copy."""
    spy = _Spy(K._checksum_kernel)
    monkeypatch.setattr(K, "_checksum_kernel", spy)
    rec = _rand(6, 136, seed=2)                            # records of 136 B: 104 + 32
    for a, b in ((0, 104), (104, 136), (0, 103), (4, 99), (8, 9)):
        view = rec[:, a:b]
        got = K.checksum_rows_triton(view, block=8)
        assert torch.equal(got, K.checksum_rows_reference(view.contiguous()))
        assert spy.seen[-1] == (view.data_ptr(), view.shape)           # read in place
    typed = torch.randn(5, 3, 12)[:, 1]                    # float rows at a stride of 144 B
    view = typed.view(torch.uint8)
    assert torch.equal(K.checksum_rows_triton(view, block=4),
                       K.checksum_rows_reference(view.contiguous()))
    assert spy.seen[-1][0] == view.data_ptr()
    for a in (1, 2, 3):                                    # start not 4-byte aligned: a copy
        view = rec[:, a:a + 50]
        assert torch.equal(K.checksum_rows_triton(view, block=4),
                           K.checksum_rows_reference(view.contiguous()))
        assert spy.seen[-1][0] != view.data_ptr()
    odd = _rand(4, 133, seed=3)                            # row stride 133: a copy too
    assert torch.equal(K.checksum_rows_triton(odd, block=16), K.checksum_rows_reference(odd))


def test_empty_inputs_and_bad_arguments():
    assert torch.equal(K.checksum_rows_triton(torch.empty(3, 0, dtype=torch.uint8)),
                       torch.zeros(3, 2, dtype=torch.int64))
    assert K.checksum_rows_triton(torch.empty(0, 5, dtype=torch.uint8)).shape == (0, 2)
    assert torch.equal(K.checksum_rows_reference(torch.empty(3, 0, dtype=torch.uint8)),
                       torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="block must be a power of 2"):
        K.checksum_rows_triton(_rand(1, 8, 0), block=6)
    with pytest.raises(ValueError, match="uint8 tensor"):
        K.checksum_rows_triton(torch.zeros(2, 4, dtype=torch.int32))
    b = _rand(2, 77, seed=4)                               # CPU dispatch: the reference
    assert torch.equal(K.checksum_rows(b), K.checksum_rows_reference(b)) and K.op is K.checksum_rows


def test_kernel_catches_the_cancelling_sign_flips():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31 - 1, (1, 1024), dtype=torch.int32, generator=g).repeat(2, 1)
    i, j = 10, 700
    x[:, [i, j + 1]] |= -2**31
    x[:, [i + 1, j]] &= 0x7FFFFFFF
    x[1, [i, i + 1, j, j + 1]] ^= -2**31                    # row 1: row 0, four signs flipped
    got = K.checksum_rows_triton(x.view(torch.uint8), block=128)
    assert torch.equal(got, K.checksum_rows_reference(x.view(torch.uint8)))
    assert got[0, 0] == got[1, 0] and got[0, 1] != got[1, 1]


def test_kernel_r_in_int32_equals_the_int64_definition():
    """The kernel computes r_i in wrapping int32 (only r_i mod 2^31 reaches S1): check that
    shortcut against the int64 weights at indices near 2^31, where i * C wraps in both."""
    i = torch.tensor([0, 1, 2**20 + 3, 2**31 - 2, 2**31 - 1], dtype=torch.int64)
    r64 = torch.bitwise_xor(i * K._C1, i * K._C2 + K._C3) * K._C4
    i32 = i.to(torch.int32)
    r32 = torch.bitwise_xor(i32 * K._i32(K._C1), i32 * K._i32(K._C2) + K._i32(K._C3)) * \
        K._i32(K._C4)
    assert torch.equal(r64 << 33, r32.to(torch.int64) << 33)
    assert np.array_equal((r64 & 0x7FFFFFFF).numpy(), (r32.to(torch.int64) & 0x7FFFFFFF).numpy())
