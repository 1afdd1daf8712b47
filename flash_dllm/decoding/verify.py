"""Flash-Verify: self draft-and-verify as pure tensor functions (no engine state).

A step of ``decode="verify"`` commits what the threshold rule commits, then *drafts* the rest of
the active block (the proposed tokens, ordered by confidence) for verification. The engine folds
the verification of those drafts into the request's **next** forward as an extra query block:

- draft view ``D_i``: the drafted token ``d_i`` at its slot ``p_i``; its K/V are the only extra
  keys;
- mask view ``M_i``: the row whose logits predict slot ``p_i`` (``p_i - logit_shift``) in the
  canvas with drafts ``d_1 .. d_{i-1}`` filled in and ``p_i`` still MASK.

Attention inside the block (``allow`` below): ``D_i`` and ``M_{i+1}`` see the canvas except slots
``p_1 .. p_i`` (their MASK keys are replaced by the draft keys) plus ``D_1 .. D_i``. So a mask view
sees every earlier draft and never its own. The canvas' own rows never see the block (they compute
exactly what threshold decoding computes), and the block's K/V are never written to the cache.

NOTE: ``M_1`` is the canvas itself (no earlier drafts), so its logits are the normal query's row
for ``p_1``; and ``D_m`` is seen by nobody. A block of ``m`` candidates therefore costs
``2 (m - 1)`` extra rows, and ``m = 1`` costs none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def order_candidates(confidence: torch.Tensor, max_verify: int) -> torch.Tensor:
    """Indices of the ``max_verify`` most confident slots, most confident first; ties keep the
    input order (slots come in canvas order, so the earlier slot wins).

    confidence [n] -> index [min(n, max_verify)] long.
    """
    order = torch.sort(confidence, descending=True, stable=True).indices
    return order[:max_verify]


@dataclass
class VerifyBlock:
    """The extra query rows that verify ``m`` drafts: ``m - 1`` draft views then ``m - 1`` mask
    views (``M_2 .. M_m``). ``allow`` [2 (m - 1), canvas + m - 1] bool: which keys (the canvas,
    then the draft views) each row may attend to."""

    ids: torch.Tensor        # [2 (m - 1)] long
    positions: torch.Tensor  # [2 (m - 1)] long
    allow: torch.Tensor      # [2 (m - 1), canvas + m - 1] bool

    @property
    def num_rows(self) -> int:
        return self.ids.shape[0]

    @property
    def num_keys(self) -> int:
        return self.num_rows // 2


def build_verify_block(canvas: torch.Tensor, cand_pos: torch.Tensor, cand_tok: torch.Tensor,
                       logit_shift: int) -> VerifyBlock:
    """canvas [L] (drafted slots still MASK), cand_pos/cand_tok [m] in verification order."""
    m, L = cand_pos.shape[0], canvas.shape[0]
    dev = canvas.device
    r = torch.arange(m - 1, device=dev)                     # row pair r: D_{r+1} and M_{r+2}
    j = torch.arange(m, device=dev)
    # mask view M_i is the row at p_i - shift holding the canvas token there, unless that slot is
    # an earlier draft (only possible with a shift), in which case it holds the draft
    mv_pos = cand_pos[1:] - logit_shift                      # [m-1]
    mv_ids = canvas[mv_pos]
    if logit_shift:
        hit = (mv_pos[:, None] == cand_pos[None, :]) & (j[None, :] <= r[:, None])   # [m-1, m]
        mv_ids = torch.where(hit.any(1), cand_tok[hit.long().argmax(1)], mv_ids)
    earlier = j[None, :m - 1] <= r[:, None]                  # [m-1, m-1]: draft j is in prefix r
    canvas_allow = torch.ones(m - 1, L, dtype=torch.bool, device=dev)
    canvas_allow[:, cand_pos[:m - 1]] = ~earlier             # hide the MASK keys of those drafts
    pair = torch.cat([canvas_allow, earlier], dim=1)         # [m-1, L + m-1]
    return VerifyBlock(ids=torch.cat([cand_tok[:m - 1], mv_ids]),
                       positions=torch.cat([cand_pos[:m - 1], mv_pos]),
                       allow=torch.cat([pair, pair], dim=0))


def draft_probability(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[token] per row, without materialising probabilities: [N, V], [N] -> [N]."""
    logits = logits.float()
    return (logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)).exp()


LOG_PROB_FLOOR = -1e4      # below any log(gamma) a request can ask for (gamma > e^-10000)


# verify_rule -> whether drafts pass by the running product of the view's probabilities
# (``accept_prefix``'s ``cumprod``) rather than each on its own (config.VERIFY_RULES, tested)
CUMULATIVE_RULES = {"agree": False, "cumprod": True}


def accept_prefix(draft_tok: torch.Tensor, view_tok: torch.Tensor, view_prob: torch.Tensor,
                  group_ids: torch.Tensor, num_groups: int, gamma: torch.Tensor,
                  cumprod: torch.Tensor) -> torch.Tensor:
    """Which candidates pass: the longest passing prefix of each group (request).

    Candidates of a group are contiguous and in verification order. ``view_tok``/``view_prob`` are
    the mask view's own proposal and its probability of the drafted token. Per group:
    ``agree`` (``cumprod[g]`` False): a candidate passes if the view proposes the draft with
    probability >= ``gamma[g]``; ``cumprod``: if the running product of the view probabilities of
    the drafts up to it is >= ``gamma[g]``. Acceptance stops at the first failure.

    draft_tok/view_tok/view_prob/group_ids [N]; gamma [G] float; cumprod [G] bool -> accept [N].
    """
    n = draft_tok.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=draft_tok.device)
    g = group_ids
    gam = gamma.double()[g]
    agree_ok = (view_tok == draft_tok) & (view_prob.double() >= gam)
    # running log-product inside each group: global cumsum minus what came before the group.
    # NOTE: a probability of 0 (float32 underflow, or a padding slot) is floored, not -inf: an
    # -inf in the global cumsum would make every later group's differences NaN (never passing)
    logp = torch.log(view_prob.double()).clamp(min=LOG_PROB_FLOOR)
    cs = torch.cumsum(logp, 0)
    idx = torch.arange(n, device=g.device)
    start = torch.full((num_groups,), n, dtype=idx.dtype, device=g.device)
    start = start.scatter_reduce(0, g, idx, reduce="amin")
    before = (cs - logp)[start.clamp(max=n - 1)]             # sum of logs before each group
    cumprod_ok = (cs - before[g]) >= torch.log(gam)
    ok = torch.where(cumprod[g], cumprod_ok, agree_ok)
    first_fail = torch.full((num_groups,), n, dtype=idx.dtype, device=g.device)
    first_fail = first_fail.scatter_reduce(0, g, torch.where(ok, torch.full_like(idx, n), idx),
                                           reduce="amin")
    return idx < first_fail[g]


def select_after_verify(confidence: torch.Tensor, group_ids: torch.Tensor, num_groups: int,
                        threshold: torch.Tensor, available: torch.Tensor, demoted: torch.Tensor,
                        accepted_any: torch.Tensor) -> torch.Tensor:
    """The threshold rule on the slots verification left masked.

    Commit every ``available`` slot with confidence >= its group's threshold unless a sentinel
    ``demoted`` it (it is drafted for verification instead). A group that commits nothing this
    forward (no accepted draft, no passing slot) commits its single most confident available slot,
    preferring undemoted ones, so every forward makes progress. With nothing accepted and nothing
    demoted this is exactly ``select_threshold``.

    confidence/group_ids/available/demoted [N]; threshold [G]; accepted_any [G] bool -> keep [N].
    """
    n = confidence.shape[0]
    keep = available & ~demoted & (confidence >= threshold[group_ids])
    done = accepted_any.long().scatter_reduce(0, group_ids, keep.long(), reduce="amax").bool()
    idx = torch.arange(n, device=confidence.device)
    # (a fill, not torch.tensor: no host->device copy, so a CUDA graph can capture it)
    neg = torch.full((), float("-inf"), dtype=confidence.dtype, device=confidence.device)
    for pool in (available & ~demoted, available):
        need = ~done[group_ids] & pool
        score = torch.where(need, confidence, neg)
        best = torch.full((num_groups,), float("-inf"), dtype=confidence.dtype,
                          device=confidence.device)
        best = best.scatter_reduce(0, group_ids, score, reduce="amax")
        cand = torch.where(need & (score == best[group_ids]), idx, torch.full_like(idx, n))
        first = torch.full((num_groups,), n, dtype=idx.dtype, device=idx.device)
        first = first.scatter_reduce(0, group_ids, cand, reduce="amin")
        pick = idx == first[group_ids]
        keep |= pick
        done = done.long().scatter_reduce(0, group_ids, pick.long(), reduce="amax").bool()
    return keep
