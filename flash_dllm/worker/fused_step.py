"""The fused step (the ``step`` capture mode): a whole steady-state denoising step as one CUDA graph.

At small batch a step is bound by the host, not the GPU: the demo model's forward replays in
0.27 ms but the ~100 launches around it (gather the canvas, LM head, proposal, commit rule, commit,
book-keeping) took 1.5 ms. This mode runs all of it inside one graph, so a step costs the host one
host->device copy of its index vector, one graph replay and the step's one device->host copy (the
active blocks after the commit, ``StepResult.blocks``).

What the graph does, for B requests whose active blocks all have ``bl`` slots:
1. ``ids = arena[ids_idx]``: the query tokens, gathered from the canvas arena (so the tokens the
   previous replay committed are seen without any host work);
2. the paged forward (``DiffusionTransformer.hidden`` over ``PagedAttentionMetadata``);
3. final norm + LM head, then the greedy proposal (``kernels/argmax_confidence``). Up to
   ``LM_ALL_ROWS`` block rows the LM head runs at **every** block slot (B x bl rows, not only the
   masked ones: the shape stays static, and at these sizes the LM head is bound by reading its
   weight, so the extra rows are free). Above that it is compute-bound (batch 64 x block 32:
   2048 rows, ~2.7 ms on the H200 for all of them), so the masked slots are compacted on the
   device into ``lm_rows`` rows, the host's masked count rounded up to a bucket of R/8 rows (the
   bucket is part of the graph key, so a block replays at most 8 graphs);
4. the commit rule per request on its still-masked slots: the decode policy's graph-safe form
   (``DecodePolicy.fused_keep``: threshold's ``threshold_rows``, vanilla's ``top_k_rows`` with the
   same topk calls on the same shapes as ``select_top_k``, so the same ties);
5. the commit, one scatter into the arena; the output is the active blocks after it.

Eligible steps (``eligible``): CUDA graphs on (or, on the CPU, ``EngineConfig(fused_step=True)``,
which runs the same body eagerly for the tests); every request on a steady (not first-of-block)
step of a ``fusable`` cache mode (or, with ``EngineConfig.fused_first_steps``, at a block start
after the first block of a ``fusable_first`` mode: a block-causal step's attention is cut at block
bounds, ``Layout.A``), of one ``fusable`` decode policy (within its ``fused_fits``),
greedy (temperature 0), with no step extension active (sentinels, drift trigger, overflow), all
blocks full and of one length, and B x bl <= ``fused_step_max_rows``. A policy may bring a body
of its own (``fused_body``: verify's, ``decoding/policies/verify_fused.py``) instead of the commit
rule of step 4. Everything else takes the general path (``worker/general_step.py``).

NOTE: the logits come from a GEMM over more rows than the general path's (which has the masked
rows only); cuBLAS may round the two differently in the last bit, so the two paths agree token
for token on real models but are not bitwise twins.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.core.plan import StepResult
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.layers.attention_backend import PagedAttentionMetadata, page_slots
from flash_dllm.layers.paged_index import split_blocks
from flash_dllm.transfer import h2d_into
from flash_dllm.worker.extensions import active_on
from flash_dllm.worker.fused_layout import Launched, Layout
from flash_dllm.worker.graphs import GraphCache, GraphKey
from flash_dllm.worker.inputs import range_positions, same_batch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inp: torch.Tensor        # [layout.size] int64, the graph's static input
    out: torch.Tensor        # [B, bl (+ the policy's extra columns)] int64: the active blocks
    #                          after the commit
    loaded: np.ndarray | None = None     # the host vector ``inp`` holds now


class FusedSteps:
    """Owned by a ``ModelRunner``, which it gets as an argument (no back-reference: a runner and
    its GPU memory are freed as soon as the last reference to it goes, without waiting for gc)."""

    # up to this many block rows the LM head runs at every block slot (bound by its weight read)
    LM_ALL_ROWS = 256

    def __init__(self, cache: GraphCache, max_rows: int, max_tokens: int,
                 capture_rows: int = 128) -> None:
        self.cache = cache
        self.max_rows = max_rows
        self.max_tokens = max_tokens     # larger steps run on the general path (never captured)
        self.capture_rows = capture_rows  # longer per-request queries: captured one later
        # block-start steps of ``fusable_first`` cache modes too (``EngineConfig.fused_first_steps``)
        self.first_steps = False
        self.stats = {"fused_steps": 0, "fused_captures": 0, "fused_replays": 0,
                      "fused_block_starts": 0}     # (steps with a request at a block start)
        # the policies' limits' model and pool dimensions (per rank; set by the runner): vocab,
        # heads, kv_heads, head_dim, page_size, table_width
        self.dims: dict | None = None
        # the last step's (requests, their signature, host vector, layout, plan): within a
        # block the index vector does not change (the tokens come from the arena): reused
        self._last: tuple | None = None
        self._eligible: tuple | None = None       # (plan, eligible?) of the last plan seen

    @property
    def first_capture(self) -> int:
        """The sighting of a shape that captures it (``GraphCache``; 1: at once, which the GPU
        tests use to exercise the graphs on workloads whose shapes rarely repeat)."""
        return self.cache.first_capture

    @first_capture.setter
    def first_capture(self, n: int) -> None:
        self.cache.first_capture = n

    def forget(self, request_id: str) -> None:
        """Drop the cached index vector if it belongs to a batch holding the request (released)."""
        if self._last is not None and any(r.request_id == request_id for r in self._last[0]):
            self._last = None
        self._eligible = None

    # ------------------------------------------------------------------------------ eligibility
    def eligible_plan(self, plan, extensions: list) -> bool:
        """``eligible`` for a step plan (cached while the scheduler reuses the plan);
        ``extensions``: the step extensions active on it."""
        if self._eligible is None or self._eligible[0] is not plan:
            self._eligible = (plan, self.eligible(plan.requests, extensions))
        return self._eligible[1]

    def eligible(self, batch, extensions: list | None = None) -> bool:
        """Can ``batch`` (the step's requests, steady or, with ``first_steps``, at block starts)
        run as a fused step (the module docstring)?
        ``extensions``: those active on it (None: found here)."""
        if extensions is None:
            extensions = active_on(batch)
        bl = batch[0].params.block_length
        if len(batch) * bl > self.max_rows or len({r.params.decode for r in batch}) > 1:
            return False
        policy = DECODE_POLICIES[batch[0].params.decode]
        if not policy.fusable or any(not ext.fusable for ext, _ in extensions):
            return False
        own = policy.fused_body is not None
        for r in batch:
            p, mode = r.params, CACHE_MODES[r.params.cache]
            first_ok = (self.first_steps and mode.fusable_first and r.block > 0 and not own
                        and not r.stale)
            if ((r.first_step and not first_ok) or not mode.fusable or p.temperature > 0
                    or p.block_length != bl):
                return False
        # a block-causal model's windows are cut at block bounds for the attention
        # (``_host_inputs``), except under a policy's own body, whose rows must lie in one block
        if own and self.dims is not None and self.dims.get("block_size") and not all(
                self._one_block(r, self.dims["block_size"], self.dims["logit_shift"])
                for r in batch):
            return False
        return policy.fused_fits(batch, self.dims)

    @staticmethod
    def _one_block(req, block_size: int, logit_shift: int) -> bool:
        """Block-causal model: does the request's steady window lie in one block (its rows then
        all see the same keys: the block's end bounds them)?"""
        q0, q1 = CACHE_MODES[req.params.cache].query_range(
            req.canvas_len, req.block_start, req.block_end, False, logit_shift)
        return q0 // block_size == (q1 - 1) // block_size

    # ------------------------------------------------------------------------------------- run
    def run(self, runner, plan, states) -> StepResult | None:
        """Run one step of ``plan`` on ``runner`` (``states``: its requests' runner states);
        returns its result (the active blocks after it, and the policy's counters), or None
        when the general path should run this step instead (on CUDA: the step's shape has no
        graph yet and is seen for the first time, or it is too large to capture)."""
        launched = self.launch(runner, plan, states)
        return None if launched is None else launched.result()

    def launch(self, runner, plan, states, ahead: tuple[list, int] | None = None,
               replay_only: bool = False) -> Launched | None:
        """Start one step of ``plan`` and return without waiting for it (``Launched.result``
        waits). ``ahead``: a step after the next one, launched before the host applied the
        steps before it (multi-step, ``engine/multi_step.py``): its requests' policy
        signatures and MASK slots as the policy predicted them (``DecodePolicy.fused_ahead``).
        Such a step, and any with ``replay_only``, only replays a captured graph: None when
        there is none, and the step is not counted as a sighting of its shape (the caller's
        own path counts it). None otherwise: the general path should run this step (``run``)."""
        batch = plan.requests
        policy = DECODE_POLICIES[batch[0].params.decode]
        host, lay = self._inputs(runner, plan, policy, None if ahead is None else ahead[0])
        own_body = policy.fused_body is not None
        masked = ahead[1] if ahead is not None else sum(r.num_masked for r in batch)
        lm_rows = (lay.R if lay.R <= self.LM_ALL_ROWS or own_body
                   else self.lm_head_rows(lay.R, masked))
        key = GraphKey("step", (lay.B, lay.T, lay.bl, lay.width, lay.max_q, lay.max_k,
                                lay.policy, lay.key, lm_rows, lay.A))
        rows = lay.T + policy.fused_extra_rows(lay)
        action = self._decide(key, rows, runner.forward_graphs is not None, lay.max_q,
                              not (replay_only or ahead is not None))     # (count)
        if action == "general":
            return None
        self.stats["fused_steps"] += 1
        self.stats["fused_block_starts"] += lay.starts > 0
        policy.before_fused(runner, states)
        bl = lay.bl

        def body(inp: torch.Tensor) -> torch.Tensor:
            if own_body:
                return policy.fused_body(runner, inp, lay)
            return self._body(runner, policy, inp, lay, lm_rows)
        if action == "eager":
            return Launched(policy, bl, body(torch.from_numpy(host).to(runner.device)).cpu())
        if action == "capture":
            inp = h2d_into(torch.empty(lay.size, dtype=torch.long, device=runner.device), host)
            first, graph, out = self.cache.capture(lambda: body(inp))
            self.cache.add(key, _Graph(graph, inp, out, loaded=host))
            self.stats["fused_captures"] += 1
            return Launched(policy, bl, first.cpu())
        g = self.cache.get(key)
        if g.loaded is not host:          # a new block or batch: one host->device copy
            h2d_into(g.inp, host)
            g.loaded = host
        g.graph.replay()
        self.stats["fused_replays"] += 1
        # the step's one device->host copy, into pinned memory behind an event: the next step
        # (which overwrites ``g.out``) may be queued before the host reads this one
        out = torch.empty(g.out.shape, dtype=g.out.dtype, pin_memory=True)
        out.copy_(g.out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return Launched(policy, bl, out, done)

    def _inputs(self, runner, plan, policy, signature: list | None
                ) -> tuple[np.ndarray, Layout]:
        """The step's index vector and layout (``signature``: the policy's per-request part,
        None: from the requests as they are); the last one is reused while it still fits."""
        batch = plan.requests
        last = self._last
        if (signature is None and last is not None and last[4] is plan
                and policy.fused_static_per_block):
            return last[2], last[3]         # the same plan: same requests in the same blocks
        if signature is None:
            signature = [policy.fused_signature(r) for r in batch]
        sig = [(r.block, r.first_step, s) for r, s in zip(batch, signature)]
        if last is not None and last[1] == sig and same_batch(last[0], batch):
            host, lay = last[2], last[3]
        else:
            host, lay = self._host_inputs(runner, plan, policy, signature)
        # NOTE: holds the request objects, so their ids cannot be reused while compared
        self._last = (list(batch), sig, host, lay, plan)
        return host, lay

    def _decide(self, key: GraphKey, T: int, graphs: bool, max_q: int = 0,
                count: bool = True) -> str:
        """``eager`` (no CUDA graphs: run the body as it is), ``general`` (leave the step to the
        general path), ``capture`` or ``replay``. Capture follows ``GraphCache``'s policy
        (default: at the second sighting); earlier sightings run on the general path, whose
        forward graphs are keyed on fewer things (a step key also holds the policy's key, e.g.
        vanilla's (canvas length, k) groups). A step whose requests query more than
        ``capture_rows`` rows each (prefix mode: the key changes with every block) counts as
        large (captured one sighting later), and steps of more than ``max_tokens`` query rows
        are never captured (the pool would keep their activations for good). ``count``
        False: a shape without a graph is ``general`` and this look is not a sighting."""
        if not graphs:
            return "eager"
        if key in self.cache.graphs:
            return "replay"
        if T > self.max_tokens or not count:
            return "general"
        return ("capture" if self.cache.sighted(key, large=max_q > self.capture_rows, tokens=T)
                else "general")

    @classmethod
    def lm_head_rows(cls, R: int, masked: int) -> int:
        """How many rows the step's LM head computes for ``R`` block rows of which ``masked``
        are MASK: all of them up to ``LM_ALL_ROWS``, else ``masked`` rounded up to a multiple
        of max(LM_ALL_ROWS / 2, R / 8) (capped at R)."""
        if R <= cls.LM_ALL_ROWS:
            return R
        g = max(cls.LM_ALL_ROWS // 2, R // 8, 1)
        return min(R, max(1, -(-masked // g)) * g)

    def _host_inputs(self, runner, plan, policy, signature: list) -> tuple[np.ndarray, Layout]:
        batch = plan.requests
        ps, W = runner.page_size, runner.arena.shape[1]
        shift = runner.cfg.logit_shift
        width = runner.table_width
        bl = batch[0].params.block_length
        windows = [CACHE_MODES[r.params.cache].query_range(
            r.canvas_len, r.block_start, r.block_end, r.first_step, shift,
            first_block=r.block == 0) for r in batch]
        counts = [q1 - q0 for q0, q1 in windows]
        B, T = len(batch), sum(counts)
        cu = np.zeros(B + 1, dtype=np.int64)
        cu[1:] = np.cumsum(counts)
        pos, n = range_positions(windows)
        table = runner.block_table(plan)                 # the general path's cached table
        lens = [r.canvas_len for r in batch]
        a_table, a_lens, a_cu = table, lens, cu.tolist()
        bs = (self.dims or {}).get("block_size", 0)
        if bs:
            # block-causal: the rows of each block see the keys up to its end (a block-start
            # step's window holds the block before too), as the general path cuts them
            a_table, a_lens, a_cu = split_blocks(table, lens, pos, a_cu, bs)
        key, fields = policy.fused_fields(batch, signature, self.dims)
        lay = Layout(B, T, bl, width, int(np.diff(a_cu).max()),
                     seqlen_bound(max(r.canvas_len for r in batch)), policy.name, key,
                     tuple(fields), len(a_lens) if len(a_lens) != B else 0,
                     sum(r.first_step for r in batch))
        sl = lay.slices
        host = np.zeros(lay.size, dtype=np.int64)
        host[sl["table"]] = a_table.ravel()
        req = np.repeat(np.arange(B), n)
        arena_row = np.array(runner.arena_rows(batch), dtype=np.int64)
        host[sl["ids_idx"]] = arena_row[req] * W + pos
        host[sl["positions"]] = pos
        host[sl["slots"]] = page_slots(table, req, pos, ps)
        bstart = np.array([r.block_start for r in batch], dtype=np.int64)
        blk = bstart[:, None] + np.arange(bl)                                  # [B, bl]
        q0 = np.array([w[0] for w in windows], dtype=np.int64)
        host[sl["rows"]] = (blk - shift - q0[:, None] + cu[:-1, None]).ravel()
        host[sl["blk_idx"]] = (arena_row[:, None] * W + blk).ravel()
        host[sl["cu_q"]] = a_cu
        host[sl["seq_lens"]] = a_lens
        host[sl["bstart"]] = bstart
        policy.fill_fused(host, sl, batch, signature, arena_row)
        return host, lay

    # ------------------------------------------------------------------------------------ body
    @staticmethod
    def _body(runner, policy, inp: torch.Tensor, lay: Layout, lm_rows: int) -> torch.Tensor:
        """The step on the device, from the index vector ``inp``; returns the active blocks after
        the commit [B, bl]. Only static-shape ops, no host syncs: this is what the graph
        captures."""
        model, mask_id = runner.model, runner.cfg.mask_token_id
        sl = lay.slices
        B, bl = lay.B, lay.bl
        i32 = torch.int32
        meta = PagedAttentionMetadata(runner.kv, inp[sl["slots"]], inp[sl["cu_q"]].to(i32),
                                      inp[sl["seq_lens"]].to(i32),
                                      inp[sl["table"]].to(i32).view(lay.S, -1), lay.max_q,
                                      runner.backend.inv_freq, lay.max_k,
                                      kv_scales=runner.kv_scales)
        flat = runner.arena.view(-1)
        hidden = model.hidden(flat[inp[sl["ids_idx"]]], inp[sl["positions"]], meta)
        blk_idx = inp[sl["blk_idx"]]
        blocks = flat[blk_idx].view(B, bl)
        masked = blocks == mask_id
        rows = inp[sl["rows"]]                                   # [B * bl] hidden row per slot
        if lm_rows >= lay.R:
            tok, conf = model.greedy(hidden[rows], mask_id)
        else:
            tok, conf = FusedSteps._masked_proposal(model, hidden, rows, masked.view(-1),
                                                    lm_rows, mask_id)
        keep = policy.fused_keep(conf.view(B, bl), masked, inp, sl, lay.key)
        new = torch.where(keep, tok.view(B, bl), blocks)
        flat[blk_idx] = new.view(-1)
        return new

    @staticmethod
    def _masked_proposal(model, hidden: torch.Tensor, rows: torch.Tensor, masked: torch.Tensor,
                         lm_rows: int, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy proposal at the masked block slots only, with static shapes: slot i (masked)
        gets LM row cumsum(masked)[i] - 1 (< lm_rows: the host's masked count, bucketed); the
        unused LM rows compute a copy of the last slot's row and their results land in a
        dump slot. Returns (tok, conf) [R] (values at unmasked slots are meaningless: every
        rule ignores them)."""
        R = masked.numel()
        dev = masked.device
        lm = torch.where(masked, (masked.cumsum(0) - 1).clamp(max=lm_rows), lm_rows)
        src = torch.full((lm_rows + 1,), R, dtype=torch.long, device=dev)   # LM row -> slot
        src.scatter_(0, lm, torch.arange(R, device=dev))
        src = src[:lm_rows]                                      # R = no slot (padding)
        h = hidden[rows[src.clamp(max=R - 1)]]
        tok_m, conf_m = model.greedy(h, mask_id)
        tok = torch.zeros(R + 1, dtype=tok_m.dtype, device=dev).scatter_(0, src, tok_m)
        conf = torch.zeros(R + 1, dtype=conf_m.dtype, device=dev).scatter_(0, src, conf_m)
        return tok[:R], conf[:R]
