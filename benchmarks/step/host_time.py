"""``flash-dllm bench step`` with each fused step's host time split out (issue 41: the host's
share of a batch-1 step).

    python3 benchmarks/step/host_time.py [--numpy-summary] [--json-host FILE] -- \
        bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 ...

Around every ``Engine.step`` that replays a fused step graph it records ``perf_counter`` at the
step's start, at ``CUDAGraph.replay``, when ``FusedSteps.run`` returns (after the step's one
device->host copy) and at the step's end: **pre** (scheduling, the plan, the index vector),
**replay to result** (the device's step and the copy) and **post** (``StepResult`` and
``Engine._apply``'s book-keeping). bench step's CUDA-event step time spans all three: the
device idles while the host works. Prints the medians over the last 3/4 of the steps (a line
``HOSTTIME ...``) and writes them to ``--json-host``. ``--numpy-summary``: ``_apply`` reads
the blocks with numpy at any size (``engine/block_summary``'s large-step path, as before the
Python rows), for an A/B in one call. Run bench step with ``--multi-step 1``: a multi-step
call (``engine/multi_step.py``) overlaps these parts, and only its first step is split here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from flash_dllm.engine import block_summary
from flash_dllm.engine.engine import Engine
from flash_dllm.entrypoints.cli import main
from flash_dllm.worker.fused_step import FusedSteps


def instrument() -> list[tuple[float, float, float, float]]:
    """Patch the three clocks in; returns the list the steps' (pre, replay to result, post,
    step) seconds are appended to."""
    rows, cur = [], {}
    replay, run, step = torch.cuda.CUDAGraph.replay, FusedSteps.run, Engine.step

    def timed_replay(self):
        cur["replay"] = time.perf_counter()
        return replay(self)

    def timed_run(self, *a, **kw):
        out = run(self, *a, **kw)
        cur["result"] = time.perf_counter()
        return out

    def timed_step(self):
        cur.clear()
        t0 = time.perf_counter()
        out = step(self)
        t1 = time.perf_counter()
        if "replay" in cur and "result" in cur:
            rows.append((cur["replay"] - t0, cur["result"] - cur["replay"],
                         t1 - cur["result"], t1 - t0))
        return out
    torch.cuda.CUDAGraph.replay, FusedSteps.run, Engine.step = (timed_replay, timed_run,
                                                                  timed_step)
    return rows


def summary(rows) -> dict:
    rows = rows[len(rows) // 4:]
    names = ("pre_replay_us", "replay_to_result_us", "post_us", "step_us")
    return {"steps": len(rows), **{n: round(1e6 * statistics.median(r[i] for r in rows), 1)
                                   for i, n in enumerate(names)}}


def run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numpy-summary", action="store_true")
    ap.add_argument("--json-host")
    if "--" not in argv:
        ap.error("the CLI's arguments go after --")
    i = argv.index("--")
    args = ap.parse_args(argv[:i])
    if args.numpy_summary:
        block_summary.SMALL_SLOTS = -1
    rows = instrument()
    rc = main(argv[i + 1:])
    if rows:
        s = {**summary(rows), "numpy_summary": args.numpy_summary,
             "device_name": torch.cuda.get_device_name(0)}
        print("HOSTTIME " + " ".join(f"{k}={v}" for k, v in s.items()), flush=True)
        if args.json_host:
            with open(args.json_host, "w") as f:
                json.dump(s, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
