"""Warm-up before a server reports ready: compile the kernels and capture the CUDA graphs that
serving will use, while no request waits (issue 21).

The first step of a new shape costs far more than the next ones: Triton compiles (or loads from
its on-disk cache) every new specialisation of a kernel, and the runner captures a CUDA graph for
a shape that comes back (``worker/graphs.py``). Done under load, that is seconds of stall while
requests wait. ``warm_up`` runs synthetic batches through the engine instead: for each case
(sampling parameters x prompt length) and each batch size of ``batch_sizes``, it queues that many
identical requests, runs a few steps (enough for every shape of the case to be captured: a shape
is captured at its second sighting, a large one at its third) and aborts them. The engine's
counters are left as they were.

Levels (``--warmup``):

- ``full``: the server's default request (threshold with the family's fast cache unless the
  server's flags say otherwise) and the other paths clients ask for, on the family's fast cache
  (threshold, block 32; on a bidirectional family also ``decode="verify"`` at its default
  gamma and max_verify, which block-causal models do not run), each at two short prompts (an
  even and an odd canvas) and a long one, at every power-of-two batch size up to
  ``max_num_seqs`` (and ``max_num_seqs``);
- ``minimal``: the default request at the two short prompts, batch 1 and ``max_num_seqs``;
- ``none``: nothing (the CPU default: no Triton compiles, no graphs, nothing to warm).

Then (``full`` and ``minimal``, one device) the forward graphs of the padded buckets serving
reaches (``worker/graphs.py``: rows, requests and query length rounded up to powers of two) are
captured from steps of dummy rows (``graph_grid``): the request cases above reach only some of
them. After the warm-up nothing is captured any more (``Engine.graphs_ready``): a step outside
every bucket runs eagerly.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from flash_dllm.config import SamplingParams
from flash_dllm.cache.modes import fast_default
from flash_dllm.decoding.registry import DECODE_POLICIES
from flash_dllm.models.registry import default_cache
from flash_dllm.kernels._triton import next_pow2
from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.worker.compile_watch import KERNEL_COMPILES, graph_counts
from flash_dllm.worker.graphs import MIN_ROWS, PaddedShape

@dataclass(frozen=True)
class WarmupLevel:
    """What a warm-up level runs: its request cases' prompt lengths (none: no warm-up at all,
    the server is ready at once), every power-of-2 batch up to ``max_num_seqs`` or only 1 and
    it, and the fast decode policies' cases beside the default request."""
    prompt_lengths: tuple[int, ...]
    every_batch: bool
    fast_cases: bool

    @property
    def runs(self) -> bool:
        return bool(self.prompt_lengths)


# NOTE: 24 and 25 make canvases of even and odd length (88 and 89 with 64 tokens): the split-KV
# path's buffer strides (tokens x heads) then fall in both of Triton's divisibility classes.
# In serve_warmup_h200.json (warm-up with 24 and 200 only) the first real request still compiled
# one paged-attention and one merge variant; an odd token count is the suspected missing class
# (not yet checked on the GPU).
LEVELS = {"full": WarmupLevel((24, 25, 200), every_batch=True, fast_cases=True),
          "minimal": WarmupLevel((24, 25), every_batch=False, fast_cases=False),
          "none": WarmupLevel((), every_batch=False, fast_cases=False)}
WARMUP_LEVELS = tuple(LEVELS)


def level_of(name: str) -> WarmupLevel:
    """The level ``name``, or a ValueError naming the choices."""
    if name not in LEVELS:
        raise ValueError(f"warmup must be one of {WARMUP_LEVELS}, got {name!r}")
    return LEVELS[name]


STEPS_PER_CASE = 6          # dual: a refresh, then decode steps (captured at their 2nd sighting)


@dataclass
class WarmupReport:
    level: str
    seconds: float = 0.0
    cases: int = 0
    steps: int = 0
    kernel_compiles: int = 0
    graph_captures: int = 0
    skipped: list[str] = field(default_factory=list)    # cases that could not run, and why


def default_level(device) -> str:
    """``full`` on a GPU, ``none`` on the CPU (nothing compiles or captures there)."""
    return "none" if str(device).startswith("cpu") else "full"


def batch_sizes(level: str, max_num_seqs: int) -> list[int]:
    if not level_of(level).every_batch:
        return sorted({1, max_num_seqs})
    sizes, b = set(), 1
    while b < max_num_seqs:
        sizes.add(b)
        b *= 2
    sizes.add(max_num_seqs)
    return sorted(sizes)


# query-length buckets of the graph grid: a decode step of a 32-token block (dual cache), and
# whole canvases of up to 128 and 256 positions (the default request, no cache: a prompt + 64
# tokens; the demo's character tokenizer makes an arith question 67-89 tokens)
GRID_MAX_Q = (32, 128, 256)


def graph_grid(engine, level: str) -> list[PaddedShape]:
    """The padded forward shapes the warm-up captures with dummy rows: for every request bucket
    of ``batch_sizes`` and query bucket of ``GRID_MAX_Q``, every row bucket such a step can
    round up to (rows >= requests and > half the query bucket, <= requests x query bucket,
    launch-bound: below ``GraphCache.heavy_tokens``, at most ``cuda_graph_max_tokens``).
    Empty without forward graphs and under tensor parallelism (every rank would have to
    capture in step: the request cases still warm it)."""
    runner = engine.runner
    fg = getattr(runner, "forward_graphs", None)
    if not level_of(level).runs or fg is None or fg.scratch_page is None \
            or runner.tp is not None:
        return []
    heavy = runner.graph_cache.heavy_tokens
    max_k = seqlen_bound(min(engine.cfg.max_position, 256))
    out = []
    for b in sorted({next_pow2(n) for n in batch_sizes(level, engine.config.max_num_seqs)}):
        for q in GRID_MAX_Q:
            t = next_pow2(max(MIN_ROWS, q // 2 + 1, b // 2 + 1))
            while t <= min(next_pow2(b * q), fg.max_tokens) and t // 2 < heavy:
                out.append(PaddedShape(t, b, q, max_k))
                t *= 2
    return out


def cases(level: str, cfg=None, default: SamplingParams | None = None) -> list[SamplingParams]:
    """The requests a warm-up of ``level`` runs: ``default`` (what a bare request gets: the
    server's sampling defaults; ``SamplingParams()`` when None), then, for ``full``, threshold
    and verify on the family's fast cache (the policies with ``warm_up``; one that adds query
    rows only on bidirectional models: block-causal ones refuse those). With the model's
    ``cfg``, a cache left None is the family's default cache, and a case equal to an earlier one
    is dropped; without it, the fast cases run on the bidirectional default
    (``cache.modes.fast_default``)."""
    default = SamplingParams() if default is None else default
    out = [default]
    if level_of(level).fast_cases:
        # each at its default knobs (Flash-Verify's fused-step graphs are keyed by the batch's
        # padded draft count: max_verify, the block length by default)
        block_causal = cfg is not None and cfg.attention.block_causal
        out += [SamplingParams(max_tokens=64, block_length=32, decode=name,
                               cache=None if cfg is not None else fast_default(False))
                for name in DECODE_POLICIES if DECODE_POLICIES[name].warm_up
                and not (block_causal and DECODE_POLICIES[name].adds_rows)]
    if cfg is not None:
        out = [p if p.cache is not None else dataclasses.replace(p, cache=default_cache(cfg))
               for p in out]
    return [p for i, p in enumerate(out) if p not in out[:i]]


def filler(cfg, ids) -> list[int]:
    """The token ids of ``ids`` a warm-up prompt may use: not MASK, not an end-of-answer id,
    inside the vocabulary."""
    return [t for t in ids if t != cfg.mask_token_id and t not in cfg.eos_token_ids
            and 0 <= t < cfg.vocab_size]


def warm_up(engine, level: str, filler_ids: list[int],
            log: Callable[[str], None] | None = None,
            default: SamplingParams | None = None) -> WarmupReport:
    """Run the warm-up of ``level`` on ``engine`` (which must have no requests); returns what it
    did. ``filler_ids``: prompt token ids to repeat (text of the checkpoint's own tokenizer);
    ``default``: what a request that sends no knobs gets (the server's sampling defaults)."""
    spec = level_of(level)
    rep = WarmupReport(level)
    if not spec.runs:
        return rep
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine")
    if not filler_ids:
        raise ValueError("warm_up needs some prompt token ids")
    t0 = time.perf_counter()
    compiles0 = KERNEL_COMPILES.snapshot()["compiles"]
    captures0 = graph_counts(engine.runner)["graph_captures"]
    # NOTE: prefix reuse stays as it is (under tensor parallelism every rank must make the same
    # cache decisions, and only this rank runs the warm-up's code); a warm-up request that
    # finishes leaves real KV of its own prompt in the cache, like any request. Its counters
    # are put back afterwards.
    stats = copy.deepcopy(engine.stats)
    kv_stats = copy.deepcopy(engine.kv_manager.stats)
    # (its steps compile kernels: not a recompute rate the cost model should learn)
    prefill_rate = engine.kv_manager.cost.prefill_tokens_per_s
    # a step that fails while warming up is raised, not isolated: it is the server's failure
    isolate, engine.isolate_step_failures = engine.isolate_step_failures, False
    # a long prompt is cut to what the model's length leaves (a small model still warms both)
    room = engine.cfg.max_position
    plan = [(p, n, b) for p in cases(level, engine.cfg, default)
            for n in sorted({min(n, room - p.max_tokens) for n in spec.prompt_lengths})
            for b in batch_sizes(level, engine.config.max_num_seqs)]
    try:
        for i, (params, n_prompt, batch) in enumerate(plan, 1):
            prompt = (filler_ids * (n_prompt // len(filler_ids) + 1))[:n_prompt]
            name = (f"{params.decode}/{params.cache} prompt {n_prompt} batch {batch}")
            try:
                if n_prompt < 1:
                    raise ValueError(f"max_tokens {params.max_tokens} leaves no room for a "
                                     f"prompt in the model's {room} positions")
                engine.validate(prompt, params)
            except ValueError as e:
                rep.skipped.append(f"{name}: {e}")
                continue
            ids = [engine.add_request(prompt, params, request_id=f"warmup-{i}-{k}").request_id
                   for k in range(batch)]
            for _ in range(STEPS_PER_CASE):
                if not engine.has_unfinished():
                    break
                engine.step()
                rep.steps += 1
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():            # (aborted requests left at once)
                engine.step()
            rep.cases += 1
            if log is not None:
                log(f"warm-up {i}/{len(plan)}: {name} "
                    f"({time.perf_counter() - t0:.1f} s)")
        grid = graph_grid(engine, level)
        if grid:
            n = engine.runner.warm_graphs(grid)
            if log is not None:
                log(f"warm-up: {n} forward graphs of padded shapes captured "
                    f"({len(grid) - n} already were) ({time.perf_counter() - t0:.1f} s)")
    finally:
        engine.stats.clear()
        engine.stats.update(stats)
        engine.kv_manager.stats.clear()
        engine.kv_manager.stats.update(kv_stats)
        engine.kv_manager.cost.prefill_tokens_per_s = prefill_rate
        engine.isolate_step_failures = isolate
    engine.graphs_ready()          # nothing is captured from now on
    rep.seconds = time.perf_counter() - t0
    rep.kernel_compiles = KERNEL_COMPILES.snapshot()["compiles"] - compiles0
    rep.graph_captures = graph_counts(engine.runner)["graph_captures"] - captures0
    return rep

