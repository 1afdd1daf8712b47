"""``flash-dllm bench overflow``: one request larger than the GPU page pool, against its bound.

A request whose KV exceeds L0 (``--kv-overflow-gb``, ``cache/io/kv_overflow.py``) keeps a share of
its pages in the pool and copies the rest in from pinned host memory at every step, layer by
layer. A dual-cache step attends to every key, so those bytes must cross PCIe every step; the
bound for such a step is

    all-in-GPU step time + non-resident bytes / pinned host->device copy rate

with both terms measured in the same run: the same request on an engine whose pool holds it
whole, and a plain copy of the same bytes (the same per-layer chunks) from pinned memory. The
target is a step within 1.25x of the bound (nothing moved twice). That sum is the time with no
overlap at all; the report also gives the step against the larger of the two terms
(``step_over_overlap_bound``), the time with perfect overlap. The
block's first step (the prompt's refresh) writes the spilled pages down instead; its bound uses
the device->host rate.

Each engine runs the request twice and the second run is timed (the first compiles kernels and
allocates the pinned buffer). Outputs of the two engines are compared token for token.
"""
from __future__ import annotations

import gc
import statistics
import time

import numpy as np
import torch

from flash_dllm.bench.memory import _sync, _time
from flash_dllm.bench.shapes import shape_config, with_max_len
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.models.loader import build_model, parse_dtype


def _run(eng: Engine, prompt: list[int], params: SamplingParams, dev: torch.device,
         detail: list | None = None) -> tuple[list[tuple[bool, float]], list[int]]:
    """(refresh?, seconds) per step of one request, and its tokens. ``detail``: also, per
    step, its block, its kind (refresh / measure / lazy / full) and its copies (stats deltas)."""
    req = eng.add_request(prompt, params)
    steps = []
    ov = eng.runner.overflow
    while eng.has_unfinished():
        refresh, block = req.first_step, req.block
        before = dict(ov.stats) if ov is not None else {}
        _sync(dev)
        t0 = time.perf_counter()
        eng.step()                                 # ends with the step's device->host copy
        _sync(dev)
        steps.append((refresh, time.perf_counter() - t0))
        if detail is not None:
            d = {k: v - before[k] for k, v in ov.stats.items()}
            kind = ("refresh" if refresh else "measure" if d["measuring_steps"]
                    else "lazy" if d["lazy_wanted"] else "full")
            detail.append({"block": block, "kind": kind, "s": steps[-1][1],
                           "h2d_bytes": d["h2d_bytes"], "wanted": d["lazy_wanted"],
                           "hits": d["lazy_hits"]})
    return steps, req.tokens.tolist()


def _copy_rate(dev: torch.device, chunk: int, count: int, to_device: bool, reps: int = 3
               ) -> float:
    """Bytes per second of ``count`` plain copies of ``chunk`` bytes between pinned host memory
    and the device (the per-layer copies of an overflow step, back to back)."""
    pin = dev.type == "cuda"
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=pin)
    devbuf = torch.empty(chunk, dtype=torch.uint8, device=dev)

    def once():
        for _ in range(count):
            if to_device:
                devbuf.copy_(host, non_blocking=True)
            else:
                host.copy_(devbuf, non_blocking=True)

    return chunk * count / _time(once, dev, reps)


def run_overflow_bench(shape: str = "demo", device: str = "cpu", dtype: str = "bfloat16",
                       prompt_len: int = 2048, gen: int = 32, block: int = 32,
                       resident: float = 0.25, page_size: int = 16, cache: str = "dual",
                       progress=print, steps_per_block: int | None = None,
                       lazy_budget: float | None = None, placements: tuple[str, ...] = (),
                       lazy_predictor: str = "quest") -> dict:
    if not 0 < resident < 1:
        raise ValueError(f"resident must be in (0, 1), got {resident!r}")
    dev = torch.device(device)
    total = prompt_len + gen
    raw = with_max_len(shape_config(shape), total)
    model = build_model(raw, device=dev, dtype=parse_dtype(dtype), seed=0)
    cfg = model.cfg
    rng = np.random.default_rng(0)
    special = {cfg.mask_token_id, *cfg.eos_token_ids}
    prompt = [int(t) for t in rng.integers(0, cfg.vocab_size, prompt_len) if t not in special]
    while len(prompt) < prompt_len:
        prompt.append(prompt[-1])
    params = SamplingParams(max_tokens=gen, block_length=block, cache=cache, decode="vanilla",
                            early_stop=False,
                            steps=steps_per_block * (gen // block) if steps_per_block else None)
    n_pages = -(-total // page_size)
    res_pages = max(1, int(resident * n_pages))
    tdtype = next(model.parameters()).dtype
    kv_token = cfg.kv_bytes_per_token(tdtype)
    report = {"model_shape": shape, "device": str(dev),
              "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "dtype": str(tdtype).replace("torch.", ""), "torch": torch.__version__,
              "prompt_len": prompt_len, "gen": gen, "block_length": block, "cache": cache,
              "page_size": page_size, "pages": n_pages, "resident_pages": res_pages,
              "steps_per_block": steps_per_block,
              "kv_bytes": n_pages * page_size * kv_token}

    # today's behaviour without the overflow: refused at submission
    try:
        Engine(model, cfg, EngineConfig(page_size=page_size, num_kv_pages=res_pages,
                                        cuda_graphs=False, max_num_seqs=1)
               ).add_request(prompt, params)
        report["refused_without_overflow"] = None
    except ValueError as e:
        report["refused_without_overflow"] = str(e)
    gc.collect()

    cases, tokens, layer_bytes = _timed_cases(model, cfg, prompt, params, dev, page_size,
                                              n_pages, res_pages, kv_token, progress)
    spill = n_pages - res_pages
    chunk = spill * layer_bytes // 2                       # one layer's K (or V) of the spill
    count = 2 * cfg.num_layers
    step_bytes = chunk * count
    h2d = _copy_rate(dev, chunk, count, True)
    d2h = _copy_rate(dev, chunk, count, False)
    a, b = cases["all_in_gpu"], cases["overflow"]
    bound = a["step_s_median"] + step_bytes / h2d if a["step_s_median"] is not None else None
    ref_bound = (statistics.median(a["refresh_s"]) + step_bytes / d2h) if a["refresh_s"] else None
    report.update({
        "spilled_pages": spill, "non_resident_bytes_per_step": step_bytes,
        "plain_h2d_GBps": h2d / 1e9, "plain_d2h_GBps": d2h / 1e9,
        "cases": cases,
        "tokens_equal": tokens["all_in_gpu"] == tokens["overflow"],
        "step_bound_s": bound,
        "copy_s": step_bytes / h2d,
        "step_over_overlap_bound": (b["step_s_median"] / max(a["step_s_median"], step_bytes / h2d)
                                    if a["step_s_median"] and b["step_s_median"] else None),
        "step_over_bound": (b["step_s_median"] / bound
                            if bound and b["step_s_median"] is not None else None),
        "effective_h2d_GBps": (step_bytes / (b["step_s_median"] - a["step_s_median"]) / 1e9
                               if a["step_s_median"] and b["step_s_median"]
                               and b["step_s_median"] > a["step_s_median"] else None),
        "refresh_bound_s": ref_bound,
        "refresh_over_bound": (statistics.median(b["refresh_s"]) / ref_bound
                               if ref_bound and b["refresh_s"] else None),
        "target_step_over_bound": 1.25,
    })
    if lazy_budget is not None:
        report["lazy"] = _lazy_cases(model, cfg, prompt, params, dev, page_size, res_pages,
                                     n_pages, kv_token, lazy_budget, placements, lazy_predictor,
                                     a["step_s_median"], tokens["all_in_gpu"], progress)
    return report


def _timed_cases(model, cfg, prompt, params, dev, page_size: int, n_pages: int, res_pages: int,
                 kv_token: int, progress) -> tuple[dict, dict, int]:
    """The request with every page in the pool, then with ``res_pages`` of them and the rest
    streamed from host memory: a warm-up run and a timed run each. Returns the cases, each
    case's tokens and the stage's bytes per page and layer."""
    cases = {}
    tokens = {}
    for name, config in (
            ("all_in_gpu", EngineConfig(page_size=page_size, num_kv_pages=n_pages,
                                        max_num_seqs=1)),
            ("overflow", EngineConfig(page_size=page_size, num_kv_pages=res_pages,
                                      max_num_seqs=1,
                                      kv_overflow_gb=1.05 * (n_pages - res_pages) * page_size
                                      * kv_token / 2**30 + 1e-3))):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        eng = Engine(model, cfg, config)
        progress(f"{name}: {res_pages if name == 'overflow' else n_pages} of {n_pages} pages "
                 f"in the pool; warm-up run")
        _run(eng, prompt, params, dev)
        progress(f"{name}: timed run")
        before = dict(eng.runner.overflow.stats) if name == "overflow" else {}
        steps, tokens[name] = _run(eng, prompt, params, dev)
        refresh = [t for r, t in steps if r]
        later = [t for r, t in steps if not r]
        cases[name] = {"steps": len(steps), "refresh_s": refresh,
                       "step_s_median": statistics.median(later) if later else None,
                       "step_s": later,
                       "peak_gpu_bytes": (torch.cuda.max_memory_allocated(dev)
                                          if dev.type == "cuda" else None)}
        if name == "overflow":
            # the timed run's copies (the stats count from the engine's start, warm-up included)
            cases[name]["copy_stats"] = {k: v - before.get(k, 0)
                                         for k, v in eng.runner.overflow.stats.items()}
            layer_bytes = eng.runner.overflow.page_layer_bytes
        del eng
        gc.collect()
    return cases, tokens, layer_bytes

def _lazy_cases(model, cfg, prompt, params, dev, page_size, res_pages, n_pages, kv_token,
                budget, placements, predictor, all_in_gpu_step, ref_tokens, progress,
                reps: int = 3) -> dict:
    """The same request under lazy loading (``--lazy-load-budget``) with each placement: the
    steps of the blocks after the first (whose refresh moved the resident set) are timed.
    Random weights: which pages the attention picks means nothing, so the step time against
    the bytes it streamed is the figure here (median over the lazy steps of ``reps - 1`` runs
    after an untimed one) (``benchmarks/placement/placement_overflow.py`` measures
    hits and accuracy on trained checkpoints)."""
    out = {"budget": budget, "predictor": predictor, "cases": {}}
    for placement in placements or ("ema",):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        eng = Engine(model, cfg, EngineConfig(
            page_size=page_size, num_kv_pages=res_pages, max_num_seqs=1,
            kv_overflow_gb=1.05 * (n_pages - res_pages) * page_size * kv_token / 2**30 + 1e-3,
            lazy_load_budget=budget, lazy_load_predictor=predictor, kv_placement=placement))
        progress(f"lazy {budget} {predictor} {placement}: {reps} runs (the first untimed)")
        later: list = []
        for rep in range(reps):
            detail: list = []
            _, toks = _run(eng, prompt, params, dev, detail)
            if rep or reps == 1:
                later += [d for d in detail if d["block"] >= 1 and d["kind"] == "lazy"]
        med = statistics.median(d["s"] for d in later) if later else None
        wanted = sum(d["wanted"] for d in later)
        out["cases"][placement] = {
            "steps": detail,                               # the last run's
            "timed_lazy_steps": len(later),
            "placement_host_s": eng.runner.overflow.stats["placement_s"],    # all runs
            "lazy_step_s_median": med,
            "lazy_step_over_all_in_gpu": med / all_in_gpu_step if med and all_in_gpu_step
            else None,
            "h2d_bytes_per_lazy_step": (sum(d["h2d_bytes"] for d in later) / len(later)
                                        if later else None),
            "hit_rate": sum(d["hits"] for d in later) / wanted if wanted else None,
            "replacements": eng.runner.overflow.stats["replacements"],
            "tokens_equal_exact": toks == ref_tokens}
        del eng
        gc.collect()
    return out


def table(r: dict) -> str:
    a, b = r["cases"]["all_in_gpu"], r["cases"]["overflow"]
    f = (lambda x: "n/a" if x is None else f"{1e3 * x:.2f} ms")
    med = (lambda xs: statistics.median(xs) if xs else None)
    lines = [
        f"{r['model_shape']} on {r['device_name']}: prompt {r['prompt_len']} + {r['gen']}, "
        f"{r['resident_pages']} of {r['pages']} pages in the GPU pool "
        f"({r['kv_bytes'] / 2**30:.2f} GiB of KV)",
        f"  plain pinned copies: h2d {r['plain_h2d_GBps']:.1f} GB/s, "
        f"d2h {r['plain_d2h_GBps']:.1f} GB/s; {r['non_resident_bytes_per_step'] / 2**30:.2f} GiB "
        f"non-resident per step",
        f"  step: all in GPU {f(a['step_s_median'])}, overflow {f(b['step_s_median'])}, bound "
        f"{f(r['step_bound_s'])} -> {r['step_over_bound'] or float('nan'):.3f}x the bound "
        f"(target <= {r['target_step_over_bound']}); {r['step_over_overlap_bound'] or 0:.3f}x "
        f"max(step, copy {f(r['copy_s'])})",
        f"  block refresh: all in GPU {f(med(a['refresh_s']))}, overflow "
        f"{f(med(b['refresh_s']))}, bound {f(r['refresh_bound_s'])}",
        f"  tokens equal: {r['tokens_equal']}; without --kv-overflow-gb: "
        f"{'refused' if r['refused_without_overflow'] else 'accepted'}",
    ]
    lz = r.get("lazy")
    for name, c in (lz["cases"].items() if lz else ()):
        lines.append(
            f"  lazy {lz['budget']} ({lz['predictor']}, {name}): step {f(c['lazy_step_s_median'])}"
            f" = {c['lazy_step_over_all_in_gpu'] or float('nan'):.3f}x all in GPU, "
            f"{(c['h2d_bytes_per_lazy_step'] or 0) / 2**30:.2f} GiB streamed per step, "
            f"hit rate {c['hit_rate'] if c['hit_rate'] is not None else float('nan'):.2f}")
    return "\n".join(lines)
