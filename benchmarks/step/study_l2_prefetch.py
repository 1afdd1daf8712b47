"""Study: an output projection after an attention-long idle gap, its weight prefetched into L2
on a side stream during the gap (bulk L2 prefetches, below) or not.

Each iteration of a CUDA graph is ``torch.cuda._sleep`` (the gap: RoPE + attention + merge take
~13 us a layer at batch 1, HBM idle) then the GEMM at a batch-1 shape; iterations cycle through
8 copies of the weight (more than L2 holds), so every GEMM starts cold unless prefetched. The
gap alone is timed too: GEMM time = iteration - gap. Usage::

    python3 benchmarks/step/study_l2_prefetch.py --out benchmarks/results/step/study_l2_prefetch_h100.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import triton
import triton.language as tl

from flash_dllm.kernels import skinny_gemm
from sweep_quant_gemm import graph_time  # (the same timing: benchmarks/step)


def graph_t(fn, iters: int = 32) -> float:
    return graph_time(fn, iters, replays=5, indexed=True)


# --- the prefetch (kernels/l2_prefetch.py while the engine A/B ran; see benchmarks/README) ---
MAX_ROWS = 64             # steps of more rows are not bound by reading the weights
LANES = 32                # prefetches per program (one warp, one per lane)
_SIDE: dict[int, torch.cuda.Stream] = {}


@triton.jit
def _bulk_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Lane i of program p prefetches bytes [c, c + CHUNK) of ``ptr`` (uint8) into L2
    (``cp.async.bulk.prefetch.L2``, sm_90+), c = (p * LANES + i) * CHUNK, clipped to
    ``nbytes`` (a multiple of 16)."""
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)


def start(tensors, rows: int, budget: int, chunk: int):
    """The first ``budget`` bytes of ``tensors`` (contiguous, 16-byte aligned) into L2 on a side
    stream forked off the current one: the side stream to ``join`` (None: nothing launched)."""
    if rows > MAX_ROWS:
        return None
    side = _SIDE.setdefault(torch.cuda.current_device(), torch.cuda.Stream())
    side.wait_stream(torch.cuda.current_stream())
    left = budget
    with torch.cuda.stream(side):
        for t in tensors:
            n = min(t.numel() * t.element_size(), left) // 16 * 16
            if n <= 0:
                break
            _bulk_prefetch_kernel[(triton.cdiv(n, chunk * LANES),)](
                t.reshape(-1).view(torch.uint8), n, CHUNK=chunk, LANES=LANES, num_warps=1)
            left -= n
    return side


def join(side) -> None:
    """The current stream waits for ``start``'s side stream again (a graph's join edge)."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


SHAPES = {                       # name: (rows, N, K)
    "sdar4b_o": (4, 2560, 4096),
    "llada8b_o": (32, 4096, 4096),
    "sdar4b_gate_up": (4, 19456, 2560),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap-us", type=float, nargs="+", default=[6.0, 12.0])
    ap.add_argument("--chunks-kib", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--budgets-mb", type=float, nargs="+", default=[8, 24, 48])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    # cycles per microsecond: time a long sleep
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    e1.synchronize()
    cyc_per_us = 10_000_000 / (e0.elapsed_time(e1) * 1e3)
    rows_out = []
    for name, (M, N, K) in SHAPES.items():
        silu = name.endswith("gate_up")
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)

        def gemm(w):
            if silu:
                h = skinny_gemm.silu_gate_up(x, w)
                return h if h is not None else F.linear(x, w)
            return skinny_gemm.linear(x, w)

        for gap in a.gap_us:
            cycles = int(gap * cyc_per_us)

            def only_gap(i):
                torch.cuda._sleep(cycles)

            def plain(i):
                torch.cuda._sleep(cycles)
                gemm(ws[i % 8])

            t_gap = graph_t(only_gap, 48)
            t_plain = graph_t(plain, 48)
            row = {"shape": name, "rows": M, "N": N, "K": K, "gap_us": round(t_gap, 2),
                   "weight_MB": round(N * K * 2 / 2 ** 20, 1),
                   "gemm_us_cold": round(t_plain - t_gap, 2), "prefetched": []}
            for kib in a.chunks_kib:
                for mb in a.budgets_mb:
                    def pf(i, mb=mb, kib=kib):
                        side = start([ws[i % 8]], M, int(mb * 2 ** 20), kib * 1024)
                        torch.cuda._sleep(cycles)
                        join(side)
                        gemm(ws[i % 8])

                    t = graph_t(pf, 48)
                    row["prefetched"].append({"chunk_KiB": kib, "budget_MB": mb,
                                              "gemm_us": round(t - t_gap, 2),
                                              "iter_us": round(t, 2)})
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    # the gap alone with a prefetch beside it: does the prefetch slow the gap's kernel?
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "sleep_cycles_per_us": cyc_per_us,
              "rows": rows_out}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
