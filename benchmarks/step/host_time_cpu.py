"""The host's work in a fused batch-1 step, on the CPU (issue 41): a tiny SDAR-shaped model (the
device part is then negligible and runs eagerly: ``EngineConfig(fused_step=True)`` on the CPU
runs the fused body without a graph), so what is timed is the engine's own host path.

    python3 benchmarks/step/host_time_cpu.py --out benchmarks/results/step/host_time_cpu.json

Each steady fused step (block 4, vanilla, one request) is split with ``perf_counter`` at
``FusedSteps._body`` (the device work) and at ``Engine._apply``: **pre** (step start to the
body), **after body** (the result's copy and ``StepResult``), **apply** (``Engine._apply``) and
the step. Both arms of ``engine/block_summary`` (Python rows, numpy) alternate, ``--rounds``
times each; medians over all their steps. ``benchmarks/step/host_time.py`` is the same split on
a GPU (around the graph replay).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from flash_dllm.bench.shapes import SHAPES
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine import block_summary
from flash_dllm.engine.engine import Engine
from flash_dllm.models.loader import build_model, registry
from flash_dllm.worker.fused_step import FusedSteps

TINY = {**SHAPES["sdar-4b"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": 512, "mask_token_id": 500, "eos_token_id": 501,
        "max_position_embeddings": 512}


def run_arm(rows: bool, steps: int) -> list[dict]:
    block_summary.SMALL_SLOTS = 256 if rows else -1
    cfg = registry.resolve(TINY).parse_config(TINY)
    model = build_model(TINY, "cpu", torch.float32, seed=0)
    eng = Engine(model, cfg, EngineConfig(max_num_seqs=1, num_kv_pages=64, cuda_graphs=False,
                                          fused_step=True))
    gen = 4 * (steps // 3 + 4)                      # 3 fused steps a block of 4
    eng.add_request(list(range(5, 40)), SamplingParams(
        max_tokens=gen, block_length=4, cache="block", early_stop=False, decode="vanilla"))
    cur, out = {}, []
    body, apply = FusedSteps._body, Engine._apply

    def timed_body(*a, **kw):
        cur["b0"] = time.perf_counter()
        r = body(*a, **kw)
        cur["b1"] = time.perf_counter()
        return r

    def timed_apply(self, *a, **kw):
        cur["a0"] = time.perf_counter()
        r = apply(self, *a, **kw)
        cur["a1"] = time.perf_counter()
        return r
    FusedSteps._body, Engine._apply = staticmethod(timed_body), timed_apply
    try:
        for i in range(gen):
            cur.clear()
            t0 = time.perf_counter()
            eng.step()
            t1 = time.perf_counter()
            if "b0" in cur and i >= 8:              # steady fused steps, after a warm-up
                out.append({"pre_us": 1e6 * (cur["b0"] - t0),
                            "after_body_us": 1e6 * (cur["a0"] - cur["b1"]),
                            "apply_us": 1e6 * (cur["a1"] - cur["a0"]),
                            "host_us": 1e6 * (t1 - t0 - (cur["b1"] - cur["b0"]))})
            if not eng.has_unfinished():
                break
    finally:
        FusedSteps._body, Engine._apply = body, apply
        block_summary.SMALL_SLOTS = 256
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    arms = {"python_rows": [], "numpy": []}
    for _ in range(args.rounds):
        for name in arms:
            arms[name] += run_arm(name == "python_rows", args.steps)
    report = {"what": __doc__.split("\n")[0], "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "arms": {}}
    for name, rows in arms.items():
        med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        report["arms"][name] = {"steps": len(rows), **med}
        print(f"{name:12s} " + "  ".join(f"{k} {v}" for k, v in med.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
