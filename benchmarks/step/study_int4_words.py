"""The int4 weight-only GEMM reading interleaved int32 words (``quant_gemm``'s ``JOIN = 3``,
``quant_decode.interleave_int4``) against the byte read the engine runs, at LLaDA-8B's projection
shapes and 32 rows (the batch-1 dual step), timed inside CUDA graphs.

    python benchmarks/step/study_int4_words.py --out study_int4_words_h100.json

For each shape: the engine's kernel with its tiles (the device's tuned file, else the defaults:
``engine_us``), then the word read over ``GRID`` (``BLOCK_K`` is the layout's tile, 128), every
tile checked against the reference once. The summary adds the four shapes x 32 layers, the sum a
batch-1 step spends in these GEMMs (the LM head is bf16 here, as in the engine's default).

Why (findings/quantization.md): compiled for sm_90 the word read's K-tile loop is ~30-36 % fewer
SASS instructions than the byte read's (no byte loads from shared memory, no byte permutes into
the MMA registers); whether that is time is what this measures.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from flash_dllm.kernels import quant_decode, quant_gemm
from sweep_quant_gemm import SHAPES, graph_time, packed_bytes

GRID = {"SPLIT_K": [1, 2, 4, 8], "BLOCK_N": [64, 128], "SWAP": [0, 1]}
LAYERS = 32                                   # LLaDA-8B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    M, cases = a.rows, []
    for name, N, K in SHAPES:
        w = torch.randn(N, K, device=dev, generator=g) * 0.02
        q, s = quant_gemm.quantize(w, 4, 128)
        words = quant_decode.interleave_int4(q)
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        ref = quant_gemm.weight_only_reference(x, q, s, None, 4)
        tuned = quant_gemm.tuned_config(M, N, K, 128, 4, dev, "int4")
        cfg = {**quant_gemm.default_config(M, N, K, 128, quant_gemm._num_sms(dev)),
               **(tuned or {})}
        row = {"shape": name, "M": M, "N": N, "K": K, "packed_bytes": packed_bytes(q, s),
               "engine_config": cfg, "engine_us": graph_time(
                   lambda: quant_gemm.weight_only_triton(x, q, s, None, 4, cfg), a.reps),
               "words": []}
        for combo in itertools.product(*GRID.values()):
            c = {**cfg, **dict(zip(GRID, combo)), "BLOCK_K": 128, "JOIN": 3}
            out = quant_gemm.weight_only_triton(x, words, s, None, 4, c)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = graph_time(lambda: quant_gemm.weight_only_triton(x, words, s, None, 4, c),
                            a.reps)
            row["words"].append({"config": c, "us": us, "rel_err": err})
        best = min(row["words"], key=lambda r: r["us"])
        row["words_best_us"], row["words_best_config"] = best["us"], best["config"]
        row["max_rel_err"] = max(r["rel_err"] for r in row["words"])
        cases.append(row)
        gbs = [row["packed_bytes"] / t / 1e3 for t in (row["engine_us"], best["us"])]
        print(f"{name:8s} engine {row['engine_us']:7.1f} us ({gbs[0]:.0f} GB/s)  words best "
              f"{best['us']:7.1f} us ({gbs[1]:.0f} GB/s) "
              f"{dict((k, best['config'][k]) for k in GRID)}  max rel err "
              f"{row['max_rel_err']:.1e}", flush=True)
    engine = LAYERS * sum(r["engine_us"] for r in cases) / 1e3
    words = LAYERS * sum(r["words_best_us"] for r in cases) / 1e3
    report = {"device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "rows": M, "group": 128, "timing": "mean per launch inside one CUDA graph",
              "grid": GRID, "cases": cases, "layers": LAYERS,
              "step_gemm_ms": {"engine": engine, "words_best": words}}
    print(f"{LAYERS} layers: engine {engine:.2f} ms, words {words:.2f} ms of int4 GEMMs a step")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
