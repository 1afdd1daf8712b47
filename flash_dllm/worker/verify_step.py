"""Engine side of ``decode="verify"`` and the sentinels: per-request drafts in, commits out.

The tensor rules live in ``flash_dllm.decoding.verify`` / ``.sentinels``; this module holds what
needs a request: its knobs (``req.params``), its device state in the runner (``st``: pending
drafts, generators, top-k history) and its counters of this step (``counters``: a dict in
``new_counters`` layout, handed back in ``StepResult``). The runner calls, in order:

1. ``plan_verification`` while packing the batch: the verification block of the drafts proposed by
   the request's previous forward (folded into this forward: no extra forward);
2. ``select_verify`` after the LM head: accept the longest passing prefix of drafts from the mask
   views, then the threshold rule (with sentinel demotions) on the slots still masked;
3. ``update_drafts`` after committing: the still-masked slots of the block become the next drafts;
4. ``kv_consistency`` for requests with the KV sentinel on.

NOTE (invariant): a request's drafts are slots that were masked after its last commit, and nothing
commits between two of its forwards, so every draft is still a masked slot of the active block when
it is verified. Drafts are dropped when the block completes (``ModelRunner`` resets a
request's per-block state when its block advances).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flash_dllm.core.counters import count as _count
from flash_dllm.decoding.policies import group_ids
from flash_dllm.decoding.sampling import RowGroup, propose
from flash_dllm.decoding.sentinels import entropy, perturbation_flips, topk_jaccard
from flash_dllm.decoding.verify import (VerifyBlock, accept_prefix, build_verify_block,
                                        draft_probability, order_candidates, select_after_verify)
from flash_dllm.layers.attention_backend import VerifyRows
from flash_dllm.transfer import h2d


@dataclass
class VerifyPlan:
    """Candidates ``cand_pos``/``cand_tok`` [m] (verification order) and their extra rows."""

    cand_pos: torch.Tensor
    cand_tok: torch.Tensor
    block: VerifyBlock | None      # None when m == 1 (M_1 is the canvas row itself)
    rows: VerifyRows | None
    mask_rows: torch.Tensor        # [m - 1] packed rows of the mask views M_2 .. M_m


def plan_verification(req, st, logit_shift: int, start: int) -> VerifyPlan | None:
    """The verification block for ``req``'s pending drafts (``st.drafts``), packed from row
    ``start`` on."""
    if req.params.decode != "verify" or st.drafts is None:
        return None
    pos, tok = st.drafts
    m = pos.shape[0]
    if m == 0:
        return None
    if m == 1:
        return VerifyPlan(pos, tok, None, None, pos.new_empty(0))
    blk = build_verify_block(st.canvas, pos, tok, logit_shift)
    rows = VerifyRows(start, start + blk.num_rows, blk.num_keys, blk.allow)
    mask_rows = torch.arange(start + m - 1, start + 2 * (m - 1), device=pos.device)
    return VerifyPlan(pos, tok, blk, rows, mask_rows)


def select_verify(batch, states, counters: list, plans: list[VerifyPlan | None],
                  logits: torch.Tensor, n_slot: int, tokens: torch.Tensor, conf: torch.Tensor,
                  positions: torch.Tensor, bounds: list[tuple[int, int]], keep: torch.Tensor,
                  mask_id: int) -> None:
    """Fill ``keep`` (and ``tokens`` of accepted drafts) for the verify requests of ``batch``.

    ``logits`` [n_slot + mask views, V]: the masked slots' rows first (``tokens``/``conf`` are their
    proposals), then the mask views of every plan, in batch order.
    """
    vidx = [i for i, r in enumerate(batch) if r.params.decode == "verify"]
    G, dev = len(vidx), conf.device
    gid = group_ids(positions.shape[0], [bounds[i] for i in vidx], dev)
    sel = gid >= 0
    gsel = gid[sel]
    available = torch.ones_like(positions, dtype=torch.bool)    # masked and not accepted

    # 1. accept the longest passing prefix of last forward's drafts
    accepted_any = torch.zeros(G, dtype=torch.bool, device=dev)
    cand_rows, cand_tok, cand_gid, cand_slot, vgroups = [], [], [], [], []
    off, n_cand = n_slot, 0
    for g, i in enumerate(vidx):
        plan = plans[i]
        if plan is None:
            continue
        s, e = bounds[i]
        m = plan.cand_pos.shape[0]
        slot = s + torch.searchsorted(positions[s:e], plan.cand_pos)      # slot row per draft
        cand_rows.append(torch.cat([slot[:1], torch.arange(off, off + m - 1, device=dev)]))
        cand_tok.append(plan.cand_tok)
        cand_gid.append(torch.full((m,), g, dtype=torch.long, device=dev))
        cand_slot.append(slot)
        p = batch[i].params
        vgroups.append(RowGroup(n_cand, n_cand + m, p.temperature, p.top_k, p.top_p,
                                states[i].generator))
        off += m - 1
        n_cand += m
        _count(counters, i, "verify_candidates", m)
    if cand_rows:
        vlog = logits[torch.cat(cand_rows)]                                # [candidates, V]
        ctok, cgid, cslot = torch.cat(cand_tok), torch.cat(cand_gid), torch.cat(cand_slot)
        view_tok, _ = propose(vlog, vgroups, forbid=mask_id)
        view_prob = draft_probability(vlog, ctok)
        gamma = h2d([batch[i].params.gamma for i in vidx], torch.float64, dev)
        cumprod = h2d([batch[i].params.verify_rule == "cumprod" for i in vidx], torch.bool, dev)
        acc = accept_prefix(ctok, view_tok, view_prob, cgid, G, gamma, cumprod)
        keep[cslot[acc]] = True
        tokens[cslot[acc]] = ctok[acc]
        available[cslot[acc]] = False
        accepted_any[cgid[acc]] = True
        n_acc = torch.bincount(cgid[acc], minlength=G).tolist()
        for g, i in enumerate(vidx):
            _count(counters, i, "verify_accepted", n_acc[g])

    # 2. sentinels demote threshold-passing slots to drafts
    tau = h2d([batch[i].params.threshold for i in vidx], conf.dtype, dev)
    passing = torch.zeros_like(available)
    passing[sel] = available[sel] & (conf[sel] >= tau[gsel])
    demoted = torch.zeros_like(available)
    h_max = [batch[i].params.entropy_max for i in vidx]
    if any(h is not None for h in h_max):
        hm = h2d([float("inf") if h is None else h for h in h_max], torch.float32, dev)
        on = torch.zeros_like(available)
        on[sel] = h2d([h is not None for h in h_max], torch.bool, dev)[gsel]
        rows = torch.nonzero(passing & on).squeeze(-1)
        trig = entropy(logits[rows]) > hm[gid[rows]]
        demoted[rows[trig]] = True
        checks = torch.bincount(gid[rows], minlength=G).tolist()
        trigs = torch.bincount(gid[rows[trig]], minlength=G).tolist()
        for g, i in enumerate(vidx):
            _count(counters, i, "sentinel_checks", checks[g], "entropy")
            _count(counters, i, "sentinel_triggers", trigs[g], "entropy")
    for i in vidx:
        req, st, sigma = batch[i], states[i], batch[i].params.perturb_sigma
        if sigma is None:
            continue
        s, e = bounds[i]
        rows = s + torch.nonzero(passing[s:e]).squeeze(-1)
        if rows.numel() == 0:
            continue
        if st.sentinel_generator is None:
            seed = req.params.seed if req.params.seed is not None else 0
            st.sentinel_generator = torch.Generator(device=dev).manual_seed(seed)
        trig = perturbation_flips(logits[rows], sigma, st.sentinel_generator, forbid=mask_id)
        demoted[rows[trig]] = True
        _count(counters, i, "sentinel_checks", rows.numel(), "perturbation")
        _count(counters, i, "sentinel_triggers", int(trig.sum()), "perturbation")

    # 3. the threshold rule on what is left (at least one commit per forward in all)
    keep[sel] |= select_after_verify(conf[sel], gsel, G, tau, available[sel], demoted[sel],
                                     accepted_any)


def update_drafts(req, st, tokens: torch.Tensor, conf: torch.Tensor, positions: torch.Tensor,
                  keep: torch.Tensor) -> None:
    """After a verify request's commits: its still-masked block slots become the next drafts
    (this forward's proposals, most confident first, at most ``max_verify``). Slices are the
    request's own slot rows."""
    remain = ~keep
    if req.params.decode != "verify" or not bool(remain.any()):
        st.drafts = None
        return
    order = order_candidates(conf[remain], req.params.max_verify)
    st.drafts = (positions[remain][order], tokens[remain][order])


def kv_consistency(req, st, probe_weights: torch.Tensor | None, masked: torch.Tensor,
                   counters: list, i: int) -> None:
    """Compare each probed slot's top-k attended keys with its previous step's; where the Jaccard
    overlap is below ``kv_jaccard_min``, mark those keys for recomputation in the next forward
    (their cached K/V are rewritten; ``cache="none"`` recomputes everything anyway)."""
    if probe_weights is None or masked.numel() == 0:
        return
    p = req.params
    k = min(p.kv_top_k, probe_weights.shape[1])
    top = probe_weights.topk(k, dim=-1).indices                               # [slots, k]
    if st.kv_history is None or st.kv_history.shape[1] != k:
        st.kv_history = torch.full((p.block_length, k), -1, dtype=torch.long, device=top.device)
    local = masked - req.block_start
    prev = st.kv_history[local]
    valid = prev[:, 0] >= 0
    trig = valid & (topk_jaccard(prev, top) < p.kv_jaccard_min)
    st.kv_history[local] = top
    _count(counters, i, "sentinel_checks", int(valid.sum()), "kv_consistency")
    n_trig = int(trig.sum())
    _count(counters, i, "sentinel_triggers", n_trig, "kv_consistency")
    if n_trig:
        st.refresh = torch.unique(top[trig])
