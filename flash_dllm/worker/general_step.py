"""The general step: any batch, any policies, cache modes and step extensions, in one forward.

1. the policies' state that a fused step left on the device comes back (``before_general``);
2. ``inputs.pack_step``: the packed ids and positions (windows, cache modes' and extensions'
   extra positions, policies' extra rows) and the attention metadata;
3. the forward (from a ``forward`` CUDA graph when one fits, ``worker/graphs.py``);
4. ``sampler.sample_and_commit``: LM head at the masked slots, proposals, commit rules, commit;
5. the policies' ``after_commit`` and the extensions' device work, then the step's ONE
   device->host copy: the active blocks, with a column per extension that asked for one;
6. the extensions' ``read_back`` results go to the engine in ``StepResult.extensions``.

The fused step (``worker/fused_step.py``) does 2-5 in one graph for the steps it can take.
"""
from __future__ import annotations

import torch

from flash_dllm.core.plan import StepPlan, StepResult
from flash_dllm.worker import inputs
from flash_dllm.worker.extensions import has_hook
from flash_dllm.worker.sampler import by_policy, sample_and_commit


def run(runner, plan: StepPlan, states: list, extensions: list) -> StepResult:
    """One general step of ``plan`` on ``runner`` (``states``: its requests' runner states;
    ``extensions``: the step extensions active on it, each with its members)."""
    batch = plan.requests
    for policy in by_policy(batch):
        policy.before_general(runner, states)
    step = inputs.pack_step(runner, plan, states, extensions)
    for ext, _ in extensions:
        if has_hook(ext, "wrap_metadata"):
            ext.wrap_metadata(runner, plan, step)
    hidden = runner.forward(step.ids, step.positions, step.meta)
    for ext, members in extensions:
        if has_hook(ext, "after_forward"):
            ext.after_forward(runner, step, states, members)
    ctx, policies = sample_and_commit(runner.model, runner.arena, runner.cfg.mask_token_id,
                                      step, states, hidden, extensions)
    for policy, members in policies.items():
        for i in members:
            s, e = step.bounds[i]
            policy.after_commit(batch[i], states[i], ctx.tokens[s:e], ctx.conf[s:e],
                                step.slot_pos[s:e], ctx.keep[s:e])
    columns = []                        # (extension, members, device column [B] or None)
    for ext, members in extensions:
        if has_hook(ext, "after_commit"):
            columns.append((ext, members, ext.after_commit(runner, step, states, members,
                                                           ctx.counters)))
    blocks = runner.arena.view(-1)[step.blk_idx].view(len(batch), step.max_bl)
    extra = [c for _, _, c in columns if c is not None]
    if extra:        # they ride on the step's one device->host copy
        blocks = torch.cat([blocks] + [c[:, None] for c in extra], 1)
    host = blocks.cpu().numpy()                                              # the one copy
    bl = step.max_bl
    col = {}
    for ext, _, c in columns:
        if c is not None:
            col[ext.name] = host[:, bl + len(col)]
    results = {}
    for ext, members in extensions:
        if has_hook(ext, "read_back"):
            value = ext.read_back(runner, step, members, col.get(ext.name), ctx.counters)
            if value is not None:
                results[ext.name] = value
    return StepResult(host[:, :bl], ctx.counters, extensions=results)
