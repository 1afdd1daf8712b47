"""SegmentAllocator: property tests (a hypothesis state machine against a plain model), errors, and
the fragmentation simulation."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from flash_dllm.distributed.segment_allocator import SegmentAllocator
from flash_dllm.distributed.segment_sim import fragmentation_figure


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences; the model is the dict of live segments."""

    def __init__(self) -> None:
        super().__init__()
        self.a: SegmentAllocator | None = None
        self.live: dict[int, int] = {}          # offset -> reserved size

    @initialize(align=st.sampled_from([1, 2, 8]), blocks=st.integers(1, 64))
    def make(self, align: int, blocks: int) -> None:
        self.a = SegmentAllocator(blocks * align, align)

    @rule(frac=st.floats(0.0, 1.0), small=st.booleans())
    def alloc(self, frac: float, small: bool) -> None:
        a = self.a
        hi = max(1, a.capacity // 8) if small else a.capacity
        n = 1 + int(frac * (hi - 1))
        need = a.reserved_size(n)
        # Best fit, computed from the outside: the smallest free segment that holds it, lowest
        # offset on ties.
        fits = [(size, off) for off, size in a.free_segments() if size >= need]
        off = a.alloc(n)
        if not fits:
            assert off is None                          # never a partial allocation
            return
        assert off == min(fits)[1]
        assert off % a.align == 0
        self.live[off] = need

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free(off)
        del self.live[off]
        with pytest.raises(ValueError, match=f"double free of offset {off}"):
            self.a.free(off)

    @precondition(lambda self: self.live)
    @rule()
    def free_everything(self) -> None:
        for off in list(self.live):
            self.a.free(off)
        self.live.clear()
        # Full coalescing: one free segment covering the whole buffer.
        assert self.a.free_segments() == [(0, self.a.capacity)]
        assert self.a.fragmentation == 0.0

    @invariant()
    def consistent(self) -> None:
        a = self.a
        if a is None:
            return
        assert a.allocated() == self.live
        free = a.free_segments()
        segs = sorted([(o, s, "live") for o, s in self.live.items()] +
                      [(o, s, "free") for o, s in free])
        # Live and free segments tile [0, capacity): no overlap, no gap, nothing outside.
        pos = 0
        for off, size, _ in segs:
            assert off == pos and size >= 1
            assert off % a.align == 0 and size % a.align == 0
            pos += size
        assert pos == a.capacity
        # No leak, and free segments are always coalesced (never two adjacent).
        assert a.total_free + a.total_allocated == a.capacity
        assert a.total_free == sum(s for _, s in free)
        kinds = [k for _, _, k in segs]
        assert all(not (x == y == "free") for x, y in zip(kinds, kinds[1:]))
        assert a.num_free == len(free)
        assert a.largest_free == max((s for _, s in free), default=0)
        expect = 0.0 if not free else 1.0 - a.largest_free / a.total_free
        assert a.fragmentation == pytest.approx(expect)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


def test_coalesces_both_neighbours():
    a = SegmentAllocator(10)
    offs = [a.alloc(2) for _ in range(5)]
    assert offs == [0, 2, 4, 6, 8] and a.num_free == 0 and a.alloc(1) is None
    a.free(2)
    a.free(6)
    assert a.free_segments() == [(2, 2), (6, 2)] and a.fragmentation == 0.5
    assert a.alloc(3) is None                      # 4 units free, but no hole of 3
    a.free(4)                                      # merges left and right: one hole [2, 8)
    assert a.free_segments() == [(2, 6)] and a.largest_free == 6
    assert a.alloc(3) == 2


def test_best_fit_prefers_smallest_hole_then_lowest_offset():
    a = SegmentAllocator(20)
    offs = [a.alloc(n) for n in (4, 1, 2, 1, 3, 1, 2, 6)]   # 0,4,5,7,8,11,12,14
    for off in (0, 5, 8, 12):                               # holes of 4, 2, 3, 2
        a.free(off)
    assert a.alloc(2) == 5                                  # two holes of 2: the lower one
    assert a.alloc(2) == 12
    assert a.alloc(3) == 8
    assert offs[-1] == 14


def test_alignment_rounds_sizes_up():
    a = SegmentAllocator(64, align=16)
    assert a.alloc(1) == 0 and a.alloc(17) == 16 and a.allocated() == {0: 16, 16: 32}
    assert a.total_free == 16


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="capacity must be an integer >= 1"):
        SegmentAllocator(0)
    with pytest.raises(ValueError, match="align must be an integer >= 1"):
        SegmentAllocator(8, align=0)
    with pytest.raises(ValueError, match=r"capacity \(10\) must be a multiple of align \(4\)"):
        SegmentAllocator(10, align=4)
    a = SegmentAllocator(8)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n must be an integer >= 1"):
            a.alloc(bad)
    with pytest.raises(ValueError, match=r"n \(9\) exceeds the capacity \(8\)"):
        a.alloc(9)
    off = a.alloc(4)
    with pytest.raises(ValueError, match="offset 2 is inside the allocation at 0"):
        a.free(2)
    with pytest.raises(ValueError, match="offset 99 is outside the buffer"):
        a.free(99)
    with pytest.raises(ValueError, match="offset must be an integer"):
        a.free("0")
    a.free(off)
    with pytest.raises(ValueError, match="double free of offset 0"):
        a.free(off)


def test_stale_heap_entries_stay_bounded():
    a = SegmentAllocator(1024)
    for i in range(5000):
        offs = [a.alloc(1 + (i * 7 + j) % 13) for j in range(8)]
        for off in offs[::2] + offs[1::2]:
            a.free(off)
    assert a.free_segments() == [(0, 1024)]
    assert len(a._by_size) + len(a._by_neg_size) <= 4 * a.num_free + 66


def test_fragmentation_figure_quick():
    r = fragmentation_figure(seed=0, steps=300, capacity=1024, long=(64, 256))
    assert len(r["fragmentation"]) == len(r["utilisation"]) == 300
    assert all(0.0 <= f < 1.0 for f in r["fragmentation"])
    assert 0.0 < r["peak_utilisation"] <= 1.0
    assert 0 <= r["failed_with_enough_free"] <= r["failed"] <= r["requests"]
    assert r == fragmentation_figure(seed=0, steps=300, capacity=1024, long=(64, 256))  # seeded
    with pytest.raises(ValueError, match="short must be integers"):
        fragmentation_figure(steps=10, capacity=16, short=(1, 32))
