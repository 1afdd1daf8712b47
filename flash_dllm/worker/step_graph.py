"""The ``step`` capture mode: a whole steady-state denoising step as one CUDA graph.

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
4. the commit rule per request on its still-masked slots, with the graph-safe twins of
   ``decoding/policies.py``: ``threshold_rows`` or ``top_k_rows`` (vanilla: the same topk calls
   on the same shapes as ``select_top_k``, so the same ties);
5. the commit, one scatter into the arena; the output is the active blocks after it.

Eligible steps (``eligible``): CUDA graphs on (or, on the CPU, ``EngineConfig(fused_step=True)``,
which runs the same body eagerly for the tests), every request a cached (not first-of-block)
``dual`` or ``prefix`` step, all with ``decode="threshold"``, all with ``"vanilla"`` or all with
``"verify"`` (its own body: ``worker/verify_graph.py``, within ``verify_graph.fits``), temperature 0,
no sentinel, a full block, all blocks the same length, and B x bl <= ``fused_step_max_rows``.
Everything else (refresh steps, sampling, ``flash``, mixed policies) takes the general path.

NOTE: the logits come from a GEMM over more rows than the general path's (which has the masked
rows only); cuBLAS may round the two differently in the last bit, so the two paths agree token
for token on real models but are not bitwise twins.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from flash_dllm.cache.modes import query_range
from flash_dllm.core.counters import count as _count
from flash_dllm.core.plan import StepResult
from flash_dllm.decoding.policies import threshold_rows, top_k_rows
from flash_dllm.decoding.schedule import transfer_count
from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.layers.attention_backend import PagedAttentionMetadata, page_slots
from flash_dllm.transfer import h2d_into
from flash_dllm.worker import inputs, verify_graph
from flash_dllm.worker.graphs import GraphCache, GraphKey
from flash_dllm.worker.verify_graph import IN_STORE, dense_keys


@dataclass
class _Layout:
    """Offsets of the step's index vector (one int64 tensor; tau is stored as float64 bits)."""

    B: int
    T: int
    bl: int
    width: int
    max_q: int
    max_k: int               # paged_attention.seqlen_bound of the longest canvas (split-KV)
    # vanilla: requests grouped by (canvas length, k) as decoding.policies.select_top_k groups
    # them (same topk shapes, hence the same tie order): (length, k, start, end) into ``perm``
    groups: tuple | None = None
    # verify (``worker/verify_graph.py``): draft slots per request, canvas keys its rows read
    M: int = 0
    dense_keys: int = 0

    @property
    def R(self) -> int:
        return self.B * self.bl

    @cached_property
    def slices(self) -> dict[str, slice]:
        T, R, B = self.T, self.R, self.B
        sizes = [("ids_idx", T), ("positions", T), ("slots", T), ("rows", R), ("blk_idx", R),
                 ("cu_q", B + 1), ("seq_lens", B), ("tau", B), ("perm", B), ("bstart", B),
                 ("table", B * self.width)]
        if self.M:
            sizes += [("arow", B), ("gamma", B), ("cumprod", B), ("max_verify", B)]
        # every part starts on a 16-byte boundary (an even int64 offset): Triton compiles a
        # kernel variant per alignment of its pointer arguments (see attention_backend)
        out, a = {}, 0
        for name, n in sizes:
            out[name] = slice(a, a + n)
            a = -(-(a + n) // 2) * 2
        return out

    @property
    def size(self) -> int:
        return max(s.stop for s in self.slices.values())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inp: torch.Tensor        # [layout.size] int64, the graph's static input
    out: torch.Tensor        # [B, bl] int64: the active blocks after the commit (verify:
    #                          [B, bl + 2], then the drafts verified and accepted)
    loaded: np.ndarray | None = None     # the host vector ``inp`` holds now


class StepGraphs:
    """Owned by a ``ModelRunner``, which it gets as an argument (no back-reference: a runner and
    its GPU memory are freed as soon as the last reference to it goes, without waiting for gc)."""

    # up to this many block rows the LM head runs at every block slot (bound by its weight read)
    LM_ALL_ROWS = 256
    # a fused verify step's largest tensor (logits, gathered canvas K or V, attention scores;
    # ``verify_graph.fits``), in elements: 2**27 is 256 MiB of bf16 logits, LLaDA-8B's
    # vocabulary at batch 16 with 32 + 32 rows per request
    VERIFY_MAX_ELEMENTS = 2 ** 27

    def __init__(self, cache: GraphCache, max_rows: int, max_tokens: int,
                 capture_rows: int = 128) -> None:
        self.cache = cache
        self.max_rows = max_rows
        self.max_tokens = max_tokens     # larger steps run on the general path (never captured)
        self.capture_rows = capture_rows  # longer per-request queries: captured one later
        self.stats = {"fused_steps": 0, "fused_captures": 0, "fused_replays": 0}
        # the verify limits' model and pool dimensions (per rank; set by the runner): vocab,
        # heads, kv_heads, head_dim, page_size, table_width
        self.dims: dict | None = None
        # the last step's (requests, their blocks, host vector, layout): within a block the
        # index vector does not change (the tokens come from the arena), so it is reused
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
    def eligible_plan(self, plan, states) -> bool:
        """``eligible`` for a step plan (cached while the scheduler reuses the plan)."""
        if self._eligible is None or self._eligible[0] is not plan:
            self._eligible = (plan, self.eligible(plan.requests, states))
        return self._eligible[1]

    def eligible(self, batch, states=None) -> bool:
        """``batch``: the step's requests; ``states``: their runner states (pending sentinel
        refreshes make a step ineligible)."""
        bl = batch[0].params.block_length
        decode = batch[0].params.decode
        if len(batch) * bl > self.max_rows or decode not in ("threshold", "vanilla", "verify"):
            return False
        for r in batch:
            p = r.params
            if (r.first_step or p.cache not in ("dual", "prefix") or p.decode != decode
                    or p.temperature > 0 or p.block_length != bl or p.entropy_max is not None
                    or p.perturb_sigma is not None or p.kv_jaccard_min is not None
                    or p.drift_min is not None):
                return False
        if decode == "verify" and not verify_graph.fits(batch, self.dims,
                                                        self.VERIFY_MAX_ELEMENTS):
            return False
        return states is None or all(st.refresh is None for st in states)

    # ------------------------------------------------------------------------------------- run
    def run(self, runner, plan, states) -> StepResult | None:
        """Run one step of ``plan`` on ``runner`` (``states``: its requests' runner states);
        returns its result (the active blocks after it, and for verify its counters), or None
        when the general path should run this step instead (on CUDA: the step's shape has no
        graph yet and is seen for the first time, or it is too large to capture)."""
        out = self._run(runner, plan, states)
        bl = plan.requests[0].params.block_length
        if out is None or out.shape[1] == bl:
            return None if out is None else StepResult(out)
        counters: list = [None] * out.shape[0]        # verify: [B, bl + 2]
        for i in range(out.shape[0]):
            _count(counters, i, "verify_candidates", int(out[i, bl]))
            _count(counters, i, "verify_accepted", int(out[i, bl + 1]))
        return StepResult(out[:, :bl], counters)

    def _run(self, runner, plan, states) -> np.ndarray | None:
        batch = plan.requests
        last = self._last
        if last is not None and last[4] is plan and batch[0].params.decode != "vanilla":
            host, lay = last[2], last[3]      # the same plan: same requests in the same blocks
        else:
            blocks = self._signature(batch)
            if last is not None and last[1] == blocks and inputs.same_batch(last[0], batch):
                host, lay = last[2], last[3]
            else:
                host, lay = self._host_inputs(runner, plan, blocks)
            # NOTE: holds the request objects, so their ids cannot be reused while compared
            self._last = (list(batch), blocks, host, lay, plan)
        lm_rows = lay.R if lay.R <= self.LM_ALL_ROWS or lay.M else self.lm_head_rows(
            lay.R, sum(r.num_masked for r in batch))
        key = GraphKey("step", (lay.B, lay.T, lay.bl, lay.width, lay.max_q, lay.max_k,
                                lay.groups, lm_rows, lay.M, lay.dense_keys))
        dev = runner.device
        rows = lay.T + lay.B * 2 * max(0, lay.M - 1)     # with the verification rows
        action = self._decide(key, rows, runner.forward_graphs is not None, lay.max_q)
        if action == "general":
            return None
        self.stats["fused_steps"] += 1
        if lay.M:            # the general path left its drafts in the states: into the store
            for st in states:
                if st.drafts is not IN_STORE:
                    runner.drafts.put(st.arena_row, st.drafts)
                    st.drafts = IN_STORE
        if action == "eager":
            inp = torch.from_numpy(host).to(dev)
            return self._body(runner, inp, lay, lm_rows).cpu().numpy()
        if action == "capture":
            inp = h2d_into(torch.empty(lay.size, dtype=torch.long, device=dev), host)
            first, graph, out = self.cache.capture(lambda: self._body(runner, inp, lay, lm_rows))
            self.cache.add(key, _Graph(graph, inp, out, loaded=host))
            self.stats["fused_captures"] += 1
            return first.cpu().numpy()
        g = self.cache.get(key)
        if g.loaded is not host:          # a new block or batch: one host->device copy
            h2d_into(g.inp, host)
            g.loaded = host
        g.graph.replay()
        self.stats["fused_replays"] += 1
        return g.out.cpu().numpy()          # the step's one device->host copy

    def _decide(self, key: GraphKey, T: int, graphs: bool, max_q: int = 0) -> str:
        """``eager`` (no CUDA graphs: run the body as it is), ``general`` (leave the step to the
        general path), ``capture`` or ``replay``. Capture follows ``GraphCache``'s policy
        (default: at the second sighting); earlier sightings run on the general path, whose
        forward graphs are keyed on fewer things (a step key also holds vanilla's (canvas
        length, k) groups). A step whose requests query more than ``capture_rows`` rows each
        (prefix mode: the key changes with every block) counts as large (captured one sighting
        later), and steps of more than ``max_tokens`` query rows are never captured (the pool
        would keep their activations for good)."""
        if not graphs:
            return "eager"
        if key in self.cache.graphs:
            return "replay"
        if T > self.max_tokens:
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

    @staticmethod
    def _signature(batch) -> list[tuple[int, int]]:
        """What the index vector depends on besides the requests themselves: their blocks and,
        for vanilla, how many slots each commits (``select_top_k``'s k)."""
        if batch[0].params.decode != "vanilla":
            return [(r.block, 0) for r in batch]
        return [(r.block, min(transfer_count(r), r.num_masked)) for r in batch]

    @staticmethod
    def _host_inputs(runner, plan, signature: list[tuple[int, int]]
                     ) -> tuple[np.ndarray, _Layout]:
        batch = plan.requests
        ps, W = runner.page_size, runner.arena.shape[1]
        shift = runner.cfg.logit_shift
        width = runner.table_width
        bl = batch[0].params.block_length
        verify = batch[0].params.decode == "verify"
        windows = [query_range(r.params.cache, r.canvas_len, r.block_start, r.block_end, False,
                               shift) for r in batch]
        counts = [q1 - q0 for q0, q1 in windows]
        B, T = len(batch), sum(counts)
        groups, perm = None, list(range(B))
        if batch[0].params.decode == "vanilla":
            by: dict[tuple[int, int], list[int]] = {}
            for b, (r, (_, k)) in enumerate(zip(batch, signature)):
                by.setdefault((r.canvas_len, k), []).append(b)
            groups, perm, a = [], [], 0
            for (length, k), members in by.items():
                groups.append((length, k, a, a + len(members)))
                perm += members
                a += len(members)
            groups = tuple(groups)
        longest = max(r.canvas_len for r in batch)
        M = max(r.params.max_verify for r in batch) if verify else 0
        lay = _Layout(B, T, bl, width, max(counts), seqlen_bound(longest), groups, M,
                      dense_keys(longest, ps, width) if verify else 0)
        sl = lay.slices
        host = np.zeros(lay.size, dtype=np.int64)
        table = runner.block_table(plan)                 # the general path's cached table
        host[sl["table"]] = table.ravel()
        cu = np.zeros(B + 1, dtype=np.int64)
        cu[1:] = np.cumsum(counts)
        pos, n = inputs.range_positions(windows)
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
        host[sl["cu_q"]] = cu
        host[sl["seq_lens"]] = [r.canvas_len for r in batch]
        host[sl["tau"]] = np.array([r.params.threshold for r in batch],
                                   dtype=np.float64).view(np.int64)
        host[sl["perm"]] = perm
        host[sl["bstart"]] = bstart
        if verify:
            host[sl["arow"]] = arena_row
            host[sl["gamma"]] = np.array([r.params.gamma for r in batch],
                                         dtype=np.float64).view(np.int64)
            host[sl["cumprod"]] = [r.params.verify_rule == "cumprod" for r in batch]
            host[sl["max_verify"]] = [r.params.max_verify for r in batch]
        return host, lay

    # ------------------------------------------------------------------------------------ body
    @staticmethod
    def _body(runner, inp: torch.Tensor, lay: _Layout, lm_rows: int) -> torch.Tensor:
        """The step on the device, from the index vector ``inp``; returns the active blocks after
        the commit [B, bl]. Only static-shape ops, no host syncs: this is what the graph
        captures."""
        model, mask_id = runner.model, runner.cfg.mask_token_id
        sl = lay.slices
        if lay.M:
            return verify_graph.body(runner, inp, lay, sl)
        B, bl = lay.B, lay.bl
        i32 = torch.int32
        meta = PagedAttentionMetadata(runner.kv, inp[sl["slots"]], inp[sl["cu_q"]].to(i32),
                                      inp[sl["seq_lens"]].to(i32),
                                      inp[sl["table"]].to(i32).view(B, -1), lay.max_q,
                                      runner.backend.inv_freq, lay.max_k)
        flat = runner.arena.view(-1)
        hidden = model.hidden(flat[inp[sl["ids_idx"]]], inp[sl["positions"]], meta)
        blk_idx = inp[sl["blk_idx"]]
        blocks = flat[blk_idx].view(B, bl)
        masked = blocks == mask_id
        rows = inp[sl["rows"]]                                   # [B * bl] hidden row per slot
        if lm_rows >= lay.R:
            tok, conf = model.greedy(hidden[rows], mask_id)
        else:
            tok, conf = StepGraphs._masked_proposal(model, hidden, rows, masked.view(-1),
                                                    lm_rows, mask_id)
        if lay.groups is None:
            keep = threshold_rows(conf.view(B, bl), masked, inp[sl["tau"]].view(torch.float64))
        else:
            keep = top_k_rows(conf.view(B, bl), masked, inp[sl["perm"]], inp[sl["bstart"]],
                              lay.groups)
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
