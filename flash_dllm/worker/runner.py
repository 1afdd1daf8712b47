"""The model runner: owns the device state and executes a step plan on its device.

``ModelRunner.execute(plan) -> StepResult``. What it owns (and nothing else touches):

- the model, its KV page pool and attention backend (``layers/attention_backend.py``);
- the canvas **arena**: every running request's canvas is a row of one tensor, so a step gathers
  its ids and commits its tokens with one launch each;
- each running request's device state (``SeqState``: arena row, page ids on the device, sampling
  generators, Flash-Verify drafts, the KV sentinel's history, the ``flash`` mode's attention mass);
- the CUDA graphs of both capture modes (``worker/graphs.py``, ``worker/step_graph.py``).

NOTE (syncs): a step makes ONE device->host copy, the active blocks after the commit
(``StepResult.blocks``); only opt-in features sync more (``verify`` counters, sentinels).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from flash_dllm.cache.io.kv_offload import KVOffloader
from flash_dllm.cache.io.kv_overflow import OverflowKV, OverflowMemoryError, OverflowMetadata
from flash_dllm.cache.modes import query_range
from flash_dllm.cache.paged import PagedKVLayout, allocate_kv_cache
from flash_dllm.cache.tiers import Load
from flash_dllm.config import EngineConfig
from flash_dllm.core.counters import count as _count
from flash_dllm.core.plan import StepPlan, StepResult
from flash_dllm.core.request import Request
from flash_dllm.decoding import drift
from flash_dllm.layers.attention_backend import PagedAttentionBackend
from flash_dllm.models.config import ModelConfig
from flash_dllm.transfer import h2d
from flash_dllm.worker import inputs
from flash_dllm.worker.compile_watch import KERNEL_COMPILES
from flash_dllm.worker.graphs import ForwardGraphs, GraphCache
from flash_dllm.worker.sampler import sample_and_commit
from flash_dllm.worker.step_graph import StepGraphs
from flash_dllm.worker.verify_graph import DraftStore
from flash_dllm.worker.verify_step import kv_consistency, update_drafts


@dataclass
class SeqState:
    """One running request's device state (the runner's; the request itself is host data)."""

    arena_row: int
    canvas: torch.Tensor                 # [canvas] long: a view of the arena row
    page_row: torch.Tensor               # [pages] int32: the request's page ids
    generator: torch.Generator | None = None
    sentinel_generator: torch.Generator | None = None
    # per-block state (reset when the request's block advances)
    block: int = 0
    # decode="verify": (slots, tokens), or IN_STORE (in the runner's DraftStore: a fused step's)
    drafts: tuple[torch.Tensor, torch.Tensor] | str | None = None
    refresh: torch.Tensor | None = None      # cached positions the next forward recomputes
    kv_history: torch.Tensor | None = None   # [block_length, k] last top-k keys per slot
    # cache="flash": (the last step's mass [batch, keys], this request's row in it)
    mass_src: tuple[torch.Tensor, int] | None = None
    drift_prev: tuple | None = None          # the drift test's last step (``decoding/drift.py``)

    @property
    def attn_mass(self) -> torch.Tensor | None:
        """cache="flash": attention mass [canvas] each key got in this request's last step."""
        if self.mass_src is None:
            return None
        return self.mass_src[0][self.mass_src[1], :self.canvas.shape[0]]      # (mass, row)


class ModelRunner:
    def __init__(self, model, cfg: ModelConfig, config: EngineConfig) -> None:
        self.model, self.cfg, self.config = model, cfg, config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        fuse = config.fuse_projections
        if fuse or (fuse is None and self.device.type == "cuda"):
            model.fuse_projections()
        # NOTE: allocated before the KV pool is sized from gpu_memory_utilization, so the pool
        # accounts for it
        self.arena = torch.full((config.max_num_seqs, cfg.max_position), cfg.mask_token_id,
                                dtype=torch.long, device=self.device)
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.drafts = DraftStore(config.max_num_seqs, self.device)   # fused verify steps'
        # tensor parallelism: this rank's pool holds its KV heads only (the ledger is replicated)
        self.tp = getattr(model, "tp", None)
        world = 1 if self.tp is None else self.tp.world
        self.kv_heads = cfg.num_kv_heads // world
        self.table_width = -(-cfg.max_position // config.page_size)
        # requests larger than the pool: a stage of two layers of the longest canvas (allocated
        # before the pool is sized, like the arena) and pinned host memory on demand
        self.overflow: OverflowKV | None = None
        self._overflow_req = None              # its OverflowState
        if config.kv_overflow_gb:
            self.overflow = OverflowKV(cfg.num_layers, config.page_size, self.kv_heads,
                                       cfg.head_dim, self.dtype, self.device, self.table_width,
                                       int(config.kv_overflow_gb * 2**30),
                                       lazy_budget=config.lazy_load_budget,
                                       lazy_sentinel=config.lazy_load_sentinel,
                                       lazy_predictor=config.lazy_load_predictor,
                                       placement=config.kv_placement or "ema",
                                       placement_top_k=config.kag_top_k)
        self.num_pages = config.num_pages(cfg.kv_bytes_per_token(self.dtype) // world,
                                          self._kv_budget())
        if self.tp is not None:        # every rank's ledger must be the same: the smallest pool
            self.num_pages = self.tp.group.min_int(self.num_pages, self.device)
        self.page_size = config.page_size
        # CUDA graphs pad a step's shape to a bucket (``worker/graphs.py``): the padding rows
        # write their K/V to one more page than the ledger hands out
        graphs = self.device.type == "cuda" and config.cuda_graphs
        layout = PagedKVLayout(cfg.num_layers, self.num_pages + graphs, self.page_size,
                               self.kv_heads, cfg.head_dim, self.dtype)
        self.backend = PagedAttentionBackend(allocate_kv_cache(layout, self.device),
                                             cfg.head_dim, cfg.rope_theta, tp=self.tp)
        self.graph_cache = GraphCache(config.max_cuda_graphs)
        self.graph_cache.set_model(sum(p.numel() for p in model.parameters()))
        # set by the engine when its placement policy uses attention evidence (``kv_manager``)
        self.collect_page_mass = False
        if self.device.type == "cuda":
            KERNEL_COMPILES.install()          # count Triton compiles (server metrics, warm-up)
        self.forward_graphs: ForwardGraphs | None = None
        if graphs:
            self.forward_graphs = ForwardGraphs(model, self.graph_cache,
                                                config.cuda_graph_max_rows,
                                                config.cuda_graph_max_tokens,
                                                scratch_page=self.num_pages)
        self.step_graphs: StepGraphs | None = None
        fused = config.fused_step
        if fused or (fused is None and self.forward_graphs is not None):
            self.step_graphs = StepGraphs(self.graph_cache, config.fused_step_max_rows,
                                          config.cuda_graph_max_tokens,
                                          config.cuda_graph_max_rows)
            self.step_graphs.dims = dict(
                vocab=cfg.vocab_size, heads=cfg.num_heads // world, kv_heads=self.kv_heads,
                head_dim=cfg.head_dim, page_size=config.page_size, table_width=self.table_width)
        self._tables = inputs.BlockTables()
        self._states: dict[str, SeqState] = {}
        # memory tiers: the offloader moves pages between the pool, pinned host slots and disk
        self.page_bytes = self.page_size * cfg.kv_bytes_per_token(self.dtype) // world
        self.compat = self._compat(config)
        self.offload: KVOffloader | None = None
        if config.kv_cpu_gb or config.kv_tier_stress:    # (the tiers: cache/tier_store.py)
            self.offload = KVOffloader.from_config(self.kv, config, self.compat)
        self._last_plan: StepPlan | None = None     # the last plan and its requests' states
        self._last_states: list[SeqState] = []
        # disaggregation (``disagg/worker.py``): an object with ``wants(plan)`` and
        # ``__call__(plan, layer)``, called after each layer's attention of the plans it wants
        self.layer_hook = None
        # benchmarks: when True, CUDA events (or host times) bracket each step's forward
        self.time_forward = False
        self.forward_events: list = []

    def _kv_budget(self) -> int | None:
        u = self.config.gpu_memory_utilization
        if u is None or self.config.num_kv_pages is not None:
            return None
        if self.device.type != "cuda":
            raise ValueError("gpu_memory_utilization needs a CUDA device; use kv_cache_gb on "
                             f"{self.device}")
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = max(0, int(u * total) - torch.cuda.memory_allocated(self.device))
        # free on the device, plus what this process's allocator keeps cached (an engine freed
        # before this one, e.g. bench multiturn --compare's first server)
        free = (torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device)
                - torch.cuda.memory_allocated(self.device))
        if budget > free:       # another process holds part of the GPU: say so, not an OOM
            raise ValueError(
                f"gpu_memory_utilization={u} asks for a {budget / 2**30:.1f} GiB KV pool, but "
                f"only {free / 2**30:.1f} GiB of {self.device}'s {total / 2**30:.1f} GiB are "
                "free (another process?): pass a smaller --gpu-memory-utilization or a pool "
                "size (--kv-cache-gb / --num-kv-pages)")
        return budget

    def _compat(self, config: EngineConfig) -> bytes:
        """What a cached page's bytes depend on besides its tokens (prefix-tree namespace and
        disk-record compatibility): model shape, dtype, page layout and size, offload dtype."""
        c = self.cfg
        tp = "" if self.tp is None else f"/tp{self.tp.group.rank}of{self.tp.world}"
        desc = (f"{c.num_layers}/{c.hidden_size}/{c.num_heads}/{c.num_kv_heads}/{c.head_dim}/"
                f"{c.vocab_size}/{c.rope_theta}/{self.dtype}/page{self.page_size}/"
                f"layer-major-v1/{config.kv_offload_dtype}{tp}")
        return hashlib.blake2b(desc.encode(), digest_size=16).digest()

    @property
    def kv(self) -> torch.Tensor:
        """The KV page pool [layers, 2, pages, page_size, kv_heads, head_dim]."""
        return self.backend.kv

    # ------------------------------------------------------------------------ per-request state
    def seq(self, req: Request, pages: list[int] | None = None) -> SeqState:
        """The request's device state, created at its first step (``pages``: its KV pages)."""
        st = self._states.get(req.request_id)
        if st is None:
            if pages is None:
                raise ValueError(f"request {req.request_id!r} has no runner state and no pages")
            p, gen = req.params, None      # (what can fail comes before the row is taken)
            if p.temperature > 0:
                seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
                gen = torch.Generator(device=self.device).manual_seed(seed)
            tokens, table = h2d(req.tokens, torch.long, self.device), h2d(pages, torch.int32,
                                                                          self.device)
            row = self._free_rows.pop()
            st = SeqState(row, self.arena[row, :req.canvas_len], table, gen, block=req.block)
            st.canvas.copy_(tokens)
            self._states[req.request_id] = st
        elif st.block != req.block:       # a new block: its drafts, refresh and history go
            st.block = req.block
            st.drafts = st.refresh = st.kv_history = None
        return st

    def release(self, request_id: str) -> None:
        """Drop a finished or aborted request's device state (its arena row is reused)."""
        st = self._states.pop(request_id, None)
        if st is not None:
            self._free_rows.append(st.arena_row)
        if self._overflow_req is not None and self._overflow_req.request_id == request_id:
            self._overflow_req = None
        self._last_plan, self._last_states = None, []
        self.backend.release(request_id)
        # the step caches hold the last batch's requests (identity checks): let this one go
        self._tables.forget(request_id)
        if self.step_graphs is not None:
            self.step_graphs.forget(request_id)

    def block_table(self, plan: StepPlan) -> np.ndarray:
        """[B, table_width] int32 page ids of the plan's requests (cached while the batch stays)."""
        return self._tables.get(plan.requests, [s.pages for s in plan.seqs], self.table_width)

    def arena_rows(self, batch: list[Request]) -> list[int]:
        return [self._states[r.request_id].arena_row for r in batch]

    # ----------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's tier ops, then one denoising forward for every request of ``plan``: commits
        tokens on the device and returns the active blocks after it (the step's one
        device->host copy). A request one of whose reused pages failed verification is left
        out (``StepResult.failed``): nothing is computed on a page that is not what it claims."""
        done, failed = [], set()
        if self.offload is not None:
            done = self.offload.run(plan.ops) if plan.ops else self.offload.poll()
            bad = {op.page for op, ok, _ in done if isinstance(op, Load) and not ok}
            if bad:
                failed = {s.req.request_id for s in plan.seqs
                          if bad.intersection(s.pool_pages)}
                plan = StepPlan([s for s in plan.seqs if s.req.request_id not in failed])
        if not plan.seqs:
            return StepResult(np.zeros((0, 1), dtype=np.int64), ops_done=done, failed=failed)
        try:
            result = self._execute(plan)
        except OverflowMemoryError as e:      # (before any device work of the forward)
            return StepResult(np.zeros((0, 1), dtype=np.int64), ops_done=done, failed=failed,
                              errors={plan.seqs[0].req.request_id: str(e)})
        result.ops_done, result.failed = done, failed
        if self.config.kv_tier_stress:        # every page down to host memory and back
            pages = sorted({p for s in plan.seqs for p in s.pool_pages})
            if not self.offload.roundtrip(pages):
                raise RuntimeError("kv_tier_stress: a page came back corrupt")
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        if plan is self._last_plan:          # the same batch in the same blocks: same states
            states = self._last_states
        else:
            states = [self.seq(s.req, s.pages) for s in plan.seqs]
            self._last_plan, self._last_states = plan, states
        if plan.seqs[0].overflow is not None:     # larger than the pool: runs alone, eagerly
            return self._general(plan, states)
        if self.step_graphs is not None and not (self.layer_hook is not None
                                                 and self.layer_hook.wants(plan)) \
                and self.step_graphs.eligible_plan(plan, states):
            result = self.step_graphs.run(self, plan, states)
            if result is not None:
                return result
        return self._general(plan, states)

    def _general(self, plan: StepPlan, states: list[SeqState]) -> StepResult:
        batch = plan.requests
        for st in states:
            self.drafts.to_host(st)
        step = inputs.pack_step(self, plan, states)
        if plan.seqs[0].overflow is not None:
            step.meta = self._overflow_meta(plan.seqs[0], step.meta)
        hidden = self.forward(step.ids, step.positions, step.meta)
        page_mass = None
        if step.flash:      # cache="flash": where this step's attention went, for the next top-k
            mass = step.meta.mass.clone()    # one copy (a graph's output is overwritten on replay)
            for i in step.flash:
                states[i].mass_src = (mass, i)
            if self.collect_page_mass:       # and, per page, for the placement policy
                page_mass = mass.view(mass.shape[0], -1, self.page_size).sum(-1)
        lazy_mass = None
        if isinstance(step.meta, OverflowMetadata) and step.meta.mass is not None:
            # lazy loading: where the step attended, per page of its block table (a measuring
            # step: every page, for the block's next steps; a lazy step: the loaded ones, for
            # the sentinel); reduced on the device here, read after the step's one sync below
            n = step.meta.mass_pages
            lazy_mass = step.meta.mass[0, :n * self.page_size].view(n, -1).sum(-1).float()
        tokens, conf, keep, counters = sample_and_commit(
            self.model, self.arena, self.cfg.mask_token_id, step, batch, states, hidden)
        flags = drift.test(batch, states, step.windows, step.meta.mass, counters)
        blocks = self.arena.view(-1)[step.blk_idx].view(len(batch), step.max_bl)
        if flags is not None:
            blocks = torch.cat([blocks, flags[:, None]], 1)
        blocks, drifted = drift.split(blocks.cpu().numpy(), flags, batch, counters)  # one copy
        if isinstance(step.meta, OverflowMetadata) and step.meta.quest_score is not None:
            self.overflow.observe_score(self._overflow_req, step.meta.quest_score.cpu().numpy())
        if lazy_mass is not None:
            checked, trig = self.overflow.observe(self._overflow_req, step.meta.lazy,
                                                  lazy_mass.cpu().numpy())
            if checked:
                _count(counters, 0, "sentinel_checks", 1, "lazy_load")
                _count(counters, 0, "sentinel_triggers", int(trig), "lazy_load")
        if page_mass is not None:          # (ema / kag placement: after it, never mid-step)
            per_page = page_mass.cpu().numpy()
            page_mass = {batch[i].request_id: per_page[i] for i in step.flash}
        for i, (req, st, seg, (s, e)) in enumerate(zip(batch, states, step.segments,
                                                       step.bounds)):
            if req.params.decode == "verify":
                update_drafts(req, st, tokens[s:e], conf[s:e], step.slot_pos[s:e], keep[s:e])
            if seg.probe is not None:
                kv_consistency(req, st, seg.probe_weights, step.slot_pos[s:e], counters, i)
        return StepResult(blocks, counters, page_mass=page_mass, drifted=drifted)

    def _overflow_meta(self, seq, meta) -> OverflowMetadata:
        """An overflow request's step metadata (host buffer and resident page index made at its
        first step; the window of the block's later steps is kept resident)."""
        r, st = seq.req, self._overflow_req
        if st is None or st.request_id != r.request_id:
            st = self._overflow_req = self.overflow.new_state(r.request_id, seq.overflow)
        return self.overflow.step(meta, seq.overflow, st, seq.window, r.canvas_len, query_range(
            r.params.cache, r.canvas_len, r.block_start, r.block_end, False,
            self.cfg.logit_shift, first_block=False, refresh=False))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model forward of one step (from a CUDA graph when one fits)."""
        if not self.time_forward:
            return self._forward(ids, positions, meta)
        # NOTE: events recorded around the forward and read after the step: timing it adds no
        # sync inside the step
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._forward(ids, positions, meta)
            end.record()
            self.forward_events = [start, end]
            return out
        import time
        t0 = time.perf_counter()
        out = self._forward(ids, positions, meta)
        self.forward_events = [time.perf_counter() - t0]
        return out

    def _forward(self, ids, positions, meta) -> torch.Tensor:
        hook = self.layer_hook
        if hook is not None and hook.wants(self._last_plan):
            # disaggregation's pipelined send: ``hook(plan, layer)`` runs once each layer's K/V
            # are in their pages, so early layer groups travel while later layers compute (an
            # eager forward: a graph replay has no point between layers)
            attend, plan = meta.attention, self._last_plan

            def attention(module, layer, x, pos):
                out = attend(module, layer, x, pos)
                hook(plan, layer)
                return out
            meta.attention = attention
            try:
                return self.model.hidden(ids, positions, meta)
            finally:
                del meta.attention
        if self.forward_graphs is not None and not isinstance(meta, OverflowMetadata):
            return self.forward_graphs.forward(ids, positions, meta)
        return self.model.hidden(ids, positions, meta)

    @torch.inference_mode()
    def warm_graphs(self, shapes) -> int:
        """Capture the forward graphs of ``shapes`` (``graphs.PaddedShape``) that are missing,
        from steps of dummy rows (the warm-up); returns how many were captured."""
        if self.forward_graphs is None:
            return 0
        template = self.backend.build(np.zeros((1, self.table_width), dtype=np.int32), [1],
                                      torch.zeros(1, dtype=torch.long, device=self.device),
                                      np.zeros(1, dtype=np.int64), [0, 1], [])
        return self.forward_graphs.warm(shapes, template)

    def forward_seconds(self) -> float | None:
        """The last timed forward's seconds (``time_forward``; None if no forward ran since the
        events were cleared, e.g. a whole-step graph)."""
        ev = self.forward_events
        if not ev:
            return None
        return ev[0].elapsed_time(ev[1]) / 1e3 if len(ev) == 2 else ev[0]
