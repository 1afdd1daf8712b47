"""``engine/block_summary``: the Python rows (small steps) and numpy (large ones) give the same
summary of a step's active blocks on every input: random batches of blocks with padding
columns, prompt slots on a block grid, MASK and several end-of-answer ids, including the
hand-picked corner cases (a stop id in the prompt slots, an all-MASK block, a stop at slot 0)."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_dllm.engine.block_summary import summarize, summarize_numpy, summarize_rows

MASK, STOPS = 9, (7, 8)


@st.composite
def batches(draw):
    B = draw(st.integers(0, 6))                     # (0: a step whose requests all failed)
    W = draw(st.integers(1, 12))
    lens = [draw(st.integers(1, W)) for _ in range(B)]
    leads = [draw(st.integers(0, n - 1)) for n in lens]
    rows = [[draw(st.sampled_from([MASK, 7, 8, 1, 2, 3])) for _ in range(W)] for _ in range(B)]
    dtype = draw(st.sampled_from([np.int64, np.int32]))
    stops = draw(st.sampled_from([(), (7,), STOPS]))
    return np.array(rows, dtype=dtype).reshape(B, W), lens, leads, stops


@settings(max_examples=400, deadline=None)
@given(batches())
def test_rows_and_numpy_agree(case):
    blocks, lens, leads, stops = case
    assert summarize_rows(blocks.tolist(), lens, leads, MASK, stops) == \
        summarize_numpy(blocks, lens, leads, MASK, stops)


def test_corner_cases():
    blocks = np.array([[7, 1, MASK, 2],            # a stop id in the prompt slot: no end
                       [MASK, MASK, MASK, MASK],   # nothing committed
                       [8, 1, 2, 3],               # a stop first
                       [1, 2, 0, 0]])              # two real slots, two padding columns
    lens, leads = [4, 4, 4, 2], [1, 0, 0, 0]
    want = ([1, 4, 0, 0], [False, False, True, False], [2, 0, 0, 2], [True, False, True, True])
    for fn in (summarize_rows, summarize_numpy):
        got = fn(blocks.tolist() if fn is summarize_rows else blocks, lens, leads, MASK, STOPS)
        assert got == want
    assert summarize(blocks, lens, leads, MASK, STOPS) == want
    big = np.tile(blocks, (70, 1))                  # past SMALL_SLOTS: the numpy path
    assert summarize(big, lens * 70, leads * 70, MASK, STOPS) == tuple(x * 70 for x in want)
