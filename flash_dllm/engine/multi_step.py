"""Multi-step: one ``Engine.step`` call runs several steady fused steps of one plan, each
launched before the host has applied the ones before it.

A fused step is one graph replay followed by host work: reading its output, ``Engine._apply``,
the next plan (~0.15-0.25 ms a step at batch 1 on an H100, ``benchmarks/findings/moe.md``). While
the host works the GPU idles, and SDAR-4B's batch-1 step is ~4 ms. Within a block the device
needs nothing from the host: the canvas arena holds the committed tokens and the next step reads
them there (``worker/fused_step.py``). What the host must know to *launch* the next step is its
plan and index vector, and for a policy whose commit count does not depend on the model's
output (``vanilla``: exactly min(k, masked) slots a step) those are known in advance until the
step that ends the block (``DecodePolicy.fused_ahead``). So the call launches the step and the
known steps after it (at most ``EngineConfig.multi_step`` in all), then waits for and applies
each in order: the host's work on step i overlaps the device's run of step i + 1.

A call runs one step, as before, whenever anything could change the plan between steps: a
request that may be admitted (one waits and a running slot is free), tier ops or host tiers, a
policy that cannot say its next steps, a request at its block's first step (the general path),
or a step shape without a captured graph. Requests never finish or change block inside the run
(only the step that leaves no MASK ends a block, and it is the last one launched); ``_apply``
checks that anyway before each step after the first. Outputs are merged: one ``StepOutput`` per
request per call, its new tokens in order.
"""
from __future__ import annotations

import time

from flash_dllm.core.plan import StepPlan
from flash_dllm.core.request import StepOutput
from flash_dllm.decoding.policies import DECODE_POLICIES


# a call launches ahead only as many steps as fit in this many seconds at the median time of the
# engine's last RECENT_STEPS steps (a request that arrives meanwhile waits for the call to end
# before it is admitted). The median, not the mean: a step that compiled kernels or captured a
# graph takes seconds
CALL_SECONDS = 0.05
RECENT_STEPS = 9


def steps_per_call(config, runner) -> int:
    """``EngineConfig.multi_step``, or its default: 4 with CUDA graphs and fused steps, else 1."""
    if config.multi_step is not None:
        return config.multi_step
    return 4 if runner.forward_graphs is not None and runner.fused is not None else 1


def steps_ahead(engine, plan: StepPlan) -> list[tuple[list, list]]:
    """The steps after this one that one call may launch now, each as (the requests' policy
    signatures, each request's MASK slots before it): [] when the call runs this step alone."""
    n = engine.multi_step - 1
    if n <= 0:
        return []
    recent = sorted(engine.recent_steps)
    if recent and recent[len(recent) // 2] > 0:
        fit = engine.multi_step_seconds / recent[len(recent) // 2]
        n = min(n, int(min(fit, n + 1)) - 1)
    sch = engine.scheduler
    if (n <= 0 or plan.ops or not plan.seqs
            or (sch.waiting and len(sch.running) < sch.max_num_seqs)):   # an admission may be due
        return []
    reqs = plan.requests
    name = reqs[0].params.decode
    if any(r.params.decode != name or r.first_step for r in reqs):
        return []
    policy = DECODE_POLICIES[name]
    per = [policy.fused_ahead(r, n) for r in reqs]
    known = min(len(p) for p in per)
    return [([p[j][0] for p in per], [p[j][1] for p in per]) for j in range(known)]


def run(engine, plan: StepPlan, t0: float) -> list[StepOutput] | None:
    """Launch this step of ``plan`` and the known steps after it (``steps_ahead``), then apply
    them in order. None (nothing ran, nothing counted): the caller runs this step alone (also
    when its shape has no captured graph yet: the caller's path counts the sighting)."""
    ahead = steps_ahead(engine, plan)
    if not ahead:
        return None
    runner = engine.runner
    first = runner.launch(plan)
    if first is None:
        return None
    launched = [first]
    for sig, masks in ahead:
        nxt = runner.launch(plan, (sig, sum(masks)))
        if nxt is None:              # (no captured graph for it yet)
            break
        launched.append(nxt)
    blocks = [r.block for r in plan.requests]
    steps = []
    for i, step in enumerate(launched):
        result = step.result()
        if i and any(r.finished or r.block != b or r.num_masked != m for r, b, m
                     in zip(plan.requests, blocks, ahead[i - 1][1])):
            raise RuntimeError("multi-step: a request's block did not stand where the step "
                               "launched for it assumed (a decode policy's fused_ahead was "
                               "wrong)")
        steps.append(engine._apply(plan, result, t0))
        t0 = time.perf_counter()
    engine.stats["multi_step_calls"] += len(launched) > 1
    return merge(steps)


def merge(steps: list[list[StepOutput]]) -> list[StepOutput]:
    """One ``StepOutput`` per request for several steps' outputs (in step order)."""
    if len(steps) == 1:
        return steps[0]
    by: dict[str, StepOutput] = {}
    for outs in steps:
        for o in outs:
            p = by.get(o.request_id)
            by[o.request_id] = o if p is None else StepOutput(
                o.request_id, p.new_token_ids + o.new_token_ids, o.num_tokens,
                p.num_committed + o.num_committed, o.finished, o.finish_reason)
    return list(by.values())
