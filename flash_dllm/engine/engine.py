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

Requests at different blocks, steps, cache modes and policies share the same forward.
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import torch

from flash_dllm.cache.io.kv_overflow import overflow_unsupported
from flash_dllm.cache.kv_manager import KVCacheManager
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.counters import merge_counters, new_counters
from flash_dllm.core.plan import StepPlan, StepResult
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.engine.scheduler import Scheduler
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.transformer import DiffusionTransformer
from flash_dllm.worker.runner import ModelRunner

log = logging.getLogger(__name__)

# failed steps in a row after which a step's exception is raised again (a broken device, not one
# bad batch): see ``Engine.isolate_step_failures``
MAX_FAILED_STEPS = 3


class Engine:
    def __init__(self, model: DiffusionTransformer, cfg: ModelConfig,
                 config: EngineConfig | None = None) -> None:
        if cfg.mask_token_id is None:
            raise ValueError("the model config has no mask_token_id")
        self.model = model
        self.cfg = cfg
        self.config = config or EngineConfig()
        self.runner = ModelRunner(model, cfg, self.config)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        off = self.runner.offload
        self.kv_manager = KVCacheManager(
            self.runner.num_pages, self.config.page_size,
            prefix_reuse=self.config.prefix_reuse, namespace=self.runner.compat,
            tier_slots=off.tier_slots if off is not None else (),
            placement=self.config.kv_placement or "lru", placement_top_k=self.config.kag_top_k,
            page_bytes=off.layout.nbytes if off is not None else self.runner.page_bytes)
        self.scheduler = Scheduler(self.config.max_num_seqs, self.kv_manager, cfg.logit_shift,
                                   prefetch=self.config.kv_prefetch)
        # placement by attention (kv_placement ema / kag): the runner reports each flash step's
        # mass per page; it is summed over a request's block and handed over when the block ends
        self.runner.collect_page_mass = self.kv_manager.wants_mass
        self._block_mass: dict[str, np.ndarray] = {}
        self._mass_steps: dict[str, int] = {}        # steps summed per request (every-N-steps)
        self._kag_every = self.config.kag_update_steps
        self._ids = itertools.count()
        # steps that ran a batch, never reset (unlike ``stats``, which the warm-up puts back):
        # the replicas' shared clock under tensor parallelism (``tp_engine.make_deterministic``)
        self.steps_run = 0
        self._stop_ids = tuple(int(t) for t in cfg.eos_token_ids)
        self.stats = {"forwards": 0, "tokens_committed": 0, "step_seconds": 0.0,
                      "last_batch_size": 0,   # serving: requests in the latest forward
                      "failed_steps": 0,      # steps whose requests failed (isolated)
                      **new_counters()}       # decode="verify" and sentinels
        # True (the server's single-process engine, ``AsyncEngine``): a step that raises fails
        # only the requests of its batch, with an error naming the exception, and the engine
        # goes on; False (offline ``LLM``, tensor-parallel replicas, disaggregated workers): it
        # raises, as every replica or peer must see the same failure
        self.isolate_step_failures = False
        self._failed_in_a_row = 0

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
        if not prompt_ids:
            raise ValueError("prompt is empty: it must hold at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_position:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"= {total} exceeds the model's maximum length {self.cfg.max_position}")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids outside the vocabulary [0, {self.cfg.vocab_size}): "
                             f"{bad[:5]}")
        # serving: a request bigger than the whole (empty) page pool would wait forever, unless
        # it may stream its overflow from host memory (``cache/io/kv_overflow.py``)
        if not self.kv_manager.can_ever_fit(total):
            why = Engine._overflow_refusal(self, total, params)
            if why is not None:
                raise ValueError(f"prompt + max_tokens = {total} tokens needs "
                                 f"{self.kv_manager.pages_for(total)} KV pages of "
                                 f"{self.kv_manager.page_size} tokens, but the pool has only "
                                 f"{self.kv_manager.num_pages}; {why}")

    def _overflow_refusal(self, total: int, params: SamplingParams) -> str | None:
        """Why a request larger than the pool cannot stream its overflow (None: it can)."""
        runner = getattr(self, "runner", None)       # (a PDEngine validates through here too)
        if runner is None:
            return "requests larger than the pool are not supported with --disaggregate"
        why = overflow_unsupported(params)
        ov = runner.overflow
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
        self.validate(prompt_ids, params)
        rid = request_id if request_id is not None else str(next(self._ids))
        req = Request(rid, prompt_ids, params, self.cfg.mask_token_id, self.cfg.eos_token_ids,
                      prompt)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.abort()
        self._release(req)    # serving: an aborted request frees its pages at once (unpublished)
        self.scheduler.invalidate()
        return True

    def graphs_ready(self) -> None:
        """A warm-up made the engine ready: from now on no CUDA graph is captured (a shape
        without one runs eagerly)."""
        self.runner.graph_cache.ready = True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        """Run one denoising forward for every running request; what it did to each of them."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if not plan.seqs and not plan.ops:
            return []
        try:
            result = self.runner.execute(plan)
        except Exception as e:   # noqa: BLE001 - isolated below, or raised again
            return self._step_failed(plan, e)
        self._failed_in_a_row = 0
        return self._apply(plan, result, t0)

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
        outputs = [self._fail(req, f"the engine step failed: {exc!r}") for req in plan.requests]
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
        blocks = result.blocks                                      # [B, max_bl]
        # the whole batch at once: MASK left, first MASK-or-stop slot, stop ids per block
        is_mask = blocks == self.cfg.mask_token_id
        is_stop = np.zeros_like(is_mask)
        for sid in self._stop_ids:                                  # a few ids: faster than isin
            is_stop |= blocks == sid
        lens = np.array([r.params.block_length for r in reqs])
        if (lens != blocks.shape[1]).any():                         # padding columns
            pad = np.arange(blocks.shape[1])[None, :] >= lens[:, None]
            is_mask &= ~pad
            is_stop &= ~pad
            ends = is_mask | is_stop | pad
        else:
            ends = is_mask | is_stop
        masked, stops = is_mask.sum(1).tolist(), is_stop.any(1).tolist()
        first_end = np.where(ends.any(1), ends.argmax(1), lens).tolist()
        first_slot = (~is_mask[:, 0]).tolist()
        outputs = failed_outputs
        committed = 0
        changed = False                # a new block, refresh state or finish: a new plan
        width = {id(s.req): s.window[1] - s.window[0] for s in plan.seqs}
        for i, req in enumerate(reqs):
            req.counters["positions_computed"] += width[id(req)]   # (the window: the cache's)
            self.stats["positions_computed"] += width[id(req)]
            was_first = req.first_step or req.stale
            out = req.apply(blocks[i], masked[i], first_end[i], stops[i], first_slot[i])
            outputs.append(out)
            committed += out.num_committed
            if req.request_id in result.drifted and not req.finished:
                req.stale = True       # the drift trigger: the next step refreshes the cache
            changed = changed or was_first or req.first_step or req.finished or req.stale
            if result.counters is not None and result.counters[i] is not None:
                merge_counters(req.counters, result.counters[i])
                merge_counters(self.stats, result.counters[i])
            if result.page_mass is not None:
                self._add_block_mass(req, result.page_mass.get(req.request_id))
            if req.finished:
                self._release(req)
        if changed:
            self.scheduler.drop_finished()
        self.stats["tokens_committed"] += committed
        self.stats["forwards"] += bool(reqs)
        self.steps_run += bool(reqs)
        seconds = time.perf_counter() - t0
        self.stats["step_seconds"] += seconds
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
        if plan.ops or not plan.seqs or any(s.overflow is not None for s in plan.seqs):
            return 0
        rows = [s.window[1] - s.window[0] for s in plan.seqs]
        refresh = sum(n for s, n in zip(plan.seqs, rows) if s.req.first_step)
        return refresh if 2 * refresh >= sum(rows) else 0

    def _add_block_mass(self, req: Request, page_mass) -> None:
        """Sum a request's per-page attention mass over its block; at the block's end (or the
        request's) hand it to the KV manager's placement policy: once per block."""
        rid = req.request_id
        if page_mass is not None:
            acc = self._block_mass.get(rid)
            self._block_mass[rid] = page_mass if acc is None else acc + page_mass
            self._mass_steps[rid] = self._mass_steps.get(rid, 0) + 1
        due = req.first_step or req.finished or (
            self._kag_every is not None and self._mass_steps.get(rid, 0) >= self._kag_every)
        if due and rid in self._block_mass:
            self._mass_steps.pop(rid, None)
            self.kv_manager.observe(rid, self._block_mass.pop(rid))

    def _release(self, req: Request) -> None:
        """Return a finished or aborted request's pages and device state. A request that
        finished (not aborted, not failed) publishes its pages for prefix reuse: the prompt and
        every block before the last one decoded (their K/V were refreshed with their final
        tokens; the last block's K/V were computed while it was still being unmasked)."""
        self._block_mass.pop(req.request_id, None)
        self._mass_steps.pop(req.request_id, None)
        publish = None
        if (self.config.prefix_reuse and req.finish_reason not in ("abort", "error")
                and req.params.cache != "none" and req.overflow is None):
            n = req.prompt_len + max(req.block - 1, 0) * req.params.block_length
            publish = req.tokens[:n].tolist()
        self.kv_manager.free(req.request_id, publish)
        self.runner.release(req.request_id)

    # ------------------------------------------------------------------------------------ outputs
    def output(self, req: Request) -> RequestOutput:
        """The request's result so far, from host state (no device access, no detokenising)."""
        committed = int((req.tokens[req.prompt_len:] != self.cfg.mask_token_id).sum())
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "committed_slots": committed,
                   "block_forwards": req.block_forwards,     # a tuple: shared, not copied
                   **_copy_counters(req.counters)}
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_ids, text=None,
                             token_ids=req.generated_ids(), num_forwards=req.num_forwards,
                             finish_reason=req.finish_reason, finished=req.finished,
                             early_stopped=req.early_stopped, metrics=metrics,
                             error=req.error)


def _copy_counters(counters: dict) -> dict:
    """A copy of a ``new_counters`` dict (flat, or one level of dicts): an output is built per
    request per step while serving, where ``copy.deepcopy`` was a visible share of the step."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in counters.items()}


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
