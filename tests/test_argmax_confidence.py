"""The greedy-proposal kernel (argmax skipping MASK + softmax probability) against its reference and
against ``decoding.sampling.propose`` at temperature 0, under the interpreter."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.decoding.sampling import RowGroup, propose
from flash_dllm.kernels import argmax_confidence as ac
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and ac.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _logits(N, V, seed, dtype=torch.float32):
    return (torch.randn(N, V, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,block,chunk", [(100, 32, 8192), (257, 64, 64), (64, 64, 64),
                                           (300, 32, 64)])          # 1, 5, 1 and 5 chunks
def test_kernel_matches_reference(dtype, V, block, chunk):
    x = _logits(9, V, seed=V, dtype=dtype)
    exclude = V // 3
    x[2, exclude] = 50.0                      # the excluded id is the max: never proposed ...
    tok, conf = ac.argmax_confidence_triton(x, exclude, block=block, chunk=chunk)
    rtok, rconf = ac.argmax_confidence_reference(x, exclude)
    assert torch.equal(tok, rtok)
    assert (tok != exclude).all()
    torch.testing.assert_close(conf, rconf, rtol=1e-5, atol=1e-6)
    assert conf[2] < 1e-6                     # ... but stays in the normaliser


@needs_interpreter
@pytest.mark.parametrize("chunk", [32, 64, 8192])       # programs of 1 or 2 blocks, or one
def test_ties_go_to_the_lowest_index_across_chunks(chunk):
    x = torch.zeros(3, 96)
    x[0, [5, 70]] = 2.0           # tie in two different blocks of 32
    x[1, [40, 41]] = 2.0          # tie inside one block
    x[2, :] = 1.0                 # all equal, id 0 excluded -> 1
    tok, conf = ac.argmax_confidence_triton(x, exclude=0, block=32, chunk=chunk)
    assert tok.tolist() == [5, 40, 1]
    rtok, rconf = ac.argmax_confidence_reference(x, exclude=0)
    assert torch.equal(tok, rtok)
    torch.testing.assert_close(conf, rconf)


@needs_interpreter
def test_a_row_is_bitwise_the_same_in_any_batch():
    """The chunking follows V, not the rows: one row alone, or among 12, gives the same bits."""
    x = _logits(12, 300, seed=8, dtype=torch.bfloat16)
    tok, conf = ac.argmax_confidence_triton(x, 7, block=32, chunk=64)
    for r in (0, 5, 11):
        t1, c1 = ac.argmax_confidence_triton(x[r:r + 1], 7, block=32, chunk=64)
        assert torch.equal(t1, tok[r:r + 1]) and torch.equal(c1, conf[r:r + 1])


@needs_interpreter
def test_strided_rows_and_empty():
    big = _logits(4, 150, seed=3)
    tok, conf = ac.argmax_confidence_triton(big[:, :120], None, block=64)
    rtok, rconf = ac.argmax_confidence_reference(big[:, :120])
    assert torch.equal(tok, rtok)
    torch.testing.assert_close(conf, rconf)
    t, c = ac.argmax_confidence_triton(torch.zeros(0, 10))
    assert t.shape == (0,) and c.shape == (0,)


def test_reference_is_propose_at_temperature_zero():
    x = _logits(6, 50, seed=4)
    groups = [RowGroup(0, 4, 0.0, 0, 1.0, None), RowGroup(4, 6, 0.0, 0, 1.0, None)]
    t1, c1 = propose(x, groups, forbid=7)
    t2, c2 = ac.argmax_confidence_reference(x, 7)
    assert torch.equal(t1, t2) and torch.equal(c1, c2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="exclude"):
        ac.argmax_confidence_triton(torch.zeros(2, 8), exclude=8)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        ac.argmax_confidence_triton(torch.zeros(8))
    with pytest.raises(ValueError, match="chunk"):
        ac.argmax_confidence_triton(torch.zeros(2, 8), block=64, chunk=96)


def test_greedy_rows_do_not_depend_on_sampled_neighbours():
    x = _logits(6, 50, seed=9)
    greedy = [RowGroup(0, 6, 0.0, 0, 1.0, None)]
    mixed = [RowGroup(0, 3, 0.0, 0, 1.0, None),
             RowGroup(3, 6, 0.7, 0, 1.0, torch.Generator().manual_seed(0))]
    t1, c1 = propose(x, greedy, forbid=7)
    t2, c2 = propose(x, mixed, forbid=7)
    assert torch.equal(t1[:3], t2[:3]) and torch.equal(c1[:3], c2[:3])
    assert (t2 != 7).all()
    ref = torch.softmax(x[3:].float(), -1).gather(-1, t2[3:, None]).squeeze(-1)
    assert torch.equal(c2[3:], ref)
