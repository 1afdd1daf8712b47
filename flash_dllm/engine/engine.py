"""Engine: admits requests and runs denoising steps over all running requests in one forward.

One ``step()`` is three calls across the engine's seams:

1. ``Scheduler.schedule()`` (CPU): admission by KV pages, then a ``StepPlan``: which requests run,
   which canvas positions each recomputes (its cache mode), which pages must be resident;
2. ``ModelRunner.execute(plan)`` (device): one forward over the packed tokens of every request
   (no padding; LM head only at masked slots; ``decode="verify"`` requests also carry the
   verification rows of their previous drafts, so verification never costs a forward), the
   decoding policies' proposals and commit rules, the commit; returns a ``StepResult`` (host data:
   each request's active block after the step, in one device->host copy);
3. ``Engine._apply``: requests advance blocks and finish on the host; finished requests free their
   pages. The caller gets ``StepOutput``s (host data).

Requests at different blocks, steps, cache modes and policies share the same forward. ``Engine``
implements ``EngineCore`` (``engine/core.py``), as the tensor-parallel engine and the
disaggregated router do; ``detach`` / ``attach`` move a running request between engines
(``disagg/migrate.py``).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import torch

from flash_dllm.cache.io.kv_overflow import overflow_unsupported
from flash_dllm.cache.evidence import BlockMass
from flash_dllm.cache.kv_manager import KVCacheManager
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.counters import merge_counters, new_counters
from flash_dllm.core.plan import StepPlan, StepResult
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.core.stats import EngineStats
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.engine.core import (RequestLimits, check_request, prefix_reuse, request_output,
                                   resolve_params)
from flash_dllm.engine import multi_step
from flash_dllm.engine.block_summary import summarize
from flash_dllm.engine.scheduler import Scheduler
from flash_dllm.engine.stats import engine_stats
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.transformer import DiffusionTransformer
from flash_dllm.worker.extensions import EXTENSIONS, has_hook
from flash_dllm.worker.runner import ModelRunner
from flash_dllm.worker.state import SeqState

log = logging.getLogger(__name__)

# failed steps in a row after which a step's exception is raised again (a broken device, not one
# bad batch): see ``Engine.isolate_step_failures``
MAX_FAILED_STEPS = 3


class Engine:
    """The single-device ``EngineCore`` (``engine/core.py``)."""

    idle_poll_s: float | None = None        # nothing to watch while idle

    def __init__(self, model: DiffusionTransformer, cfg: ModelConfig,
                 config: EngineConfig | None = None) -> None:
        if cfg.mask_token_id is None:
            raise ValueError("the model config has no mask_token_id")
        why = cfg.paged_unsupported()       # before the runner sizes and allocates its KV pool
        if why is not None:
            raise ValueError(why)
        self.model = model
        self.cfg = cfg
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, cfg, self.config)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        off = self.runner.offload
        self.prefix_reuse = prefix_reuse(self.config, cfg, self.device)
        self.kv_manager = KVCacheManager(
            self.runner.num_pages, self.config.page_size,
            prefix_reuse=self.prefix_reuse, namespace=self.runner.compat,
            tier_slots=off.tier_slots if off is not None else (),
            placement=self.config.kv_placement or "lru", placement_top_k=self.config.kag_top_k,
            page_bytes=off.layout.nbytes if off is not None else self.runner.page_bytes)
        self.scheduler = Scheduler(self.config.max_num_seqs, self.kv_manager, cfg.logit_shift,
                                   prefetch=self.config.kv_prefetch)
        # what ``validate`` checks a request against (immutable: any thread may read it)
        self.limits = RequestLimits(cfg.max_position, cfg.vocab_size, self.kv_manager.page_size,
                                    self.kv_manager.num_pages, cfg.attention.block_size)
        # placement by attention (kv_placement ema / kag): the runner reports each flash step's
        # mass per page; it is summed over a request's block and handed over when the block ends
        self.runner.collect_page_mass = self.kv_manager.wants_mass
        self.block_mass = BlockMass(self.kv_manager, self.config.kag_update_steps)
        self._ids = itertools.count()
        # steps that ran a batch, never reset (unlike ``stats``, which the warm-up puts back):
        # the replicas' shared clock under tensor parallelism (``tp_engine.make_deterministic``)
        self.steps_run = 0
        self._stop_ids = tuple(int(t) for t in cfg.eos_token_ids)
        self.stats = {"forwards": 0, "tokens_committed": 0, "step_seconds": 0.0,
                      "last_batch_size": 0,   # serving: requests in the latest forward
                      "failed_steps": 0,      # steps whose requests failed (isolated)
                      "multi_step_calls": 0,  # steps that ran more than one forward
                      **new_counters()}       # decode="verify" and sentinels
        # True (the server's single-process engine, ``AsyncEngine``): a step that raises fails
        # only the requests of its batch, with an error naming the exception, and the engine
        # goes on; False (offline ``LLM``, tensor-parallel replicas, disaggregated workers): it
        # raises, as every replica or peer must see the same failure
        self.isolate_step_failures = False
        self._failed_in_a_row = 0
        self.multi_step = multi_step.steps_per_call(self.config, self.runner)
        self.multi_step_seconds = multi_step.CALL_SECONDS
        self.recent_steps: deque[float] = deque(maxlen=multi_step.RECENT_STEPS)

    @property
    def pool(self):
        """The KV page ledger (``cache.page_pool.PagePool``)."""
        return self.kv_manager.pool

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ----------------------------------------------------------------------------------- requests
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request can never run. Reads only
        immutable configuration (the async engine calls it from the event loop)."""
        check_request(prompt_ids, resolve_params(params, self.cfg), self.limits,
                      self._overflow_refusal)

    def _overflow_refusal(self, total: int, params: SamplingParams) -> str | None:
        """Why a request larger than the pool cannot stream its overflow (None: it can)."""
        why = overflow_unsupported(params)
        ov = self.runner.overflow
        if ov is None:
            return ("--kv-overflow-gb > 0 would stream the rest from host memory"
                    if why is None else "send a shorter request")
        if why is not None:
            return f"it cannot stream from host memory with {why}"
        n = self.kv_manager.pages_for(total)
        need = ov.host_bytes_for(n - self.kv_manager.num_pages)
        if need > ov.host_bytes:
            return (f"streaming the rest needs {need / 2**30:.2f} GiB of host memory, more than "
                    f"--kv-overflow-gb ({ov.host_bytes / 2**30:.2f} GiB)")
        return None

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        params = resolve_params(params, self.cfg)
        self.validate(prompt_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, prompt_ids, params, self.cfg.mask_token_id, self.cfg.eos_token_ids,
                      prompt, grid=self.cfg.attention.block_size,
                      edits=DECODE_POLICIES[params.decode].edits)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.abort()
        self._release(req)    # serving: an aborted request frees its pages at once (unpublished)
        # ... and is gone from ``running`` (and ``waiting``) now: an engine whose requests were
        # all aborted is idle at once (the async engine's stats snapshot then shows the pages
        # freed before the aborted outputs reach their clients), and a client that aborts
        # queued requests by the thousand leaves no request objects behind in the queue
        self.scheduler.drop_finished()
        self.scheduler.drop_waiting(req)
        return True

    def graphs_ready(self) -> None:
        """A warm-up made the engine ready: from now on no CUDA graph is captured (a shape
        without one runs eagerly)."""
        self.runner.graph_cache.ready = True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests."""
        return len(self.scheduler.running), self.scheduler.num_waiting

    def stats_snapshot(self) -> EngineStats:
        """The engine's counters and gauges now, immutable (``engine/stats.py``)."""
        return engine_stats(self)

    def close(self) -> None:
        """Nothing beyond memory to release (``EngineCore``)."""

    # -------------------------------------------------------------------------------- migration
    def device_state(self, request_id: str) -> SeqState | None:
        """The runner's device state of a request that ran a step, else None."""
        # (read as it is: ``ModelRunner.seq`` would reset a finished block's state)
        return self.runner.state(request_id)

    def detach(self, request_id: str) -> Request | None:
        """Take a running request out without finishing it (prefill/decode migration): its
        pages and device state are freed, never published, its placement evidence dropped.
        Read what must travel (``device_state``, its pages) first. None: unknown id."""
        req = self.scheduler.find(request_id)
        if req is None:
            return None
        self.scheduler.remove(req)
        self.block_mass.forget(request_id)
        self.kv_manager.free(request_id, None)
        self.runner.release(request_id)
        return req

    def attach(self, req: Request, pages: list[int], restore=None) -> None:
        """Put ``req``, a request moved here between steps with its ``pages`` reserved and
        filled, in the running batch; ``restore(state)`` first fills its new device state
        (``SeqState``; if it raises, the state is dropped and ``req`` stays out). The caller
        checks that a running slot is free."""
        st = self.runner.seq(req, pages)
        if restore is not None:
            try:
                restore(st)
            except BaseException:
                self.runner.release(req.request_id)
                raise
        self.scheduler.running.append(req)
        self.scheduler.invalidate()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """Run one denoising forward for every running request; what it did to each of them."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.seqs and not plan.ops:
            return []
        try:
            outputs = multi_step.run(self, plan, t0)    # several fused steps (None: this one)
            result = self.runner.execute(plan) if outputs is None else None
        except Exception as e:   # noqa: BLE001 - isolated below, or raised again
            return self._step_failed(plan, e)
        self._failed_in_a_row = 0
        return outputs if outputs is not None else self._apply(plan, result, t0)

    def _step_failed(self, plan: StepPlan, exc: Exception) -> list[StepOutput]:
        """A step raised. With ``isolate_step_failures`` its requests finish with an error that
        names the exception, their pages are freed and never published for prefix reuse (their
        K/V may be half written), and the other requests go on. Raised again without it, when
        the step also moved pages between tiers (their state is not known), or at the
        ``MAX_FAILED_STEPS``-th failed step in a row. Never isolated either: with host KV tiers
        (the step may have collected finished tier moves that the failure dropped), or when the
        device may be broken (``_device_healthy``)."""
        self._failed_in_a_row += 1
        if (not self.isolate_step_failures or plan.ops or not plan.requests
                or self.runner.offload is not None        # (tier moves finished in the step)
                or self._failed_in_a_row >= MAX_FAILED_STEPS or not self._device_healthy()):
            raise exc
        log.exception("engine step failed; failing its %d request(s): %s",
                      len(plan.requests), ", ".join(r.request_id for r in plan.requests))
        self.stats["failed_steps"] += 1
        outputs = [self._fail(req, f"the engine step failed: {exc!r}") for req in plan.requests
                   if not req.finished]     # (a multi-step call may have finished some)
        self.scheduler.drop_finished()
        return outputs

    def _fail(self, req: Request, why: str) -> StepOutput:
        """Finish ``req`` with an error naming ``why``; its pages go back, unpublished."""
        req._finish("error")
        req.error = f"request {req.request_id}: {why}"
        self._release(req)
        return StepOutput(req.request_id, [], req.num_tokens, 0, True, "error")

    def _device_healthy(self) -> bool:
        """False when a failed step may have broken the device: a CUDA graph capture left open,
        or a sticky CUDA error (the next synchronize raises it)."""
        if self.device.type != "cuda":
            return True
        try:
            if torch.cuda.is_current_stream_capturing():
                return False
            torch.cuda.synchronize(self.device)
        except Exception:   # noqa: BLE001 - any error here means: do not go on
            return False
        return True

    def _apply(self, plan: StepPlan, result: StepResult, t0: float) -> list[StepOutput]:
        """Book-keeping after a step, on the host: requests advance, finish and free pages."""
        prefill_rows = self._prefill_rows(plan)
        self.kv_manager.ops_done(result.ops_done)
        reqs = plan.requests
        if result.failed:        # a reused page failed verification: admit it again, recompute
            for req in reqs:
                if req.request_id in result.failed:
                    self.kv_manager.load_failed(req.request_id)
                    self.runner.release(req.request_id)
                    self.scheduler.requeue(req)
            reqs = [r for r in reqs if r.request_id not in result.failed]
        failed_outputs = []
        if result.errors:        # e.g. no pinned memory for a request larger than the pool
            for req in reqs:
                why = result.errors.get(req.request_id)
                if why is not None:
                    failed_outputs.append(self._fail(req, why))
            reqs = [r for r in reqs if r.request_id not in result.errors]
            self.scheduler.drop_finished()
        # the whole batch at once: MASK left, stop ids, first MASK-or-stop slot per block
        masked, stops, first_end, first_slot = summarize(
            result.blocks, [r.params.block_length for r in reqs], [r.lead for r in reqs],
            self.cfg.mask_token_id, self._stop_ids)
        blocks = result.blocks                                      # [B, max_bl]
        outputs = failed_outputs
        committed = 0
        changed = False                # a new block, refresh state or finish: a new plan
        width = {id(s.req): s.window[1] - s.window[0] for s in plan.seqs}
        # the step extensions' results, applied to each request (``worker/extensions``)
        applies = [(ext, result.extensions[ext.name]) for ext in EXTENSIONS
                   if ext.name in result.extensions and has_hook(ext, "apply")]
        for i, req in enumerate(reqs):
            req.counters["positions_computed"] += width[id(req)]   # (the window: the cache's)
            self.stats["positions_computed"] += width[id(req)]
            was_first = req.first_step or req.stale
            out = req.apply(blocks[i], masked[i], first_end[i], stops[i], first_slot[i])
            outputs.append(out)
            committed += out.num_committed
            for ext, value in applies:
                ext.apply(self, req, value)
            changed = changed or was_first or req.first_step or req.finished or req.stale
            if result.counters is not None and result.counters[i] is not None:
                merge_counters(req.counters, result.counters[i])
                merge_counters(self.stats, result.counters[i])
            if req.finished:
                self._release(req)
        if changed:
            self.scheduler.drop_finished()
        self.stats["tokens_committed"] += committed
        self.stats["forwards"] += bool(reqs)
        self.steps_run += bool(reqs)
        seconds = time.perf_counter() - t0
        self.stats["step_seconds"] += seconds
        self.recent_steps.append(seconds)         # (multi-step sizes its calls by them)
        if prefill_rows >= self.PREFILL_ROWS:
            self.kv_manager.cost.observe_prefill(prefill_rows, seconds)
        self.stats["last_batch_size"] = len(plan.seqs)
        return outputs

    # a step recomputing at least this many positions is prefill-dominated: its rate is the
    # cost model's recompute rate (``cache/tiers.CostModel``)
    PREFILL_ROWS = 256

    def _prefill_rows(self, plan: StepPlan) -> int:
        """The positions a step recomputed at its requests' block refreshes (their first
        steps), for the tiers' cost model, which weighs loading a cached prefix against
        recomputing it (``_apply`` hands it the rows per second of steps with at least
        ``PREFILL_ROWS``). 0 for steps that loaded pages or streamed a request larger than the
        pool (their time is not recompute time), and while the batch is mostly decode rows."""
        if plan.ops or not plan.seqs:
            return 0
        refresh = total = 0                  # (one pass: this runs on every step's host path)
        for s in plan.seqs:
            if s.overflow is not None:
                return 0
            n = s.window[1] - s.window[0]
            total += n
            if s.req.first_step:
                refresh += n
        return refresh if refresh and 2 * refresh >= total else 0

    def _release(self, req: Request) -> None:
        """Return a finished or aborted request's pages and device state. A request that
        finished (not aborted, not failed) publishes its pages for prefix reuse: the prompt and
        every block before the last one decoded (their K/V were refreshed with their final
        tokens; the last block's K/V were computed while it was still being unmasked)."""
        self.block_mass.forget(req.request_id)
        publish = None
        if (self.prefix_reuse and req.finish_reason not in ("abort", "error")
                and CACHE_MODES[req.params.cache].reusable and req.overflow is None):
            n = req.origin + max(req.block - 1, 0) * req.params.block_length
            publish = req.tokens[:n].tolist()
        self.kv_manager.free(req.request_id, publish)
        self.runner.release(req.request_id)

    # ------------------------------------------------------------------------------------ outputs
    def output(self, req: Request) -> RequestOutput:
        """The request's result so far, from host state (no device access, no detokenising)."""
        return request_output(req)


def run_to_completion(engine: Engine, requests: list[Request], on_finish=None,
                      on_step=None) -> None:
    """Step ``engine`` until every request of ``requests`` finished (``on_finish(request_id)``
    after each; ``on_step(outputs)`` after every step); other requests in the engine run
    along."""
    pending = {r.request_id for r in requests if not r.finished}
    with torch.inference_mode():
        while pending and engine.has_unfinished():
            outs = engine.step()
            if on_step is not None:
                on_step(outs)
            for out in outs:
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    if on_finish is not None:
                        on_finish(out.request_id)
