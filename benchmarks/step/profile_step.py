"""Where a denoising step's GPU time goes, kernel by kernel (``torch.profiler``, CUDA activity).

    python benchmarks/step/profile_step.py --batch 1 64 --cache dual --out profile_h200.json

For each batch: a random-init model of ``--model-shape`` (as ``flash-dllm bench step``), requests
of prompt 512 + gen 512, vanilla decoding (one token per step); steps run until the second block
has its graphs captured, then ``--steps`` cached steps of that block are profiled. Reported per
step: the wall time (CUDA events, no profiler), the summed kernel time, and the kernel time per
category (GEMMs, attention, RoPE + page write, norms, SwiGLU activation, proposal, the rest) and
per kernel name (top 25). GEMM rows also give the weight bytes they must read per step, so the
GEMMs' effective bandwidth can be compared with the copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from flash_dllm.bench.shapes import shape_config
from flash_dllm.bench.moe_floor import set_routing
from flash_dllm.bench.step import copy_bandwidth
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.layers.quant import quantize_model
from flash_dllm.models.loader import build_model

# first match wins; matched case-insensitively against the kernel name
CATEGORIES = [
    ("attention", ("paged_attn",)),
    ("qkv_rope_kv_write", ("qkv_rope",)),
    ("rope_kv_write", ("rope_cache",)),
    ("rmsnorm_residual", ("rmsnorm",)),
    ("silu_mul", ("silu",)),
    ("proposal", ("argmax_conf", "confidence")),
    ("moe", ("gate_up", "_down", "_sum_kernel", "_count_kernel", "_place_kernel")),
    ("kv_fp8_write", ("requant",)),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk", "skinny", "sm90_",
              "_wq_", "dequant")),
    ("copy_fill", ("memcpy", "memset", "copy", "fill")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, duration_us) of every GPU activity the profiler saw."""
    from torch.autograd import DeviceType
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
    return out


def busy_us(events) -> float:
    """Union of the kernels' intervals (concurrent kernels counted once)."""
    total, end = 0.0, float("-inf")
    for _, s, d in sorted(events, key=lambda x: x[1]):
        e = s + d
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile_case(model, cfg, batch: int, cache: str, steps: int, fused: bool,
                 graphs: bool, block: int = 32, kv_cache_dtype: str = "auto") -> dict:
    engine = Engine(model, cfg, EngineConfig(max_num_seqs=batch, num_kv_pages=batch * 65,
                                             fused_step=fused, cuda_graphs=graphs,
                                             kv_cache_dtype=kv_cache_dtype))
    g = torch.Generator().manual_seed(batch)
    vocab = min(cfg.vocab_size, cfg.mask_token_id)
    params = SamplingParams(max_tokens=512, block_length=block, cache=cache, early_stop=False,
                            decode="vanilla")
    reqs = [engine.add_request(torch.randint(0, vocab, (512,), generator=g).tolist(), params)
            for _ in range(batch)]
    r0 = reqs[0]
    # block 0 captures the shapes; profile inside block 1, after its refresh and first steps
    # (small blocks, e.g. SDAR's 4: from block 2 on, the steps crossing blocks as they come)
    if block >= 16:
        while not (r0.block >= 1 and not r0.first_step and r0.num_masked <= block - 4):
            engine.step()
        steps = min(steps, r0.num_masked - 2)
    else:
        while r0.block < 2:
            engine.step()
    for _ in range(2):                        # CUDA-event wall time of the same kind of steps
        engine.step()
    walls = []
    for _ in range(steps // 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        engine.step()
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b))
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    n = steps - steps // 2
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n):
            engine.step()
        torch.cuda.synchronize()
    ev = kernel_events(prof)
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for name, _, d in ev:
        by_cat[category(name)] += d
        by_name[name] += d
        count[name] += 1
    runner = engine.runner
    stats = dict(runner.forward_graphs.stats) if runner.forward_graphs is not None else {}
    if runner.fused is not None:
        stats = {**stats, **runner.fused.stats}
    del runner
    for r in reqs:
        engine.abort(r.request_id)
    del engine, reqs, r0
    torch.cuda.empty_cache()
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    return {
        "batch": batch, "cache": cache, "fused_step": fused, "cuda_graphs": graphs,
        "profiled_steps": n,
        "wall_ms": statistics.median(walls) if walls else None,
        "kernel_ms": sum(d for _, _, d in ev) / 1e3 / n,
        "busy_ms": busy_us(ev) / 1e3 / n,
        "by_category_ms": {k: v / 1e3 / n for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k[:160], "category": category(k), "ms_per_step": v / 1e3 / n,
                         "calls_per_step": count[k] / n} for k, v in top],
        "graph_stats": stats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", default="llada-8b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--cache", nargs="+", default=["dual"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--no-fused-step", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="eager launches (kernel times as in the graphs, plus launch gaps)")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--quantization", choices=["none", "fp8", "int8", "int4"], default="none",
                    help="the model's projections (and experts) quantized, fused first as the "
                         "engine's runner does")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--routing", choices=["model", "uniform"], default="model",
                    help="MoE shapes: the random router, or experts drawn uniformly per row")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = build_model(shape_config(a.model_shape), device=dev, dtype="bfloat16", seed=0)
    cfg = model.cfg
    if a.quantization != "none":
        model.fuse_projections()
        quantize_model(model, a.quantization)
    set_routing(model, cfg, a.routing, a.model_shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # what the step's GEMMs read: every weight but the embedding (a gather), plus the LM head
    # (the embedding again when tied)
    embed_bytes = model.embed.weight.numel() * model.embed.weight.element_size()
    gemm_bytes = weight_bytes - (embed_bytes if model.lm_head is not None else 0)
    bw = copy_bandwidth(dev)
    rows = []
    for cache in a.cache:
        for b in a.batch:
            r = profile_case(model, cfg, b, cache, a.steps,
                             not (a.no_fused_step or a.no_cuda_graphs), not a.no_cuda_graphs,
                             a.block_length, a.kv_cache_dtype)
            r["gemm_weight_GBps"] = (gemm_bytes / (r["by_category_ms"]["gemm"] / 1e3) / 1e9
                                     if r["by_category_ms"].get("gemm") else None)
            rows.append(r)
            cats = ", ".join(f"{k} {v:.3f}" for k, v in r["by_category_ms"].items())
            print(f"batch {b} {cache}: wall {r['wall_ms']:.3f} ms, kernels {r['kernel_ms']:.3f}, "
                  f"busy {r['busy_ms']:.3f} | {cats}", flush=True)
    report = {"model_shape": a.model_shape, "quantization": a.quantization,
              "kv_cache_dtype": a.kv_cache_dtype, "block_length": a.block_length,
              "routing": a.routing, "device_name": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "weight_bytes": weight_bytes,
              "copy_bandwidth_GBps": bw / 1e9, "floor_ms": 1e3 * weight_bytes / bw, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
