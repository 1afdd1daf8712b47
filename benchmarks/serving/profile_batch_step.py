"""Why a serving step grows with the batch (issue 21): host and device work per step at fixed
concurrency, engine only (no HTTP).

    python benchmarks/serving/profile_batch_step.py --device cuda --batch 1 8 22 32 --out prof.json

For each batch size B: the demo model (or ``--model``) with serve's engine settings, B requests
of ``bench serve``'s prompts (arith test problems, the server's default sampling), kept at B by
adding a new request whenever one finishes. After ``--warm`` steps (graphs captured, kernels
compiled) it times ``--steps`` steps three ways:

- wall time per step (no profiler);
- cProfile of the same loop: where the host time goes, by function (cumulative), including the
  time the step's one device->host copy waits for the GPU (``Tensor.cpu`` / ``numpy``);
- ``torch.profiler``: kernel launches, graph launches and memcpys per step, and GPU busy time.

Prints a table and writes the JSON report (one-off diagnostics: FINDINGS cites what it showed).

Why a verify step costs ~20x a threshold step at batch 1 on the H200 (issue 17, FINDINGS):

    python benchmarks/serving/profile_batch_step.py --device cuda --model proxy-dream \
        --suite chain \
        --max-tokens 256 --cache dual --decode verify --gamma 0.8 --batch 1 --out verify.json
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import time
from collections import Counter

import torch

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.entrypoints.serve import SERVE_DEFAULTS
from flash_dllm.evals.tasks import get_suite
from flash_dllm.worker.warmup import default_level, filler, warm_up


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Loop:
    """Keeps ``batch`` requests running: a finished one is replaced at once."""

    def __init__(self, llm: LLM, batch: int, params: SamplingParams, prompts: list[list[int]]):
        self.engine, self.batch, self.params, self.prompts = llm.engine, batch, params, prompts
        self.i = 0
        self.live = set()
        for _ in range(batch):
            self._add()

    def _add(self):
        ids = self.prompts[self.i % len(self.prompts)]
        self.i += 1
        self.live.add(self.engine.add_request(ids, self.params).request_id)

    def step(self) -> None:
        outs = self.engine.step()
        for o in outs:
            if o.finished:
                self.live.discard(o.request_id)
                self._add()

    def drain(self):
        for rid in list(self.live):
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()


def host_profile(loop: Loop, steps: int, top: int) -> list[dict]:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        loop.step()
    pr.disable()
    st = pstats.Stats(pr, stream=io.StringIO())
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{file.split('flash_dllm/')[-1]}:{line}:{fn}",
                     "calls_per_step": nc / steps, "self_ms_per_step": 1e3 * tt / steps,
                     "cum_ms_per_step": 1e3 * ct / steps})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    return rows[:top]


def device_profile(loop: Loop, steps: int, dev) -> dict:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            loop.step()
        _sync(dev)
    runtime, kernels, ops, kernel_us = Counter(), Counter(), Counter(), Counter()
    gpu_us = 0.0
    from torch.autograd import DeviceType
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels[e.name] += 1
            kernel_us[e.name[:80]] += e.time_range.elapsed_us()
            gpu_us += e.time_range.elapsed_us()
        elif e.name.startswith("cuda"):
            runtime[e.name] += 1
        elif e.name.startswith("aten::"):
            ops[e.name] += 1
    per = lambda c: {k: v / steps for k, v in c.most_common(25)}     # noqa: E731
    return {"runtime_calls_per_step": per(runtime), "gpu_activities_per_step": per(kernels),
            "aten_ops_per_step": per(ops),
            "gpu_ms_per_step_by_kernel": {k: v / 1e3 / steps for k, v in kernel_us.most_common(15)}, "aten_ops_total_per_step": sum(ops.values()) / steps,
            "gpu_busy_ms_per_step": gpu_us / 1e3 / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--model-shape", default=None,
                    help="a random-init model of a real shape (llada-8b, dream-7b) instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 22, 32])
    ap.add_argument("--warm", type=int, default=60)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode", default=None)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--gamma", type=float, default=None)
    ap.add_argument("--suite", default="arith",
                    help="whose test prompts keep the batch full (chain, code-long: the proxies' "
                         "long answers; pass --max-tokens 256 with them)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    config = EngineConfig(max_num_seqs=64, prefix_reuse=SERVE_DEFAULTS["prefix_reuse"])
    if a.model_shape:
        from types import SimpleNamespace

        from flash_dllm.entrypoints.args import EngineArgs
        from flash_dllm.entrypoints.loader import load_random_engine
        args = EngineArgs(device=a.device, dtype=a.dtype or "auto", kv_cache_gb=None)
        # the pool serve would size (an 8B model's batch does not fit the 1 GiB default)
        loaded = load_random_engine(a.model_shape, args,
                                    **{**dataclasses.asdict(config), **args.kv_sizing()})
        llm = SimpleNamespace(engine=loaded.engine, tokenizer=loaded.tokenizer,
                              cfg=loaded.engine.cfg)
    else:
        llm = LLM(a.model, device=a.device, dtype=a.dtype or "auto", max_num_seqs=64,
                  engine_config=config)
    dev = llm.engine.device
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    if dev.type == "cuda":
        t0 = time.perf_counter()
        warm_up(llm.engine, default_level(dev), filler(llm.cfg, llm.tokenizer.encode("1+1=")))
        llm.engine.graphs_ready()
        print(f"warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    knobs = {"max_tokens": a.max_tokens}
    if a.decode:
        knobs["decode"] = a.decode
    if a.cache:
        knobs["cache"] = a.cache
    for name in ("threshold", "gamma"):
        if getattr(a, name) is not None:
            knobs[name] = getattr(a, name)
    params = SamplingParams(**knobs)
    prompts = [llm.tokenizer.encode(p.prompt)
               for p in get_suite(a.suite).test_problems(128, seed=0)]
    report = {"device": str(dev), "dtype": dtype, "model": a.model_shape or a.model or "demo",
              "suite": a.suite, "params": knobs, "runs": []}
    for b in a.batch:
        loop = Loop(llm, b, params, prompts)
        for _ in range(a.warm):
            loop.step()
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loop.step()
        _sync(dev)
        wall = 1e3 * (time.perf_counter() - t0) / a.steps
        host = host_profile(loop, a.steps, a.top)
        devp = device_profile(loop, min(a.steps, 30), dev)
        loop.drain()
        run = {"batch": b, "step_ms": wall, "host_top": host, **devp}
        report["runs"].append(run)
        print(f"\n=== batch {b}: {wall:.2f} ms/step, GPU busy {devp['gpu_busy_ms_per_step']:.2f} "
              f"ms/step, aten ops {devp['aten_ops_total_per_step']:.0f}/step")
        print("runtime calls/step:", {k: round(v, 1) for k, v in
                                      devp["runtime_calls_per_step"].items()})
        for k, v in devp["gpu_ms_per_step_by_kernel"].items():
            print(f"  GPU {v:7.3f} ms/step  {k}")
        for r in host[:a.top]:
            print(f"  {r['self_ms_per_step']:7.3f} self {r['cum_ms_per_step']:7.3f} cum "
                  f"{r['calls_per_step']:6.1f} calls  {r['function']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
