"""``flash-dllm bench step``: time one denoising forward of a random-init model of a real shape.

Reports, per (batch, cache mode): the median step time, the weight-read floor (weight bytes over the
measured copy bandwidth) and the ratio to it, MFU (FLOPs of the step's linear layers and attention
over the measured bf16 matmul rate), and peak memory against weights + exact KV bytes.

NOTE: with ``decode=vanilla`` and one token per step, a block takes one refresh step (the whole
canvas) and ``block_length - 1`` cached steps. ``ms`` is the median over the timed steps, i.e. the
cached step for ``prefix``/``dual``; ``ms_refresh`` is reported apart.
"""
from __future__ import annotations

import gc
import statistics
import time

import torch

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.cache.paged import kv_pool_dtype
from flash_dllm.config import LM_HEAD_SUFFIX, EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.bench.moe_floor import moe_floor, set_routing, touched_experts
from flash_dllm.bench.shapes import shape_config
from flash_dllm.layers.quant import DEFAULT_GROUP_SIZE, quantize_model
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.loader import build_model

HEAD = LM_HEAD_SUFFIX   # a --quantization mode's suffix: the LM head quantized too


class _Timer:
    """Wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timer = _Timer(device)
    dst.copy_(src)
    best = min(timer(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * nbytes / best


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """FLOP/s of one n^3 matmul (the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = _Timer(device)
    a @ b
    best = min(timer(lambda: a @ b) for _ in range(3))
    return 2 * n**3 / best


def linear_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs of one token through the linear layers (attention projections, each layer's MLP: a
    dense SwiGLU, or the router, ``top_k`` experts and the shared expert of a MoE layer)."""
    d, hd = cfg.hidden_size, cfg.head_dim
    total = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.num_layers
    for i in range(cfg.num_layers):
        if cfg.layer_mlp_kind(i) == "moe":
            m = cfg.moe
            total += m.num_experts * d + 3 * d * m.intermediate_size * (m.top_k
                                                                       + m.num_shared_experts)
        else:
            total += 3 * d * cfg.intermediate_size
    return 2 * total


def step_flops(cfg: ModelConfig, reqs) -> float:
    """FLOPs of the next step: linear layers over every recomputed token (a MoE layer's active
    experts only), attention over each request's keys, and the LM head over the masked slots of
    the active blocks."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_token = linear_flops_per_token(cfg)
    total = 0.0
    for r in reqs:
        mode = CACHE_MODES[r.params.cache]
        q0, q1 = mode.query_range(r.canvas_len, r.block_start, r.block_end, r.first_step,
                                  cfg.logit_shift, first_block=r.block == 0)
        q = q1 - q0
        if mode.needs_mass and r.num_forwards > 0:    # flash: top-k from the last step's mass
            q += min(r.params.flash_budget, r.canvas_len - q)
        keys = min(r.canvas_len, r.block_end) if cfg.attention.block_causal else r.canvas_len
        total += q * per_token
        total += 4 * q * keys * cfg.num_heads * hd * cfg.num_layers
        total += 2 * r.num_masked * d * cfg.vocab_size
    return total


def _time_steps(engine, reqs, cfg: ModelConfig, mode, warmup: int, steps: int, timer):
    """Step ``engine`` for ``warmup`` + ``steps`` forwards: the timed steady steps' and refresh
    steps' seconds, steady FLOP rates, forward-only seconds and forwards per engine step."""
    cached, refresh, flops, fwd_cached, calls = [], [], [], [], []
    runner = engine.runner
    done = 0                           # forwards run (an engine step may run several)
    while done < warmup + steps and engine.has_unfinished():
        # a refresh recomputes the whole canvas by the mode's rule (``CacheMode.refresh``: the
        # first step of every block for prefix / dual, the request's first step for flash); a
        # mode that keeps no K/V recomputes it at every step, all of them timed as steady
        first = mode.keeps_kv and mode.refresh(reqs[0].first_step, reqs[0].block == 0)
        f = step_flops(cfg, reqs)
        runner.forward_events = []     # a fused step (the step graph) runs no separate forward
        before = engine.steps_run
        t = timer(engine.step)
        # multi-step (``engine/multi_step.py``): n forwards in one call count as n steps of t / n
        n = max(1, engine.steps_run - before)
        done += n
        if done - n < warmup:
            continue
        (refresh if first else cached).extend([t / n] * n)
        fwd = runner.forward_seconds()
        if not first and fwd is not None:
            fwd_cached.append(fwd)
        if not first:
            flops += [f * n / t] * n
            calls.append(n)
    if not cached:
        raise ValueError(f"the requests finished after {done} forwards, before {warmup} warm-up "
                         f"and {steps} timed steps: raise --gen-len")
    return cached, refresh, flops, fwd_cached, calls


def bench_case(model, cfg: ModelConfig, batch: int, cache: str, prompt: int, gen: int, block: int,
               steps: int, warmup: int, device: torch.device, cuda_graphs: bool = True,
               flash_budget: int | None = None, decode: str = "vanilla", fused_step: bool = True,
               fused_max_rows: int | None = None, kv_cache_dtype: str = "auto",
               deterministic: bool = False, multi_step: int | None = None,
               fused_first_steps: bool = False) -> dict:
    extra_cfg = {} if fused_max_rows is None else {"fused_step_max_rows": fused_max_rows}
    extra_cfg.update(multi_step=multi_step, fused_first_steps=fused_first_steps)
    extra_cfg["kv_cache_dtype"] = kv_cache_dtype
    extra_cfg["deterministic"] = deterministic
    bs = cfg.attention.block_size        # a block-causal model's canvas ends on its grid
    canvas = -(-(prompt + gen) // bs) * bs if bs else prompt + gen
    engine = Engine(model, cfg, EngineConfig(max_num_seqs=batch, num_kv_pages=batch * (
        canvas // 16 + 1), cuda_graphs=cuda_graphs,
        fused_step=fused_step and cuda_graphs and device.type == "cuda", **extra_cfg))
    g = torch.Generator().manual_seed(batch)
    vocab = min(cfg.vocab_size, cfg.mask_token_id)     # random prompts never hold MASK
    extra = {} if flash_budget is None else {"flash_budget": flash_budget}
    params = SamplingParams(max_tokens=gen, block_length=block, cache=cache, early_stop=False,
                            decode=decode, **extra)
    reqs = [engine.add_request(torch.randint(0, vocab, (prompt,), generator=g).tolist(), params)
            for _ in range(batch)]
    timer = _Timer(device)
    runner = engine.runner
    # the forward alone, inside each step: the runner brackets it with CUDA events read after
    # the step (no sync inside the step, so timing it does not change the step's own time)
    runner.time_forward = True
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cached, refresh, flops, fwd_cached, calls = _time_steps(engine, reqs, cfg, CACHE_MODES[cache],
                                                            warmup, steps, timer)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    touched = (touched_experts(model, reqs, cache)
               if cfg.mlp_kind == "moe" and getattr(model, "tp", None) is None else None)
    for r in reqs:
        engine.abort(r.request_id)
    engine_multi_step = engine.multi_step
    graphs = None
    if runner.forward_graphs is not None:
        graphs = dict(runner.forward_graphs.stats)
        if runner.fused is not None:
            graphs.update(runner.fused.stats)
    del engine, reqs, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ms = 1e3 * statistics.median(cached)
    return {"batch": batch, "cache": cache,
            "cuda_graphs": graphs is not None, "graph_stats": graphs,
            "prompt": prompt, "gen": gen, "block": block,
            "timed_steps": len(cached), "ms": ms, "ms_mean": 1e3 * statistics.fmean(cached),
            # the forward alone (graph replay or eager layers); ms - ms_forward is the host-side
            # work of the step: scheduling, sampling, committing
            # (None when every timed step was fused: the forward is inside the step's graph)
            "ms_forward": 1e3 * statistics.median(fwd_cached) if fwd_cached else None,
            "decode": decode,
            # forwards per engine step over the timed steady steps (multi-step; 1: off)
            "multi_step": engine_multi_step, "fused_first_steps": fused_first_steps,
            "forwards_per_call": statistics.fmean(calls) if calls else None,
            "ms_refresh": 1e3 * statistics.median(refresh) if refresh else None,
            "flops_per_s": statistics.median(flops) if flops else None,
            "peak_bytes": peak, "experts_touched": touched}


def run_bench(shape: str, batches: list[int], caches: list[str], device: str, dtype: str,
              prompt: int, gen: int, block: int, steps: int, warmup: int, progress=print,
              cuda_graphs: bool = True,
              flash_budget: int | None = None, decode: str = "vanilla",
              fused_step: bool = True, fused_max_rows: int | None = None,
              tensor_parallel_size: int = 1, tp=None, routing: str = "model",
              quantization: list[str] | None = None,
              group_size: int | None = DEFAULT_GROUP_SIZE, kv_cache_dtype: str = "auto",
              deterministic: bool = False, multi_step: int | None = None,
              fused_first_steps: bool = False) -> dict:
    """``tensor_parallel_size`` > 1: the model is split over that many GPUs (ranks 1.. are
    worker processes running the same cases, ``run_tp_rank``); figures are rank 0's, whose
    forward includes the collectives. ``tp``: this rank's group (set by the launcher).
    ``quantization``: the weight modes to time, one model each (``none``: the dtype's own; the
    default is ``["none"]``); each row says its mode, and its floor is from that mode's bytes."""
    modes = list(quantization or ["none"])
    if tensor_parallel_size > 1 and tp is None:
        if modes != ["none"]:
            raise ValueError("bench step --quantization runs on one device (quantized weights "
                             "are not tensor-parallel yet)")
        return _launch_tp(tensor_parallel_size, dict(
            shape=shape, batches=batches, caches=caches, device=device, dtype=dtype,
            prompt=prompt, gen=gen, block=block, steps=steps, warmup=warmup,
            cuda_graphs=cuda_graphs, flash_budget=flash_budget, decode=decode,
            fused_step=fused_step, fused_max_rows=fused_max_rows, routing=routing,
            kv_cache_dtype=kv_cache_dtype, deterministic=deterministic,
            multi_step=multi_step, fused_first_steps=fused_first_steps), progress)
    world = 1 if tp is None else tp.world
    if world > 1:     # the ranks' engines would size their multi-step calls by local timings
        multi_step = 1
    dev = torch.device(device) if tp is None else _tp_device(device, tp.rank, world)
    cfg_dict = shape_config(shape)
    bw = copy_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 27)
    report, rows, weights = None, [], {}
    for mode in modes:
        model = build_model(cfg_dict, device=dev, dtype=dtype, seed=0, tp=tp)
        cfg = model.cfg
        quant = {}                           # quantize_model's report (its group included)
        if mode != "none":
            if dev.type == "cuda":           # the runner's order: fuse, then quantize the GEMMs
                model.fuse_projections()
            # ("int4+head": the LM head quantized too, EngineConfig.quantize_lm_head)
            quant = quantize_model(model, mode.removesuffix(HEAD), group_size,
                                   deterministic=deterministic, lm_head=mode.endswith(HEAD))
        set_routing(model, cfg, routing, shape)
        tdtype = next(model.parameters()).dtype
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if report is None:
            rate = matmul_rate(dev, tdtype, 8192 if dev.type == "cuda" else 1024)
            report = {
                "model_shape": shape, "device": str(dev), "tensor_parallel_size": world,
                "routing": routing if cfg.mlp_kind == "moe" else None,
                # per rank under tensor parallelism (what one GPU reads: the floor's numerator)
                "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "dtype": str(tdtype).replace("torch.", ""), "kv_cache_dtype": kv_cache_dtype,
                "deterministic": deterministic,
                "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
                "weight_bytes": weight_bytes, "copy_bandwidth_GBps": bw / 1e9,
                "matmul_TFLOPs": rate / 1e12, "floor_ms": 1e3 * weight_bytes / bw}
        weights[mode] = {"weight_bytes": weight_bytes, "floor_ms": 1e3 * weight_bytes / bw,
                         "group_size": quant.get("group_size"),
                         "int4_words_layers": quant.get("int4_words")}
        for cache, b in [(c, b) for c in caches for b in batches]:
            r = bench_case(model, cfg, b, cache, prompt, gen, block, steps, warmup, dev,
                           cuda_graphs, flash_budget, decode, fused_step, fused_max_rows,
                           kv_cache_dtype, deterministic, multi_step, fused_first_steps)
            _finish_row(r, model, cfg, cache, b, prompt, gen, block, bw, rate * world, routing,
                        flash_budget, weight_bytes,
                        kv_pool_dtype(kv_cache_dtype, tdtype))
            r["quantization"] = mode
            rows.append(r)
            progress(row_line(r))
        del model
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report["weights_by_quantization"] = weights
    report["rows"] = rows
    return report


def _finish_row(r: dict, model, cfg: ModelConfig, cache: str, b: int, prompt: int, gen: int,
                block: int, bw: float, rate: float, routing: str, flash_budget: int | None,
                weight_bytes: int, kv_dtype: torch.dtype) -> None:
    """A timed case's derived figures: floors (from this model's stored weight bytes), MFU,
    per-step-in-block time and memory against weights + exact KV (``kv_dtype``'s bytes)."""
    mode = CACHE_MODES[cache]
    if mode.needs_mass:              # (flash: the top-k positions it recomputes, by mass)
        r["flash_budget"] = (flash_budget if flash_budget is not None
                             else SamplingParams.flash_budget)
    if cfg.mlp_kind == "moe":        # the experts this step's rows reach (steady steps)
        r.update(moe_floor(model, cfg, r, b * (block if mode.keeps_kv else prompt + gen),
                           bw, routing))
    r["ratio_to_floor"] = r["ms"] / r.get("floor_ms", 1e3 * weight_bytes / bw)
    r["mfu"] = r["flops_per_s"] / rate if r["flops_per_s"] else None
    # the forward alone at the same FLOPs (what the step would reach with no host work)
    r["mfu_forward"] = (r["mfu"] * r["ms"] / r["ms_forward"]
                        if r["mfu"] and r["ms_forward"] else None)
    # per step over a whole block: prefix/dual pay one full refresh per block, flash none
    if r["ms_refresh"] is not None and mode.block_refresh:
        r["ms_per_step_in_block"] = (r["ms_refresh"] + (block - 1) * r["ms"]) / block
    else:
        r["ms_per_step_in_block"] = r["ms"]
    # the paged layout writes K/V to pages in every mode
    exact_kv = cfg.kv_bytes_per_token(kv_dtype) * (prompt + gen) * b
    r["expected_bytes"] = weight_bytes + exact_kv
    r["peak_gib"] = r["peak_bytes"] / 2**30 if r["peak_bytes"] is not None else None
    r["expected_gib"] = r["expected_bytes"] / 2**30
    r["peak_over_expected"] = (r["peak_bytes"] / r["expected_bytes"]
                               if r["peak_bytes"] is not None else None)


def _tp_device(device: str, rank: int, world: int) -> torch.device:
    from flash_dllm.distributed.launch import rank_device
    return rank_device(device, rank, world)


def run_tp_rank(rank: int, world: int, init_method: str, kw: dict) -> dict:
    """One rank of a tensor-parallel ``run_bench`` (rank 0 returns the report)."""
    import torch.distributed as dist

    from flash_dllm.distributed.launch import init_groups
    tp, _ = init_groups(rank, world, init_method, _tp_device(kw["device"], rank, world))
    try:
        progress = kw.pop("progress", None) or (lambda *_: None)
        return run_bench(**kw, progress=progress, tensor_parallel_size=world, tp=tp)
    finally:
        dist.destroy_process_group()


def _launch_tp(world: int, kw: dict, progress) -> dict:
    from flash_dllm.distributed.tp import check_divisible
    from flash_dllm.distributed.launch import spawn_ranks
    from flash_dllm.models import registry

    raw = shape_config(kw["shape"])
    check_divisible(registry.resolve(raw).parse_config(raw), world)
    _tp_device(kw["device"], 0, world)                    # enough GPUs, before spawning
    procs, init_method = spawn_ranks(world, run_tp_rank, kw)
    try:
        report = run_tp_rank(0, world, init_method, dict(kw, progress=progress))
    except BaseException:
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.wait(timeout=60)
    return report


def row_line(r: dict) -> str:
    mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] is not None else "   n/a"
    peak = f"{r['peak_gib']:7.2f}" if r["peak_gib"] is not None else "    n/a"
    quant = r.get("quantization", "none")
    return (f"{'' if quant == 'none' else quant + '  '}batch {r['batch']:3d}  cache {r['cache']:6s}  "
            f"{r['ms']:9.2f} ms (forward {r.get('ms_forward') or float('nan'):8.2f}, per step in "
            f"block {r.get('ms_per_step_in_block', float('nan')):8.2f})  "
            f"x{r['ratio_to_floor']:6.2f} floor  MFU {mfu}  peak {peak} GiB "
            f"(weights+KV {r['expected_gib']:.2f})")
