"""``layers/paged_index.split_blocks`` (one numpy pass) cuts every step as the per-request loop it
replaced does (``benchmarks/step/split_blocks_cpu.split_blocks_loop``, the reference here):
random batches of contiguous windows (requests with no rows among them, windows that start
mid-block and span several blocks, canvases that end inside a block)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_dllm.layers.paged_index import split_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "step"))
from split_blocks_cpu import split_blocks_loop  # noqa: E402


@st.composite
def steps(draw):
    B = draw(st.integers(1, 24))
    bs = draw(st.sampled_from([1, 2, 4, 8, 32]))
    lens, cu, pos = [], [0], []
    for _ in range(B):
        L = draw(st.integers(1, 80))
        n = draw(st.integers(0, min(L, 20)))
        q0 = draw(st.integers(0, L - n))
        lens.append(L)
        pos.extend(range(q0, q0 + n))
        cu.append(cu[-1] + n)
    width = 6
    table = np.arange(B * width, dtype=np.int32).reshape(B, width)
    return table, lens, np.array(pos, dtype=np.int64), cu, bs


@settings(max_examples=400, deadline=None)
@given(steps())
def test_the_one_pass_split_equals_the_loop(case):
    table, lens, pos, cu, bs = case
    a = split_blocks_loop(table, lens, pos, cu, bs)
    b = split_blocks(table, lens, pos, cu, bs)
    assert np.array_equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
    assert all(isinstance(x, int) for x in b[1] + b[2])
    # every segment's rows lie in one block and see exactly that block's end (or the canvas's)
    for r, n, s, e in zip(b[0][:, 0] // 6, b[1], b[2], b[2][1:]):
        if e > s:
            blk = pos[s:e] // bs
            assert blk.min() == blk.max() and n == min(lens[r], (blk[0] + 1) * bs)


def test_requests_without_rows_keep_their_place():
    pos = np.arange(8)
    cu = [0] * 10 + [8]                     # ten requests, nine without rows, one of 8 rows
    table = np.zeros((10, 2), dtype=np.int32)
    rows, lens, bounds = split_blocks(table, [16] * 10, pos, cu, 4)
    assert len(lens) == 11 and bounds == [0] * 10 + [4, 8] and lens[-2:] == [4, 8]
