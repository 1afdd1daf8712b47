"""``EngineCore``: what every engine kind implements, and the request logic they share.

Three engines stand behind the server's ``AsyncEngine``: ``Engine`` (one device),
``TPEngine`` (rank 0 of a tensor-parallel group, an ``Engine`` that tells the other ranks what it
did) and ``PDEngine`` (the disaggregated router, which runs no model: its requests run in worker
processes). ``AsyncEngine`` uses only the calls below, so a new engine kind implements them and
nothing else changes.

NOTE (threads): ``validate`` may be called from any thread (the event loop calls it before
queueing a request): it reads only immutable data (``cfg``, ``config``, a ``RequestLimits``
swapped whole). ``cfg`` and ``config`` are immutable. Every other call belongs to the engine
thread.

The shared logic is plain functions both kinds call: ``check_request`` (a request against a
``RequestLimits``) and ``request_output`` (a request's ``RequestOutput`` from host data).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Protocol, runtime_checkable

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import Request, RequestOutput, StepOutput
from flash_dllm.core.stats import EngineStats
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.registry import default_cache
from flash_dllm.worker.extensions import EXTENSIONS

log = logging.getLogger(__name__)


@runtime_checkable
class EngineCore(Protocol):
    """The engine contract (see the module docstring). ``config.max_num_seqs`` (running slots)
    and ``config.max_waiting`` (the admission queue's limit) are what ``AsyncEngine`` reads of
    the configuration. ``idle_poll_s``: while nothing is queued or running, the async engine
    asks ``has_unfinished`` again this often (None: only when work comes), so an engine that
    watches something beside its requests (the disaggregated router: its worker processes)
    notices a change while idle."""

    cfg: ModelConfig
    config: EngineConfig
    idle_poll_s: float | None
    steps_run: int       # forwards run so far (one ``step`` may run several: multi-step)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the problem if the request can never run (any thread)."""

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None) -> Request:
        """Queue a request (validated again here); its host ``Request``."""

    def abort(self, request_id: str) -> bool:
        """Abort a request and free what it holds; False for an unknown or finished id."""

    def step(self) -> list[StepOutput]:
        """Advance the running requests by one step (one forward, or several steady ones:
        ``engine/multi_step.py``); what it did to each, one output per request."""

    def has_unfinished(self) -> bool:
        """Whether ``step`` has work: requests in flight (or resources still settling)."""

    def output(self, req: Request) -> RequestOutput:
        """``req``'s result so far, from host data."""

    def counts(self) -> tuple[int, int]:
        """(running, waiting): requests in the running batch and queued for admission. Cheap:
        the async engine reads it after every step for its admission accounting."""

    def stats_snapshot(self) -> EngineStats:
        """An immutable snapshot of the engine's counters and gauges (may scan the page
        ledger: the async engine builds one at most every ``STATS_INTERVAL_S`` while busy)."""

    def close(self) -> None:
        """Release what the engine holds beyond memory (other ranks, worker processes)."""


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the model's length and vocabulary, and the KV pool
    one request must fit in (``num_pages`` 0: not known yet, no check)."""

    max_position: int
    vocab_size: int
    page_size: int
    num_pages: int
    # a block-causal model's block size (``core/request.Request``'s grid), 0 otherwise
    grid: int = 0

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def canvas_len(self, prompt_len: int, params: SamplingParams) -> int:
        """The canvas a request of ``params`` gets (on a grid: to the end of the block holding
        its last answer slot)."""
        total = prompt_len + params.max_tokens
        return -(-total // self.grid) * self.grid if self.grid else total


def resolve_params(params: SamplingParams, cfg: ModelConfig) -> SamplingParams:
    """``params`` with what it left to the model filled in: ``cache`` None becomes the model
    family's ``default_cache`` (dual for LLaDA / Dream, block for block-causal families).
    The same object when nothing is left (every engine kind calls this before it validates)."""
    if params.cache is not None:
        return params
    return dataclasses.replace(params, cache=default_cache(cfg))


def check_request(prompt_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  overflow_refusal: Callable[[int, SamplingParams], str | None]) -> None:
    """Raise ``ValueError`` naming the problem if the request can never run under ``limits``.
    ``params`` is resolved (``resolve_params``). ``overflow_refusal(total, params)``: why a
    request larger than the pool cannot stream its overflow (None: it can, so it is
    accepted)."""
    if params.cache is None:
        raise ValueError("cache is None: resolve the request against the model first "
                         "(engine.core.resolve_params)")
    if not prompt_ids:
        raise ValueError("prompt is empty: it must hold at least one token")
    if limits.grid:
        check_block_causal(params, limits.grid)
    elif CACHE_MODES[params.cache].needs_block_causal:
        raise ValueError(f"cache={params.cache!r} needs a block-causal model (its cache is exact "
                         "only when no position sees a later block); this model attends "
                         "bidirectionally")
    total = limits.canvas_len(len(prompt_ids), params)
    if total > limits.max_position:
        grid = f" on the model's {limits.grid}-position blocks" if limits.grid else ""
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens})"
                         f"{grid} = {total} exceeds the model's maximum length "
                         f"{limits.max_position}")
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids outside the vocabulary [0, {limits.vocab_size}): "
                         f"{bad[:5]}")
    # serving: a request bigger than the whole (empty) page pool would wait forever, unless
    # it may stream its overflow from host memory (``cache/io/kv_overflow.py``)
    need = limits.pages_for(total)
    if limits.num_pages and need > limits.num_pages:
        why = overflow_refusal(total, params)
        if why is not None:
            raise ValueError(f"prompt + max_tokens = {total} tokens needs {need} KV pages of "
                             f"{limits.page_size} tokens, but the pool has only "
                             f"{limits.num_pages}; {why}")


def check_block_causal(params: SamplingParams, block_size: int) -> None:
    """A block-causal model decodes its own blocks, on contiguous query windows (the paged
    attention splits a request's rows at block bounds); refuse what needs anything else, naming
    it: another block length, a cache mode with scattered extra positions or one that needs
    bidirectional attention, a policy that adds query rows, a step extension that adds
    positions or reads attention statistics."""
    if params.block_length != block_size:
        raise ValueError(f"block_length must be {block_size} for this model (it attends in "
                         f"blocks of {block_size} positions), got {params.block_length}")
    mode = CACHE_MODES[params.cache]
    if not mode.block_causal_ok:
        raise ValueError(f"cache={params.cache!r} does not run on a block-causal model; "
                         f"use one of {[m for m in CACHE_MODES if CACHE_MODES[m].block_causal_ok]}")
    if DECODE_POLICIES[params.decode].adds_rows:
        raise ValueError(f"decode={params.decode!r} does not run on a block-causal model (its "
                         "verification rows are not block-causal yet)")
    probe = SimpleNamespace(params=params, overflow=None)
    for ext in EXTENSIONS:
        if not ext.block_causal_ok and ext.active(probe):
            raise ValueError(f"the {ext.name} step extension does not run on a block-causal "
                             "model (it reads or adds positions outside the block's rows)")


def runs_on(cfg: ModelConfig, cache: str, decode: str) -> bool:
    """Whether requests of this cache mode and decode policy can run on the model at all (what
    ``check_request`` would refuse for any prompt), e.g. to build an evaluation matrix."""
    if cfg.attention.block_causal:
        return CACHE_MODES[cache].block_causal_ok and not DECODE_POLICIES[decode].adds_rows
    return not CACHE_MODES[cache].needs_block_causal


def request_output(req: Request) -> RequestOutput:
    """The request's result so far, from host state (no device access, no detokenising)."""
    committed = int((req.tokens[req.prompt_len:] != req.mask_id).sum())
    metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
               "finish_time": req.finish_time, "committed_slots": committed,
               "block_forwards": req.block_forwards,     # a tuple: shared, not copied
               **_copy_counters(req.counters)}
    return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                         prompt_token_ids=req.prompt_ids, text=None,
                         token_ids=req.generated_ids(), num_forwards=req.num_forwards,
                         finish_reason=req.finish_reason, finished=req.finished,
                         early_stopped=req.early_stopped, metrics=metrics, error=req.error,
                         provisional_token_ids=req.provisional_ids())


def _copy_counters(counters: dict) -> dict:
    """A copy of a ``new_counters`` dict (flat, or one level of dicts): an output is built per
    request per step while serving, where ``copy.deepcopy`` was a visible share of the step."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in counters.items()}


def prefix_reuse(config, cfg, device) -> bool:
    """Whether an engine of ``config`` over a model of ``cfg`` on ``device`` reuses K/V across
    requests: ``config.prefix_reuse``, unless ``config.deterministic``.

    NOTE (deterministic): a bidirectional family's reused K/V were computed with another
    request's suffix, so its answer would depend on what is cached. A block-causal family's
    reuse (whole blocks: the scheduler's ``align``) is exact in exact arithmetic but not bitwise:
    measured on a tiny LLaDA2, 3 of 6 answers changed with the cache state (the cached block's
    K/V came from a forward over another key range). Until the attention over a reused range is
    bitwise that of a recompute, no family reuses under ``deterministic``."""
    reuse = config.prefix_reuse and not config.deterministic
    if config.deterministic and device.type != "cpu":
        log.warning("deterministic on %s: no cross-request prefix reuse; fixed-tile GEMMs and "
                    "batch-invariant kernel launches (an H100's LLaDA-8B step: 1.5x at batch 1, "
                    "4.3x at batch 64; docs/serving.md)", device)
    if config.prefix_reuse and not reuse:
        log.info("deterministic: prefix reuse off (%s attention: reused K/V are approximate)",
                 cfg.attention)
    return reuse
