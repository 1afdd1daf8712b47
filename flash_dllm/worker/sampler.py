"""The general path after the forward: LM head at the masked slots, proposals, commit rules
(``decoding/policies.py``), Flash-Verify's acceptance, and the commit into the arena.

Requests of different policies share the step: each policy selects over its own requests' slots
with one batched call (no per-request loop of launches).
"""
from __future__ import annotations

import torch

from flash_dllm.decoding.policies import group_ids, select_threshold, select_top_k
from flash_dllm.decoding.sampling import propose
from flash_dllm.decoding.schedule import transfer_count
from flash_dllm.transfer import h2d
from flash_dllm.worker.inputs import StepInputs
from flash_dllm.worker.verify_step import select_verify


def sample_and_commit(model, arena: torch.Tensor, mask_id: int, step: StepInputs, batch: list,
                      states: list, hidden: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Propose a token for every masked slot, choose which to keep, and commit them into
    ``arena`` (kept slots take their token, the others stay MASK; no host sync). Returns
    (tokens, confidence, keep) [n_slot] and the per-request verify/sentinel counters."""
    n = step.n_slot
    verify = any(r.params.decode == "verify" for r in batch)
    if not verify and all(g.temperature <= 0 for g in step.groups):
        # greedy: the argmax and its probability in one pass, no logits kept (under tensor
        # parallelism not even gathered)
        tokens, conf = model.greedy(hidden[step.slot_rows], mask_id)
    else:
        rows = torch.cat([step.slot_rows] + [p.mask_rows for p in step.plans if p is not None])
        logits = model.logits(hidden[rows])     # [slots + mask views, V], masked slots only
        tokens, conf = propose(logits[:n], step.groups, forbid=mask_id)
    keep = select(batch, conf, step.slot_pos, step.bounds)
    counters: list = [None] * len(batch)
    if verify:
        select_verify(batch, states, counters, step.plans, logits, n, tokens, conf,
                      step.slot_pos, step.bounds, keep, mask_id)
    new = torch.where(keep, tokens, torch.full_like(tokens, mask_id))
    arena.view(-1).index_put_((step.slot_flat,), new)
    return tokens, conf, keep, counters


def select(batch: list, conf: torch.Tensor, positions: torch.Tensor,
           bounds: list[tuple[int, int]]) -> torch.Tensor:
    """The commit rule of every ``vanilla`` and ``threshold`` request (``verify`` requests are
    decided by ``select_verify``). conf/positions [n_slot] -> keep [n_slot] bool."""
    keep = torch.zeros_like(conf, dtype=torch.bool)
    by_policy: dict[str, list[int]] = {}
    for i, req in enumerate(batch):
        by_policy.setdefault(req.params.decode, []).append(i)
    if "vanilla" in by_policy:
        idx = by_policy["vanilla"]
        keep |= select_top_k(conf, positions, [bounds[i] for i in idx],
                             [transfer_count(batch[i]) for i in idx],
                             [batch[i].canvas_len for i in idx])
    if "threshold" in by_policy:
        idx = by_policy["threshold"]
        gid = group_ids(conf.shape[0], [bounds[i] for i in idx], conf.device)
        # rows of other policies join a last, never-passing group (no boolean indexing,
        # which would sync), and are masked out of the result
        G = len(idx)
        tau = h2d([batch[i].params.threshold for i in idx] + [float("inf")], conf.dtype,
                  conf.device)
        mine = gid >= 0
        keep |= select_threshold(conf, torch.where(mine, gid, G), G + 1, tau) & mine
    return keep
