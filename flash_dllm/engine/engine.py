"""Engine: admits requests and runs denoising steps over all running requests in one forward.

One ``step()``:
1. schedule (CPU): which requests run, which canvas positions each recomputes (its cache mode),
   which masked slots need logits;
2. one forward over the packed tokens of every running request (no padding: each request attends
   only to its own canvas through ``PackedContext``), LM head only at those slots; a
   ``decode="verify"`` request also carries the verification block of its previous forward's
   drafts (``flash_dllm.engine.verify_step``), so verification never costs a forward;
3. the decoding policy proposes tokens and picks which to commit;
4. requests advance blocks, finish, and free their caches; waiting requests are admitted.
Requests at different blocks, steps, cache modes and policies share the same forward.
"""
from __future__ import annotations

import copy
import itertools
import time
from collections import deque

import numpy as np
import torch

from flash_dllm.cache.modes import keeps_cache, query_range
from flash_dllm.cache.page_pool import PagePool
from flash_dllm.cache.paged import PagedKVLayout, allocate_kv_cache
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.decoding.policies import group_ids, select_threshold, select_top_k
from flash_dllm.decoding.sampling import RowGroup, propose
from flash_dllm.engine.request import Request, RequestOutput
from flash_dllm.engine.verify_step import (
    kv_consistency,
    new_counters,
    plan_verification,
    select_verify,
    update_drafts,
)
from flash_dllm.engine.cuda_graph import GraphRunner
from flash_dllm.engine import packing
from flash_dllm.engine.fused_step import FusedStep
from flash_dllm.kernels.rope_cache import inv_freq
from flash_dllm.layers.attention import PackedContext, PagedContext, Segment
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.transformer import DiffusionTransformer
from flash_dllm.transfer import h2d


class Engine:
    def __init__(self, model: DiffusionTransformer, cfg: ModelConfig, config: EngineConfig | None = None,
                 decode_text=None) -> None:
        if cfg.mask_token_id is None:
            raise ValueError("the model config has no mask_token_id")
        self.model = model
        self.cfg = cfg
        self.config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.decode_text = decode_text or (lambda ids: "")
        fuse = self.config.fuse_projections
        if fuse or (fuse is None and self.device.type == "cuda"):
            model.fuse_projections()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        # every running request's canvas is a row of one tensor (``Request.canvas`` is a view of
        # it), so a step gathers its ids and commits its tokens with one launch each. Allocated
        # before the KV pool is sized from gpu_memory_utilization, so the pool accounts for it.
        self.arena = torch.full((self.config.max_num_seqs, cfg.max_position), cfg.mask_token_id,
                                dtype=torch.long, device=self.device)
        self._free_rows = list(range(self.config.max_num_seqs - 1, -1, -1))
        self._tables = packing.BlockTables()
        # KV pages: the admission ledger (flash_dllm.cache.page_pool) and, with kv_layout="paged",
        # where K/V physically live: one tensor [layers, 2, pages, page_size, kv_heads, head_dim]
        self.pool = PagePool(self.config.num_pages(cfg.kv_bytes_per_token(self.dtype),
                                                   self._gpu_kv_budget()),
                             self.config.page_size)
        self.paged = self.config.kv_layout == "paged"
        self.kv: torch.Tensor | None = None
        self.graphs: GraphRunner | None = None
        if self.paged:
            layout = PagedKVLayout(cfg.num_layers, self.pool.num_pages, self.pool.page_size,
                                   cfg.num_kv_heads, cfg.head_dim, self.dtype)
            self.kv = allocate_kv_cache(layout, self.device)
            self.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta, self.device)
            if self.device.type == "cuda" and self.config.cuda_graphs:
                self.graphs = GraphRunner(model, self.config.max_cuda_graphs,
                                          self.config.cuda_graph_max_rows,
                                          self.config.cuda_graph_max_tokens)
        # steady greedy steps: the whole step in one CUDA graph (fused_step.py; opt-in)
        self.fused = None
        if self.paged and self.config.fused_step:
            self.fused = FusedStep(self.config.fused_step_max_rows, self.config.max_cuda_graphs,
                                   self.config.cuda_graph_max_tokens,
                                   self.config.cuda_graph_max_rows)
        self.stats = {"forwards": 0, "tokens_committed": 0, "step_seconds": 0.0,
                      "last_batch_size": 0,   # serving: requests in the latest forward
                      **new_counters()}       # decode="verify" and sentinels

    def _gpu_kv_budget(self) -> int | None:
        u = self.config.gpu_memory_utilization
        if u is None or self.config.num_kv_pages is not None:
            return None
        if self.device.type != "cuda":
            raise ValueError("gpu_memory_utilization needs a CUDA device; use kv_cache_gb on "
                             f"{self.device}")
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(0, int(u * total) - torch.cuda.memory_allocated(self.device))

    # ----------------------------------------------------------------------------------- requests
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_position:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds the model's maximum length {self.cfg.max_position}")
        if params.cache == "flash" and not self.paged:
            raise ValueError("cache='flash' needs the paged KV layout (EngineConfig(kv_layout="
                             "'paged')): it ranks keys by the paged kernel's attention mass")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.cfg.vocab_size}): "
                             f"{bad[:5]}")
        # serving: a request bigger than the whole (empty) page pool would wait forever
        if not self.pool.can_ever_fit(total):
            raise ValueError(f"prompt + max_tokens = {total} tokens needs "
                             f"{self.pool.pages_for(total)} KV pages of {self.pool.page_size} "
                             f"tokens, but the pool has only {self.pool.num_pages}")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None) -> Request:
        self.validate(prompt_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, prompt_ids, params, self.cfg.mask_token_id, self.cfg.eos_token_ids,
                      self.device, prompt)
        if params.temperature > 0:
            gen = torch.Generator(device=self.device)
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
            req.generator = gen.manual_seed(seed)
        self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> bool:
        for req in itertools.chain(self.running, self.waiting):
            if req.request_id == request_id and not req.finished:
                req.abort()
                self._release(req)    # serving: an aborted request frees its pages at once
                return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.finished:          # aborted while waiting
                continue
            # serving: admit only if the whole canvas's pages fit now; otherwise wait (FIFO)
            req.pages = self.pool.allocate(req.canvas_len)
            if req.pages is None:
                self.waiting.appendleft(req)
                break
            req.arena_row = self._free_rows.pop()
            row = self.arena[req.arena_row, :req.canvas_len]
            row.copy_(req.canvas)
            req.canvas = row
            if self.paged:
                req.page_row = torch.tensor(req.pages, dtype=torch.int32, device=self.device)
            elif keeps_cache(req.params.cache):
                c = self.cfg
                req.kv = torch.empty(c.num_layers, 2, req.canvas_len, c.num_kv_heads, c.head_dim,
                                     dtype=self.dtype, device=self.device)
            self.running.append(req)

    # --------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one denoising forward for every running request; return those that finished."""
        self._admit()
        self.running = [r for r in self.running if not r.finished]
        if not self.running:
            return []
        t0 = time.perf_counter()
        batch = self.running
        if self.fused is not None and self.fused.eligible(batch):
            out = self.fused.run(self, batch)
            if out is not None:
                return self._advance(batch, *out, t0)
        shift = self.cfg.logit_shift
        mask_id = self.cfg.mask_token_id

        dev = self.device
        counts = [r.num_masked for r in batch]
        n_slot = sum(counts)
        windows = [query_range(r.params.cache, r.canvas_len, r.block_start, r.block_end,
                               r.first_step, shift, first_block=r.block == 0) for r in batch]
        extras = packing.flash_extras(batch, windows, dev)
        ids, positions, segments = [], [], []
        groups, bounds, plans, row_base = [], [], [], []
        cu, uncached = [0], []          # paged: per-request row boundaries; verify row ranges
        n_tok = 0
        s0 = 0
        for b, (req, cnt) in enumerate(zip(batch, counts)):
            q0, q1 = windows[b]
            extra = extras.get(b)
            if req.refresh is not None:    # KV-consistency sentinel: also recompute these keys
                r = req.refresh[(req.refresh < q0) | (req.refresh >= q1)]
                extra = r if extra is None else torch.cat([extra, r])
                req.refresh = None
            # the window is a contiguous slice (a view: the final cat is the only copy), its
            # positions a host range; only extra positions are gathered on the device
            n = q1 - q0 + (0 if extra is None else extra.numel())
            ids.append((req, q0, q1))                 # sliced only off the all-host path
            positions.append((q0, q1))
            if extra is not None:
                ids.append(req.canvas[extra])
                positions.append(extra)
            seg = Segment(n_tok, n_tok + n, None, req.kv,
                          pages=req.page_row if self.paged else None, length=req.canvas_len)
            segments.append(seg)
            row_base.append(n_tok - shift - q0)     # packed row predicting slot p: p + base
            n_tok += n
            plan = plan_verification(req, shift, n_tok)       # last forward's drafts, folded in
            if plan is not None and plan.block is not None:
                ids.append(plan.block.ids)
                positions.append(plan.block.positions)
                seg.verify = plan.rows
                uncached.append((n_tok, n_tok + plan.block.num_rows))
                n_tok += plan.block.num_rows
            cu.append(n_tok)
            plans.append(plan)
            p = req.params
            groups.append(RowGroup(s0, s0 + cnt, p.temperature, p.top_k, p.top_p, req.generator))
            bounds.append((s0, s0 + cnt))
            s0 += cnt

        # per-request vectors, one host->device copy: block starts, row bases, prompt lengths,
        # arena rows
        W = self.arena.shape[1]
        per_req_h = h2d([[r.block_start for r in batch], row_base, [r.prompt_len for r in batch],
                         [r.arena_row for r in batch]], torch.long, dev)
        # every request's masked slots at once: one nonzero over the active blocks (one gather
        # from the arena), sized by the host-kept MASK counts (no device->host sync)
        lengths = {r.params.block_length for r in batch}
        blk_host = None
        if len(lengths) == 1:
            bl = lengths.pop()
            base = np.array([r.arena_row * W + r.block_start for r in batch], dtype=np.int64)
            blk_host = (base[:, None] + np.arange(bl)).ravel()
        ids_t, pos_t, pos_host, blk_t = packing.ids_positions(self.arena, batch, ids,
                                                                 positions, blk_host, dev)
        if blk_t is not None:
            blocks = self.arena.view(-1)[blk_t].view(len(batch), -1)
        else:
            blocks = torch.nn.utils.rnn.pad_sequence(
                [r.canvas[r.block_start:r.block_end] for r in batch], batch_first=True,
                padding_value=mask_id + 1 if mask_id + 1 < self.cfg.vocab_size else mask_id - 1)
        where = torch.nonzero_static(blocks == mask_id, size=n_slot)          # [n_slot, 2]
        slot_req, slot_off = where[:, 0], where[:, 1]
        positions_all = per_req_h[0][slot_req] + slot_off                     # canvas slots
        for req, seg, (s, e), (q0, _) in zip(batch, segments, bounds, windows):
            seg.slots = pos_t[seg.start:seg.end]
            if req.params.kv_jaccard_min is not None:
                seg.probe = positions_all[s:e] - q0
        flash = [i for i, r in enumerate(batch) if r.params.cache == "flash"]
        if self.paged:
            table = self._tables.get(batch, self.pool.pages_for(self.cfg.max_position))
            pb = packing.paged_batch(self.kv, self.inv_freq, self.pool.page_size, table, batch,
                                     pos_t, pos_host, cu, uncached, dev)
            ctx = PagedContext(pb, segments,
                               probe_layer=self.cfg.num_layers - 1,
                               mass_layer=self.cfg.num_layers - 1 if flash else None)
        else:
            ctx = PackedContext(segments, probe_layer=self.cfg.num_layers - 1)
        hidden = self._forward(ids_t, pos_t, ctx)
        if flash:           # cache="flash": where this step's attention went, for the next top-k
            mass = ctx.mass.clone()          # one copy (a graph's output is overwritten on replay)
            for i in flash:
                batch[i].mass_src = (mass, i)
        slot_rows = positions_all + per_req_h[1][slot_req]
        rows = torch.cat([slot_rows] + [p.mask_rows for p in plans if p is not None])
        logits = self.model.logits(hidden[rows])     # [slots + mask views, V], masked slots only
        tokens, conf = propose(logits[:n_slot], groups, forbid=mask_id)
        keep = self._select(batch, conf, positions_all, bounds)
        if any(r.params.decode == "verify" for r in batch):
            select_verify(batch, plans, logits, n_slot, tokens, conf, positions_all, bounds, keep,
                          mask_id, self.stats)

        # commit: masked slots take their token where kept and stay MASK elsewhere (no sync)
        new = torch.where(keep, tokens, torch.full_like(tokens, mask_id))
        flat = per_req_h[3][slot_req] * W + positions_all
        self.arena.view(-1).index_put_((flat,), new)
        # one device->host copy for the whole batch: commits per request, first-slot commits
        first = per_req_h[2][slot_req]
        per_req = torch.zeros(2, len(batch), dtype=torch.long, device=dev)
        per_req[0].index_add_(0, slot_req, keep.long())
        per_req[1].index_add_(0, slot_req, (keep & (positions_all == first)).long())
        committed, firsts = per_req.tolist()
        for req, seg, (s, e) in zip(batch, segments, bounds):
            if req.params.decode == "verify":
                update_drafts(req, tokens[s:e], conf[s:e], positions_all[s:e], keep[s:e])
            if seg.probe is not None:
                kv_consistency(req, seg.probe_weights, positions_all[s:e], self.stats)
        return self._advance(batch, committed, firsts, t0)

    def _advance(self, batch: list[Request], committed: list[int], firsts: list[int],
                 t0: float) -> list[Request]:
        """Book-keeping after a step: requests advance, finish and free their pages."""
        self.stats["tokens_committed"] += sum(committed)
        finished = []
        for req, n, f in zip(batch, committed, firsts):
            req.advance(n, bool(f))
            if req.finished:
                finished.append(req)
                self._release(req)
        self.running = [r for r in self.running if not r.finished]
        self.stats["forwards"] += 1
        self.stats["step_seconds"] += time.perf_counter() - t0
        self.stats["last_batch_size"] = len(batch)
        return finished

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The model forward of one step (from a CUDA graph when one fits); benchmarks time it."""
        if self.graphs is not None and isinstance(ctx, PagedContext):
            return self.graphs.forward(ids, positions, ctx)
        return self.model.hidden(ids, positions, ctx)

    def _release(self, req: Request) -> None:
        """Return a finished request's KV pages to the pool (serving ledger)."""
        if req.pages is not None:
            self.pool.free(req.pages)
            req.pages = None
        # the step caches hold the last batch's requests (identity checks): let this one go
        self._tables.forget(req)
        if self.fused is not None:
            self.fused.forget(req)
        if req.arena_row is not None:      # the row goes to the next request: keep a copy
            req.canvas = req.canvas.clone()
            self._free_rows.append(req.arena_row)
            req.arena_row = None

    def _select(self, batch: list[Request], conf: torch.Tensor, positions: torch.Tensor,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
        keep = torch.zeros_like(conf, dtype=torch.bool)
        by_policy: dict[str, list[int]] = {}
        for i, req in enumerate(batch):
            by_policy.setdefault(req.params.decode, []).append(i)
        if "vanilla" in by_policy:
            idx = by_policy["vanilla"]
            keep |= select_top_k(conf, positions, [bounds[i] for i in idx],
                                 [batch[i].transfer_count() for i in idx],
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

    # ------------------------------------------------------------------------------------ outputs
    def output(self, req: Request) -> RequestOutput:
        ids = req.generated_ids()
        committed = int((req.canvas[req.prompt_len:] != self.cfg.mask_token_id).sum())
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "committed_slots": committed,
                   **copy.deepcopy(req.counters)}
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_ids, text=self.decode_text(ids),
                             token_ids=ids, num_forwards=req.num_forwards,
                             finish_reason=req.finish_reason, finished=req.finished,
                             early_stopped=req.early_stopped, metrics=metrics)
