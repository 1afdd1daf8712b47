"""``verify`` (Flash-Verify): threshold commits, then the rest of the block is drafted and checked
inside the request's next forward (``decoding/verify.py`` holds the tensor rules).

What a request of this policy does in a step, on the general path:

1. ``extra_rows`` while the step is packed: the verification block of the drafts proposed by the
   request's previous forward (folded into this forward: no extra forward);
2. ``select`` after the LM head: accept the longest passing prefix of drafts from the mask views,
   then the threshold rule on the slots still masked, where the step's sentinels (extensions with
   a ``demote`` hook: entropy, perturbation) may turn a passing slot into a draft;
3. ``after_commit``: the still-masked slots of the block become the next drafts.

Its fused step is a body of its own (``verify_fused.py``): the drafts wait in a device-side
``DraftStore`` between replays; ``before_general`` / ``before_fused`` move them between the store
and the request's runner state (``state.drafts``), so the two paths can follow each other at any
step.

NOTE (invariant): a request's drafts are slots that were masked after its last commit, and nothing
commits between two of its forwards, so every draft is still a masked slot of the active block when
it is verified. Drafts are dropped when the block completes (the runner resets a request's
per-block state when its block advances).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.core.counters import count
from flash_dllm.decoding.policies import verify_fused
from flash_dllm.decoding.policies.base import DecodePolicy
from flash_dllm.decoding.policies.rules import group_ids
from flash_dllm.decoding.sampling import RowGroup, propose
from flash_dllm.decoding.verify import (CUMULATIVE_RULES, VerifyBlock, accept_prefix,
                                        build_verify_block, draft_probability, order_candidates,
                                        select_after_verify)
from flash_dllm.layers.attention_backend import VerifyRows
from flash_dllm.transfer import h2d

DraftStore, IN_STORE = verify_fused.DraftStore, verify_fused.IN_STORE


@dataclass
class VerifyPlan:
    """Candidates ``cand_pos``/``cand_tok`` [m] (verification order) and their extra rows."""

    cand_pos: torch.Tensor
    cand_tok: torch.Tensor
    block: VerifyBlock | None      # None when m == 1 (M_1 is the canvas row itself)
    rows: VerifyRows | None
    mask_rows: torch.Tensor        # [m - 1] packed rows of the mask views M_2 .. M_m


class VerifyPolicy(DecodePolicy):
    name = "verify"
    needs_logits = True
    adds_rows = True
    warm_up = True
    fusable = True
    own_knobs = ("entropy_max", "perturb_sigma")     # its sentinels act on verification rows
    # a fused verify step's largest tensor (logits, gathered canvas K or V, attention scores;
    # ``verify_fused.fits``), in elements: 2**27 is 256 MiB of bf16 logits, LLaDA-8B's
    # vocabulary at batch 16 with 32 + 32 rows per request
    MAX_ELEMENTS = 2 ** 27

    # ------------------------------------------------------------------------------ general path
    def extra_rows(self, req, state, logit_shift, start):
        """The verification block for ``req``'s pending drafts (``state.drafts``), packed from
        row ``start`` on."""
        if state.drafts is None:
            return None
        pos, tok = state.drafts
        m = pos.shape[0]
        if m == 0:
            return None
        if m == 1:
            return VerifyPlan(pos, tok, None, None, pos.new_empty(0))
        blk = build_verify_block(state.canvas, pos, tok, logit_shift)
        rows = VerifyRows(start, start + blk.num_rows, blk.num_keys, blk.allow)
        mask_rows = torch.arange(start + m - 1, start + 2 * (m - 1), device=pos.device)
        return VerifyPlan(pos, tok, blk, rows, mask_rows)

    def select(self, ctx, members):
        """``ctx.logits`` [n_slot + mask views, V]: the masked slots' rows first (``ctx.tokens``/
        ``ctx.conf`` are their proposals), then the mask views of every plan, in batch order."""
        batch, positions, conf = ctx.batch, ctx.positions, ctx.conf
        G, dev = len(members), conf.device
        gid = group_ids(positions.shape[0], [ctx.bounds[i] for i in members], dev)
        sel = gid >= 0
        gsel = gid[sel]
        available = torch.ones_like(positions, dtype=torch.bool)   # masked and not accepted
        accepted_any = self._accept(ctx, members, gid, available)
        # the sentinels demote threshold-passing slots to drafts
        tau = h2d([batch[i].params.threshold for i in members], conf.dtype, dev)
        passing = torch.zeros_like(available)
        passing[sel] = available[sel] & (conf[sel] >= tau[gsel])
        demoted = torch.zeros_like(available)
        for ext in ctx.demoters:
            demoted |= ext.demote(ctx, members, passing, gid)
        # the threshold rule on what is left (at least one commit per forward in all)
        ctx.keep[sel] |= select_after_verify(conf[sel], gsel, G, tau, available[sel],
                                             demoted[sel], accepted_any)

    @staticmethod
    def _accept(ctx, members, gid, available) -> torch.Tensor:
        """Accept the longest passing prefix of each member's last drafts (their tokens into
        ``ctx.tokens``, their slots into ``ctx.keep``, out of ``available``); [G] bool: whether
        the member accepted any."""
        batch, positions, dev = ctx.batch, ctx.positions, ctx.conf.device
        G = len(members)
        accepted_any = torch.zeros(G, dtype=torch.bool, device=dev)
        cand_rows, cand_tok, cand_gid, cand_slot, vgroups = [], [], [], [], []
        off, n_cand = ctx.n_slot, 0
        for g, i in enumerate(members):
            plan = ctx.plans[i]
            if plan is None:
                continue
            s, e = ctx.bounds[i]
            m = plan.cand_pos.shape[0]
            slot = s + torch.searchsorted(positions[s:e], plan.cand_pos)    # slot row per draft
            cand_rows.append(torch.cat([slot[:1], torch.arange(off, off + m - 1, device=dev)]))
            cand_tok.append(plan.cand_tok)
            cand_gid.append(torch.full((m,), g, dtype=torch.long, device=dev))
            cand_slot.append(slot)
            p = batch[i].params
            vgroups.append(RowGroup(n_cand, n_cand + m, p.temperature, p.top_k, p.top_p,
                                    ctx.states[i].generator))
            off += m - 1
            n_cand += m
            count(ctx.counters, i, "verify_candidates", m)
        if not cand_rows:
            return accepted_any
        vlog = ctx.logits[torch.cat(cand_rows)]                            # [candidates, V]
        ctok, cgid, cslot = torch.cat(cand_tok), torch.cat(cand_gid), torch.cat(cand_slot)
        view_tok, _ = propose(vlog, vgroups, forbid=ctx.mask_id)
        view_prob = draft_probability(vlog, ctok)
        gamma = h2d([batch[i].params.gamma for i in members], torch.float64, dev)
        cumprod = h2d([CUMULATIVE_RULES[batch[i].params.verify_rule] for i in members], torch.bool,
                      dev)
        acc = accept_prefix(ctok, view_tok, view_prob, cgid, G, gamma, cumprod)
        ctx.keep[cslot[acc]] = True
        ctx.tokens[cslot[acc]] = ctok[acc]
        available[cslot[acc]] = False
        accepted_any[cgid[acc]] = True
        n_acc = torch.bincount(cgid[acc], minlength=G).tolist()
        for g, i in enumerate(members):
            count(ctx.counters, i, "verify_accepted", n_acc[g])
        return accepted_any

    def after_commit(self, req, state, tokens, conf, positions, keep):
        """The still-masked block slots become the next drafts (this forward's proposals, most
        confident first, at most ``max_verify``); the tensors are the request's own slot rows."""
        remain = ~keep
        if not bool(remain.any()):
            state.drafts = None
            return
        order = order_candidates(conf[remain], req.params.max_verify)
        state.drafts = (positions[remain][order], tokens[remain][order])

    def store(self, runner) -> DraftStore:
        """The runner's device-side draft store (one row per arena row), made on first use."""
        return runner.policy_store(self.name, lambda: DraftStore(runner.config.max_num_seqs,
                                                                 runner.device))

    def before_general(self, runner, states):
        store = self.store(runner)
        for st in states:
            store.to_host(st)

    # -------------------------------------------------------------------------------- fused step
    def fused_fits(self, batch, dims):
        # (its verification rows rotate whole, un-normed heads with the fused RoPE kernel)
        return (dims is not None and dims.get("whole_rope", True)
                and verify_fused.fits(batch, dims, self.MAX_ELEMENTS))

    def fused_fields(self, batch, signature, dims):
        """Key: (M draft slots, dense canvas keys per request), what the body's shapes follow."""
        M = max(r.params.max_verify for r in batch)
        Lb = verify_fused.dense_keys(max(r.canvas_len for r in batch), dims["page_size"],
                                     dims["table_width"])
        B = len(batch)
        return (M, Lb), [("tau", B), ("arow", B), ("gamma", B), ("cumprod", B),
                         ("max_verify", B)]

    def fill_fused(self, host, sl, batch, signature, arena_rows):
        host[sl["tau"]] = np.array([r.params.threshold for r in batch],
                                   dtype=np.float64).view(np.int64)
        host[sl["arow"]] = arena_rows
        host[sl["gamma"]] = np.array([r.params.gamma for r in batch],
                                     dtype=np.float64).view(np.int64)
        host[sl["cumprod"]] = [CUMULATIVE_RULES[r.params.verify_rule] for r in batch]
        host[sl["max_verify"]] = [r.params.max_verify for r in batch]

    def fused_body(self, runner, inp, lay):
        return verify_fused.body(runner, self.store(runner), inp, lay)

    def fused_extra_rows(self, lay):
        return lay.B * 2 * max(0, lay.key[0] - 1)

    def before_fused(self, runner, states):
        """The general path left its drafts in the states: into the store."""
        store = self.store(runner)
        for st in states:
            if st.drafts is not IN_STORE:
                store.put(st.arena_row, st.drafts)
                st.drafts = IN_STORE

    def fused_result(self, out, bl):
        """[B, bl + 2]: the blocks, then per request the drafts it verified and accepted."""
        counters: list = [None] * out.shape[0]
        for i in range(out.shape[0]):
            count(counters, i, "verify_candidates", int(out[i, bl]))
            count(counters, i, "verify_accepted", int(out[i, bl + 1]))
        return out[:, :bl], counters
