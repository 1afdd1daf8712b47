"""The fused step for ``decode="verify"``: a whole Flash-Verify step with static shapes, so the
fused step (``worker/fused_step.py``) can replay it as one CUDA graph (``VerifyPolicy.fused_body``).

The general path builds each request's verification block on the host side of the step
(``VerifyPolicy.extra_rows``: a block shaped by its number of drafts), attends its rows per
request and per layer, and accepts drafts with boolean indexing and device->host reads. On the
H200 that made a verify step of the Dream proxy cost 18-23 ms against 0.7 ms for a replayed
threshold step (``benchmarks/FINDINGS.md``). Here every request of the batch gets the same
number of draft slots ``M`` (the batch's largest ``max_verify``; unused slots are padding that
never passes), and everything happens on the device:

1. the drafts come from a **draft store** on the device (``DraftStore``: one row per arena row,
   written by the previous replay), not from the host;
2. the verification rows (draft views, then mask views: ``decoding.verify.VerifyBlock``'s
   layout, ``2 (M - 1)`` rows per request) are built from them and packed after all canvas rows;
   their attention is ``layers.attention.masked_attention_batched`` over each request's canvas
   keys read from its pages (``attention_backend.VerifyBatchMetadata``);
3. one LM head over the block rows and the mask views; acceptance is the longest passing prefix
   per request (``agree`` or ``cumprod``), then the threshold rule on what is left
   (``decoding.verify.select_after_verify``), the commit, and the next drafts (the still-masked
   slots by confidence, ``order_candidates``' order) written back to the store.

The step's output is ``[B, bl + 2]``: the active blocks after the commit, then per request the
number of drafts it verified and how many it accepted (the ``verify_*`` counters), so the step
still makes ONE device->host copy.

NOTE (drafts): a request's drafts live either in its ``SeqState.drafts`` (a ``(positions,
tokens)`` pair, as the general path leaves them) or in the store (``SeqState.drafts is
IN_STORE``). The runner moves them into the store before a fused step (``DraftStore.put``) and
back before a general one (``DraftStore.load``), so the two paths can follow each other at any
step.
"""
from __future__ import annotations

import torch

from flash_dllm.decoding.verify import accept_prefix, select_after_verify
from flash_dllm.kernels import argmax_confidence
from flash_dllm.layers.attention_backend import VerifyBatchMetadata

IN_STORE = "in-store"       # SeqState.drafts: the request's drafts are in the runner's store


class DraftStore:
    """Each arena row's pending drafts on the device: ``buf`` [rows, 1 + 2 WIDTH] long holds
    (count, positions[WIDTH], tokens[WIDTH]), most confident first."""

    WIDTH = 64            # drafts per request a fused step verifies at most (max_verify)

    def __init__(self, rows: int, device: torch.device) -> None:
        self.buf = torch.zeros(rows, 1 + 2 * self.WIDTH, dtype=torch.long, device=device)

    def put(self, row: int, drafts: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Store a general step's drafts (no host sync: their count is a shape)."""
        b = self.buf[row]
        m = 0 if drafts is None else drafts[0].shape[0]
        b[0] = m
        if m:
            b[1:1 + m] = drafts[0]
            b[1 + self.WIDTH:1 + self.WIDTH + m] = drafts[1]

    def load(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A row's drafts as the general path keeps them (one device->host read of the count)."""
        b = self.buf[row]
        m = int(b[0])
        if m == 0:
            return None
        return b[1:1 + m].clone(), b[1 + self.WIDTH:1 + self.WIDTH + m].clone()

    def to_host(self, st) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A request's (``SeqState``) drafts as the general path keeps them: out of the store if
        a fused step left them there."""
        if st.drafts is IN_STORE:
            st.drafts = self.load(st.arena_row)
        return st.drafts

    def read(self, rows: torch.Tensor, M: int, fill_pos: torch.Tensor, mask_id: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, tokens, valid) [B, M] and count [B] of ``rows``; padding slots hold
        ``fill_pos`` [B] and MASK."""
        d = self.buf[rows]                                              # [B, 1 + 2 WIDTH]
        count = d[:, 0]
        valid = torch.arange(M, device=d.device)[None, :] < count[:, None]
        pos = torch.where(valid, d[:, 1:1 + M], fill_pos[:, None])
        tok = torch.where(valid, d[:, 1 + self.WIDTH:1 + self.WIDTH + M], mask_id)
        return pos, tok, valid, count

    def write(self, rows: torch.Tensor, count: torch.Tensor, pos: torch.Tensor,
              tok: torch.Tensor) -> None:
        """Static-shape write of [B] counts and [B, M] drafts (graph-safe)."""
        M = pos.shape[1]
        cols = torch.arange(M, device=pos.device)[None, :]
        self.buf[rows, 0] = count
        self.buf[rows[:, None], 1 + cols] = pos
        self.buf[rows[:, None], 1 + self.WIDTH + cols] = tok


def dense_keys(max_canvas: int, page_size: int, table_width: int) -> int:
    """How many canvas keys the verification rows read per request: the longest canvas in
    pages, rounded up to a power of two of pages (a graph key: few distinct values), capped at
    the block table's width."""
    pages = max(1, -(-max_canvas // page_size))
    return min(1 << (pages - 1).bit_length(), table_width) * page_size


def fits(batch, dims: dict | None, cap: int) -> bool:
    """A fused verify step's own limits: at most ``DraftStore.WIDTH`` drafts per request, and
    each of its largest tensors within ``cap`` elements (a graph's pool keeps them for good; a
    larger step runs on the general path): the LM-head logits (block rows + mask views), the
    canvas K (or V) gathered for the verification rows, and their attention scores over those
    keys and the draft keys. ``dims``: the model's and pool's (``FusedSteps.dims``)."""
    M = max(r.params.max_verify for r in batch)
    if M > DraftStore.WIDTH or dims is None:
        return False
    B, bl = len(batch), batch[0].params.block_length
    Lb = dense_keys(max(r.canvas_len for r in batch), dims["page_size"], dims["table_width"])
    return (B * (bl + M) * dims["vocab"] <= cap
            and B * Lb * dims["kv_heads"] * dims["head_dim"] <= cap
            and B * dims["heads"] * 2 * (M - 1) * (Lb + M - 1) <= cap)


def body(runner, store: DraftStore, inp: torch.Tensor, lay) -> torch.Tensor:
    """The fused verify step from the index vector ``inp`` (``worker/fused_step.Layout`` ``lay``;
    its policy key is (M draft slots, dense keys)); returns [B, bl + 2]. Only static shapes, no
    host syncs."""
    model, cfg = runner.model, runner.cfg
    mask_id, shift = cfg.mask_token_id, cfg.logit_shift
    (M, Lb), sl = lay.key, lay.slices
    B, bl, T = lay.B, lay.bl, lay.T
    dev = inp.device
    flat = runner.arena.view(-1)
    W = runner.arena.shape[1]
    i32 = torch.int32
    arow = inp[sl["arow"]]                          # [B] arena rows (= draft store rows)
    bstart = inp[sl["bstart"]]
    seq_lens = inp[sl["seq_lens"]]
    cpos, ctok, valid, count = store.read(arow, M, bstart, mask_id)      # [B, M]
    j = torch.arange(M, device=dev)
    ids, positions = flat[inp[sl["ids_idx"]]], inp[sl["positions"]]
    R = 2 * (M - 1)
    keys = torch.arange(Lb, device=dev)
    allow = None
    if M > 1:
        vids, vpos, allow = _verification_rows(flat, W, arow, seq_lens, cpos, ctok, valid, keys,
                                               shift)
        ids, positions = torch.cat([ids, vids]), torch.cat([positions, vpos])
    meta = VerifyBatchMetadata(runner.kv, inp[sl["slots"]], inp[sl["cu_q"]].to(i32),
                               seq_lens.to(i32), inp[sl["table"]].to(i32).view(B, -1),
                               lay.max_q, runner.backend.inv_freq, lay.max_k,
                               canvas_rows=T, num_verify=M, dense_keys=Lb, verify_allow=allow,
                               no_slots=torch.full((B * R,), -1, dtype=torch.long, device=dev),
                               key_pos=keys, kv_scales=runner.kv_scales)
    hidden = model.hidden(ids, positions, meta)

    # one LM head: every block slot's row, then each draft's view row (draft 1: its canvas row)
    rows = inp[sl["rows"]].view(B, bl)
    blk_idx = inp[sl["blk_idx"]]
    blocks = flat[blk_idx].view(B, bl)
    masked = blocks == mask_id
    slot = (cpos - bstart[:, None]).clamp(0, bl - 1)                    # [B, M] block slots
    view_rows = rows.gather(1, slot[:, :1])
    if M > 1:
        view_rows = torch.cat([view_rows, T + torch.arange(B, device=dev)[:, None] * R
                               + (M - 1) + j[None, :M - 1]], dim=1)      # [B, M]
    logits = model.logits(hidden[torch.cat([rows.view(-1), view_rows.view(-1)])])
    tok_all, conf_all = argmax_confidence.op(logits, mask_id)
    n = B * bl
    tok, conf = tok_all[:n].view(B, bl), conf_all[:n].view(B, bl)
    view_tok, view_conf = tok_all[n:].view(B, M), conf_all[n:].view(B, M)
    vl = logits[n:].float()
    # softmax probability of each draft: the view's best probability x exp(l_draft - l_best)
    gap = vl.gather(1, ctok.view(-1, 1)) - vl.gather(1, view_tok.view(-1, 1))
    prob = (view_conf.view(-1, 1) * gap.exp()).view(B, M)

    # 1. the longest passing prefix of drafts (their tokens into ``tok``)
    acc_slot, n_acc, tok = _accept(ctok, view_tok, prob, valid, slot, tok, inp[sl["gamma"]],
                                   inp[sl["cumprod"]])

    # 2. the threshold rule on the slots left masked (no sentinel: they are not eligible)
    tau = inp[sl["tau"]].view(torch.float64).to(conf.dtype)
    gid = torch.arange(B, device=dev).repeat_interleave(bl)
    available = masked & ~acc_slot
    keep = select_after_verify(conf.reshape(-1), gid, B, tau, available.view(-1),
                               torch.zeros_like(available.view(-1)), n_acc > 0).view(B, bl)
    keep |= acc_slot
    new = torch.where(keep, tok, blocks)
    flat[blk_idx] = new.view(-1)

    # 3. the next drafts: the still-masked slots, most confident first (stable: earlier slot)
    remain = masked & ~keep
    score = torch.where(remain, conf, float("-inf"))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :M]
    nxt = torch.minimum(remain.sum(1), inp[sl["max_verify"]])
    store.write(arow, nxt, bstart[:, None] + order, tok.gather(1, order))
    return torch.cat([new, count[:, None], n_acc[:, None]], dim=1)


def _verification_rows(flat, W: int, arow, seq_lens, cpos, ctok, valid, keys, shift: int):
    """The verification rows of M > 1 draft slots per request (``decoding.verify.VerifyBlock``'s
    layout, static shapes): their ids and positions [B * 2 (M - 1)] and which keys each row may
    see, ``allow`` [B, 2 (M - 1), Lb + M - 1] (the canvas keys, then the draft views)."""
    B, M = cpos.shape
    Lb, dev = keys.shape[0], cpos.device
    j = torch.arange(M, device=dev)
    r = j[:M - 1]                               # row pair r: D_{r+1} and M_{r+2}
    mv_pos = (cpos[:, 1:] - shift).clamp(min=0)                     # [B, M-1]
    mv_ids = flat[arow[:, None] * W + mv_pos]
    if shift:       # a mask view's row may be an earlier draft's slot: it holds the draft
        hit = ((mv_pos[:, :, None] == cpos[:, None, :]) & (j[None, None, :] <= r[None, :, None])
               & valid[:, None, :])                                 # [B, M-1, M]
        mv_ids = torch.where(hit.any(-1), ctok.gather(1, hit.long().argmax(-1)), mv_ids)
    ids = torch.cat([ctok[:, :M - 1], mv_ids], 1).view(-1)
    positions = torch.cat([cpos[:, :M - 1], mv_pos], 1).view(-1)
    # which canvas keys pair r hides: the MASK keys of drafts 1 .. r+1 (rank <= r)
    rank = torch.full((B, Lb + 1), M, dtype=torch.long, device=dev)
    rank.scatter_(1, torch.where(valid, cpos, Lb), j.expand(B, M))
    canvas_ok = ((keys[None, None, :] < seq_lens[:, None, None])
                 & (rank[:, None, :Lb] > r[None, :, None]))         # [B, M-1, Lb]
    extra_ok = (r[None, :] <= r[:, None]).expand(B, -1, -1)          # draft view j <= r
    pair = torch.cat([canvas_ok, extra_ok], dim=-1)
    return ids, positions, torch.cat([pair, pair], dim=1)           # [B, R, Lb + M-1]


def _accept(ctok, view_tok, prob, valid, slot, tok, gamma, cumprod):
    """The longest passing prefix of each request's drafts [B, M]; a padding slot never passes
    (no agreement, and probability 0 for cumprod), so it ends its request's prefix. Returns the
    accepted block slots [B, bl] bool, their count [B] and ``tok`` [B, bl] with the accepted
    drafts in."""
    B, M = ctok.shape
    bl, dev = tok.shape[1], tok.device
    acc = accept_prefix(ctok.view(-1), torch.where(valid, view_tok, -1).view(-1),
                        torch.where(valid, prob, 0.0).view(-1),
                        torch.arange(B, device=dev).repeat_interleave(M), B,
                        gamma.view(torch.float64), cumprod != 0).view(B, M)
    dump = torch.where(acc, slot, bl)                                   # column bl: discarded
    acc_slot = torch.zeros(B, bl + 1, dtype=torch.bool, device=dev).scatter_(1, dump, acc)
    drafted = torch.zeros(B, bl + 1, dtype=tok.dtype, device=dev).scatter_(1, dump, ctok)
    acc_slot = acc_slot[:, :bl]
    return acc_slot, acc.sum(1), torch.where(acc_slot, drafted[:, :bl], tok)
