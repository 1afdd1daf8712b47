"""The general path after the forward: LM head at the masked slots, proposals, each decode
policy's commit rule (``decoding/policies/``), and the commit into the arena.

Requests of different policies share the step: the step's requests are grouped by policy and
each policy selects over its own requests' slots with one batched call (no per-request loop of
launches).
"""
from __future__ import annotations

import torch

from flash_dllm.decoding.policies import DECODE_POLICIES, SelectContext
from flash_dllm.decoding.sampling import propose
from flash_dllm.worker.extensions import has_hook
from flash_dllm.worker.inputs import StepInputs


def by_policy(batch: list) -> dict:
    """The step's requests grouped by decode policy: policy -> batch indices (batch order)."""
    groups: dict = {}
    for i, req in enumerate(batch):
        groups.setdefault(DECODE_POLICIES[req.params.decode], []).append(i)
    return groups


def sample_and_commit(model, arena: torch.Tensor, mask_id: int, step: StepInputs, states: list,
                      hidden: torch.Tensor, extensions: list) -> tuple[SelectContext, dict]:
    """Propose a token for every masked slot, choose which to keep, and commit them into
    ``arena`` (kept slots take their token, the others stay MASK; no host sync). Returns the
    selection context (tokens, confidence, keep [n_slot] and the per-request counters) and the
    policies' groups."""
    batch, n = step.batch, step.n_slot
    policies = by_policy(batch)
    logits = None
    if not any(p.needs_logits for p in policies) and all(g.temperature <= 0
                                                          for g in step.groups):
        # greedy: the argmax and its probability in one pass, no logits kept (under tensor
        # parallelism not even gathered)
        tokens, conf = model.greedy(hidden[step.slot_rows], mask_id)
    else:
        rows = torch.cat([step.slot_rows] + [p.mask_rows for p in step.plans if p is not None])
        logits = model.logits(hidden[rows])     # [slots + policy rows, V], masked slots only
        tokens, conf = propose(logits[:n], step.groups, forbid=mask_id)
    # NOTE: every slot is MASK unless a policy edits: then its requests' slots are every answer
    # slot of their block, and a slot not kept keeps its current token
    current = (arena.view(-1)[step.slot_flat] if any(p.edits for p in policies) else None)
    ctx = SelectContext(batch, states, [None] * len(batch), tokens, conf, step.slot_pos,
                        step.bounds, torch.zeros_like(conf, dtype=torch.bool), mask_id, logits,
                        step.plans, [ext for ext, _ in extensions if has_hook(ext, "demote")],
                        current)
    for policy, members in policies.items():
        policy.select(ctx, members)
    rest = torch.full_like(ctx.tokens, mask_id) if current is None else current
    new = torch.where(ctx.keep, ctx.tokens, rest)
    arena.view(-1).index_put_((step.slot_flat,), new)
    return ctx, policies
