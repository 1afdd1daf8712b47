"""Host time of the block-causal split (``layers/paged_index.split_blocks``, one numpy pass) on
the CPU against the per-request loop it replaced (``split_blocks_loop`` here, also the tests'
reference), at a block-cache refresh step's shape (each request's window: the block before and
the active one). The general path runs it once per step of a block-causal model.

    python3 benchmarks/step/split_blocks_cpu.py --out benchmarks/results/step/split_blocks_cpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import numpy as np

from flash_dllm.layers import paged_index


def split_blocks_loop(table, canvas_lens, pos, cu, block_size):
    """The per-request loop ``split_blocks`` was before (the same outputs)."""
    rows, lens, bounds = [], [], [0]
    for b in range(len(canvas_lens)):
        a, e = cu[b], cu[b + 1]
        if e == a:
            rows.append(b)
            lens.append(canvas_lens[b])
            bounds.append(e)
            continue
        blk = pos[a:e] // block_size                        # non-decreasing: one window
        cuts = np.flatnonzero(np.diff(blk)) + 1
        for s, t_end, k in zip(np.r_[0, cuts], np.r_[cuts, e - a], blk[np.r_[0, cuts]]):
            rows.append(b)
            lens.append(min(canvas_lens[b], (int(k) + 1) * block_size))
            bounds.append(a + int(t_end))
    return table[rows], lens, bounds


def time_us(fn, reps: int) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bs, rows, width = 4, 8, 40
    out = []
    for B in (1, 8, 32, 128):
        table = np.arange(B * width, dtype=np.int32).reshape(B, width)
        lens = [44] * B
        pos = np.concatenate([np.arange(32, 32 + rows) for _ in range(B)])
        cu = list(range(0, rows * B + 1, rows))
        t_loop = time_us(lambda: split_blocks_loop(table, lens, pos, cu, bs), 50)
        t_np = time_us(lambda: paged_index.split_blocks(table, lens, pos, cu, bs), 50)
        out.append({"requests": B, "rows_per_request": rows, "block_size": bs,
                    "loop_us": round(t_loop, 1), "numpy_us": round(t_np, 1)})
        print(out[-1], flush=True)
    with open(a.out, "w") as f:
        json.dump({"machine": platform.processor() or platform.machine(), "rows": out}, f,
                  indent=1)


if __name__ == "__main__":
    main()
