"""The model runner: owns the device state and executes a step plan on its device.

``ModelRunner.execute(plan) -> StepResult``. What it owns (and nothing else touches):

- the model, its KV page pool and attention backend (``layers/attention_backend.py``);
- the canvas **arena**: every running request's canvas is a row of one tensor, so a step gathers
  its ids and commits its tokens with one launch each;
- each running request's device state (``SeqState``: arena row, page ids on the device, sampling
  generators, Flash-Verify drafts, the KV sentinel's history, the ``flash`` mode's attention mass);
- the CUDA graphs of both capture modes (``worker/graphs.py``, ``worker/fused_step.py``).

A step runs fused (``worker/fused_step.py``: one graph for the whole step) when its batch is
eligible, else on the general path (``worker/general_step.py``); the step extensions active on a
plan (``worker/extensions``) are found once per plan.

NOTE (syncs): a step makes ONE device->host copy, the active blocks after the commit
(``StepResult.blocks``); only opt-in features sync more (``verify`` counters, sentinels).
"""
from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import torch

from flash_dllm.cache.io.kv_offload import KVOffloader
from flash_dllm.cache.io.kv_overflow import OverflowKV, OverflowMemoryError, OverflowMetadata
from flash_dllm.cache.paged import (PagedKVLayout, allocate_kv_cache, allocate_kv_scales,
                                    kv_pool, kv_pool_dtype)
from flash_dllm.cache.tiers import Load
from flash_dllm.config import EngineConfig
from flash_dllm.layers.batch_invariant import batch_invariant
from flash_dllm.layers.quant import quantize_as_configured, weight_bytes
from flash_dllm.core.plan import StepPlan, StepResult
from flash_dllm.core.request import Request
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.layers.attention_backend import PagedAttentionBackend
from flash_dllm.models.config import ModelConfig
from flash_dllm.transfer import h2d
from flash_dllm.worker import extensions, general_step, inputs
from flash_dllm.worker.compile_watch import KERNEL_COMPILES
from flash_dllm.worker.graphs import ForwardGraphs, GraphCache
from flash_dllm.worker.fused_step import FusedSteps
from flash_dllm.worker.state import SeqState


class ModelRunner:
    def __init__(self, model, cfg: ModelConfig, config: EngineConfig) -> None:
        self.model, self.cfg, self.config = model, cfg, config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        fuse = config.fuse_projections
        if fuse or (fuse is None and self.device.type == "cuda"):
            model.fuse_projections()
        # quantized weights (``layers/quant.py``): after fusing, so q/k/v and gate/up are
        # quantized as the GEMMs that run; the bytes are reported at start-up and in /metrics
        self.quantization = config.quantization
        self.weight_info = (quantize_as_configured(model, config)
                            or {"quantization": None, "weight_bytes": weight_bytes(model)})
        self.weight_bytes = self.weight_info["weight_bytes"]
        # NOTE: allocated before the KV pool is sized from gpu_memory_utilization, so the pool
        # accounts for it
        self.arena = torch.full((config.max_num_seqs, cfg.max_position), cfg.mask_token_id,
                                dtype=torch.long, device=self.device)
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._policy_stores: dict[str, object] = {}     # decode policies' device state
        # tensor parallelism: this rank's pool holds its KV heads only (the ledger is replicated)
        self.tp = getattr(model, "tp", None)
        world = 1 if self.tp is None else self.tp.world
        # (more ranks than KV heads: a rank holds one KV head, see distributed/tp.py)
        self.kv_heads = cfg.num_kv_heads if self.tp is None else self.tp.kv_heads
        # the pool's element type: the model's, or fp8 codes + per-(page, head) scales
        self.kv_dtype = kv_pool_dtype(config.kv_cache_dtype, self.dtype)
        kv_token = cfg.kv_bytes_per_token(self.kv_dtype) * self.kv_heads // cfg.num_kv_heads
        self.table_width = -(-cfg.max_position // config.page_size)
        self.overflow = self._make_overflow(cfg, config)
        self.overflow_state = None              # the running one's OverflowState
        one = PagedKVLayout(cfg.num_layers, 1, config.page_size, self.kv_heads, cfg.head_dim,
                            self.kv_dtype)
        self.num_pages = config.num_pages(kv_token, self._kv_budget(), one.scale_bytes_per_page)
        if self.tp is not None:        # every rank's ledger must be the same: the smallest pool
            self.num_pages = self.tp.group.min_int(self.num_pages, self.device)
        self.page_size = config.page_size
        # CUDA graphs pad a step's shape to a bucket (``worker/graphs.py``): the padding rows
        # write their K/V to one more page than the ledger hands out
        graphs = self.device.type == "cuda" and config.cuda_graphs
        layout = PagedKVLayout(cfg.num_layers, self.num_pages + graphs, self.page_size,
                               self.kv_heads, cfg.head_dim, self.kv_dtype)
        self.backend = PagedAttentionBackend(allocate_kv_cache(layout, self.device),
                                             cfg.head_dim, cfg.rope_theta, tp=self.tp,
                                             scales=allocate_kv_scales(layout, self.device),
                                             rotary_dim=cfg.rotary_dim)
        # set by the engine when its placement policy uses attention evidence (``kv_manager``)
        self.collect_page_mass = False
        if self.device.type == "cuda":
            KERNEL_COMPILES.install()          # count Triton compiles (server metrics, warm-up)
        self._make_graphs(model, cfg, config, graphs, world)
        self._tables = inputs.BlockTables()
        self._states: dict[str, SeqState] = {}
        # memory tiers: the offloader moves pages between the pool, pinned host slots and disk
        self.page_bytes = self.page_size * kv_token + one.scale_bytes_per_page
        self.compat = self._compat(config)
        self.offload: KVOffloader | None = None
        if config.kv_cpu_gb or config.kv_tier_stress:    # (the tiers: cache/tier_store.py)
            self.offload = KVOffloader.from_config(self.kv, config, self.compat,
                                                   self.kv_scales)
        # the last plan, its requests' states and the step extensions active on it
        self._last_plan: StepPlan | None = None
        self._last_states: list[SeqState] = []
        self._last_extensions: list = []
        # disaggregation (``disagg/worker.py``): an object with ``wants(plan)`` and
        # ``__call__(plan, layer)``, called after each layer's attention of the plans it wants
        self.layer_hook = None
        # benchmarks: when True, CUDA events (or host times) bracket each step's forward
        self.time_forward = False
        self.forward_events: list = []

    def _make_overflow(self, cfg: ModelConfig, config: EngineConfig) -> OverflowKV | None:
        """Requests larger than the pool: a stage of two layers of the longest canvas (made
        before the pool is sized, like the arena) and pinned host memory on demand."""
        if not config.kv_overflow_gb:
            return None
        return OverflowKV(cfg.num_layers, config.page_size, self.kv_heads, cfg.head_dim,
                          self.dtype, self.device, self.table_width,
                          int(config.kv_overflow_gb * 2**30), lazy_budget=config.lazy_load_budget,
                          lazy_sentinel=config.lazy_load_sentinel,
                          lazy_predictor=config.lazy_load_predictor,
                          placement=config.kv_placement or "ema",
                          placement_top_k=config.kag_top_k)

    def _make_graphs(self, model, cfg: ModelConfig, config: EngineConfig, graphs: bool,
                     world: int) -> None:
        """The CUDA graph cache and both capture modes: forward graphs (CUDA only) and the fused
        step (with CUDA graphs, or forced on by ``fused_step=True``: eager on the CPU)."""
        self.graph_cache = GraphCache(config.max_cuda_graphs)
        self.graph_cache.set_model(sum(p.numel() for p in model.parameters()))
        self.forward_graphs: ForwardGraphs | None = None
        if graphs:
            self.forward_graphs = ForwardGraphs(model, self.graph_cache,
                                                config.cuda_graph_max_rows,
                                                config.cuda_graph_max_tokens,
                                                scratch_page=self.num_pages)
        self.fused: FusedSteps | None = None
        fused = config.fused_step
        if fused or (fused is None and self.forward_graphs is not None):
            self.fused = FusedSteps(self.graph_cache, config.fused_step_max_rows,
                                    config.cuda_graph_max_tokens, config.cuda_graph_max_rows)
            self.fused.first_steps = config.fused_first_steps
            self.fused.dims = dict(
                vocab=cfg.vocab_size, heads=cfg.num_heads // world, kv_heads=self.kv_heads,
                head_dim=cfg.head_dim, page_size=config.page_size, table_width=self.table_width,
                block_size=cfg.attention.block_size,      # block-causal: its windows' bound
                logit_shift=cfg.logit_shift,
                whole_rope=not cfg.qk_norm and cfg.rotary_dim in (None, cfg.head_dim))

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
        if kv_pool(config.kv_cache_dtype).element is not None:   # (absent for the model's
            # own dtype: earlier keys stay)
            desc += f"/kv-{config.kv_cache_dtype}"
        if c.attention.block_causal or c.qk_norm or c.rotary_dim not in (None, c.head_dim):
            # (what else a page's K/V depend on; absent for LLaDA / Dream, whose keys stay)
            desc += f"/{c.attention}/qk{int(c.qk_norm)}/rot{c.rotary_dim}"
        return hashlib.blake2b(desc.encode(), digest_size=16).digest()

    @property
    def kv(self) -> torch.Tensor:
        """The KV page pool [layers, 2, pages, page_size, kv_heads, head_dim]."""
        return self.backend.kv

    @property
    def kv_scales(self) -> torch.Tensor | None:
        """fp8 pools: the scales [layers, 2, pages, kv_heads] fp32 (``kernels/kv_quant.py``);
        None for a pool of the model's dtype (or a backend with no pool: the tests' dense one)."""
        return getattr(self.backend, "scales", None)

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
            if self.kv_scales is not None:   # fp8: the request's own pages start empty
                fresh = pages[req.reused_len // self.page_size:]
                self.kv_scales[:, :, h2d(fresh, torch.long, self.device)] = 0
            row = self._free_rows.pop()
            st = SeqState(row, self.arena[row, :req.canvas_len], table, gen, block=req.block)
            st.canvas.copy_(tokens)
            self._states[req.request_id] = st
        elif st.block != req.block:       # a new block: its per-block state goes
            st.new_block(req.block)
        return st

    def state(self, request_id: str) -> SeqState | None:
        """A running request's device state as it is (None: it has not run a step); unlike
        ``seq`` this never resets a state whose block has advanced."""
        return self._states.get(request_id)

    def policy_store(self, name: str, factory):
        """A decode policy's device state on this runner (made by ``factory`` on first use)."""
        store = self._policy_stores.get(name)
        if store is None:
            store = self._policy_stores[name] = factory()
        return store

    def state_to_host(self, st: SeqState) -> None:
        """Bring what a fused step left of a request's state on the device into ``st`` (the
        general path's form; disaggregation's export reads it)."""
        for policy in DECODE_POLICIES.values():
            policy.before_general(self, [st])

    def release(self, request_id: str) -> None:
        """Drop a finished or aborted request's device state (its arena row is reused)."""
        st = self._states.pop(request_id, None)
        if st is not None:
            self._free_rows.append(st.arena_row)
        if self.overflow_state is not None and self.overflow_state.request_id == request_id:
            self.overflow_state = None
        self._last_plan, self._last_states, self._last_extensions = None, [], []
        self.backend.release(request_id)
        # the step caches hold the last batch's requests (identity checks): let this one go
        self._tables.forget(request_id)
        if self.fused is not None:
            self.fused.forget(request_id)

    def block_table(self, plan: StepPlan) -> np.ndarray:
        """[B, table_width] int32 page ids of the plan's requests (cached while the batch stays)."""
        return self._tables.get(plan.requests, [s.pages for s in plan.seqs], self.table_width)

    def arena_rows(self, batch: list[Request]) -> list[int]:
        return [self._states[r.request_id].arena_row for r in batch]

    # ----------------------------------------------------------------------------------- step
    def _numerics(self):
        """``deterministic``: row GEMMs and kernel launches whose results do not depend on the
        batch (``layers/batch_invariant.py``: padded rows on the CPU, fixed tiles on a GPU);
        otherwise nothing."""
        if self.config.deterministic:
            return batch_invariant()
        return contextlib.nullcontext()

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
            with self._numerics():
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
        states, exts = self._plan_states(plan)
        if self._fusable(plan, exts):
            result = self.fused.run(self, plan, states)
            if result is not None:
                return result
        return general_step.run(self, plan, states, exts)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, ahead=None):
        """Start one fused step of ``plan`` from a captured graph and return without waiting
        for it (multi-step, ``engine/multi_step.py``): a ``Launched`` (``result()`` waits), or
        None where this step is not a fused one that can run so (``ahead``: see
        ``FusedSteps.launch``). Never with tier ops or host tiers (other streams copy)."""
        if self.fused is None or plan.ops or self.offload is not None or not plan.seqs:
            return None
        states, exts = self._plan_states(plan)
        if not self._fusable(plan, exts):
            return None
        with self._numerics():
            return self.fused.launch(self, plan, states, ahead, replay_only=True)

    def _plan_states(self, plan: StepPlan) -> tuple[list[SeqState], list]:
        """The plan's requests' states and the step extensions active on it."""
        if plan is self._last_plan:          # the same batch in the same blocks: same states
            return self._last_states, self._last_extensions
        states = [self.seq(s.req, s.pages) for s in plan.seqs]
        exts = extensions.active_on(plan.requests)
        self._last_plan, self._last_states, self._last_extensions = plan, states, exts
        return states, exts

    def _fusable(self, plan: StepPlan, exts: list) -> bool:
        return (self.fused is not None and not (self.layer_hook is not None
                                                and self.layer_hook.wants(plan))
                and self.fused.eligible_plan(plan, exts))

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
        with self._numerics():      # (deterministic: captured with the invariant launches)
            return self.forward_graphs.warm(shapes, template)

    def forward_seconds(self) -> float | None:
        """The last timed forward's seconds (``time_forward``; None if no forward ran since the
        events were cleared, e.g. a whole-step graph)."""
        ev = self.forward_events
        if not ev:
            return None
        return ev[0].elapsed_time(ev[1]) / 1e3 if len(ev) == 2 else ev[0]
