"""Per-request (``SamplingParams``) and engine-wide (``EngineConfig``) settings, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass, fields

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.decoding.registry import DECODE_POLICIES

# CACHE_MODES and DECODE_POLICIES are registries (``flash_dllm.registry``): iterating gives the
# names, so a mode or policy registered after import is a valid choice from then on
VERIFY_RULES = ("agree", "cumprod")      # flash_dllm.decoding.verify.accept_prefix
DEFAULT_BLOCK_LENGTH = 32


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_fraction(name: str, value, optional: bool = False) -> None:
    """``value`` in (0, 1] (a real number, not a bool); ``optional``: None is allowed too."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1]{' or None' if optional else ''}, "
                         f"got {value!r}")


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


# the largest seed a torch.Generator takes (an unsigned 64-bit integer): a larger one failed the
# engine's step that made the request's generator, and with it every request
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    The canvas is the prompt followed by ``max_tokens`` MASK slots, decoded in blocks of
    ``block_length`` left to right. ``steps`` is the total number of denoising steps over all
    blocks for ``decode="vanilla"`` (LLaDA's schedule); ``None`` means one token per step, the
    exact reference. ``decode="threshold"`` commits every slot with confidence >= ``threshold``
    and always the most confident one (Fast-dLLM), ignoring ``steps``. ``decode="verify"``
    (Flash-Verify) commits what threshold commits, drafts the rest of the block and accepts the
    longest prefix of up to ``max_verify`` drafts that passes ``verify_rule`` at ``gamma`` in the
    next forward (see ``flash_dllm.decoding.verify``). Sentinels (``entropy_max``,
    ``perturb_sigma``: verify only; ``kv_jaccard_min``: any policy) are off when None.
    """

    max_tokens: int = 64
    block_length: int | None = None      # None: min(32, max_tokens)
    steps: int | None = None             # None: max_tokens (one token per step)
    temperature: float = 0.0
    top_k: int = 0                       # 0: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None
    decode: str = "vanilla"
    cache: str = "none"
    threshold: float = 0.9
    early_stop: bool = True              # finish once a completed block holds an end-of-answer id
    # --- decode="verify" (Flash-Verify)
    gamma: float = 0.8                   # acceptance level; > 1 accepts nothing (= threshold)
    verify_rule: str = "agree"           # "agree" | "cumprod"
    max_verify: int | None = None        # drafts verified per forward; None: block_length
    # --- sentinels (None = off)
    entropy_max: float | None = None     # nats; a slot above it is verified, never committed as is
    perturb_sigma: float | None = None   # logit noise scale; top-1 flips -> verified
    kv_jaccard_min: float | None = None  # top-k attention overlap with last step; below -> refresh
    kv_top_k: int = 8                    # k of the KV-consistency sentinel
    # --- cache="flash": cached positions (most attended last step) recomputed per step
    flash_budget: int = 8
    # --- cache="dual" / "prefix": Elastic-Cache-style drift trigger (``decoding/drift.py``).
    # None: the whole canvas is recomputed at every block's first step (Fast-dLLM). A number:
    # only when the attention the cached keys get has drifted (cosine similarity of the
    # ``kv_top_k`` most-attended cached keys' mass between consecutive steps below it);
    # otherwise a block's first step recomputes the previous and the active block only
    drift_min: float | None = None
    # True: the refresh a failed test asks for waits for the next block's first step (where
    # Fast-dLLM refreshes); False: it runs at the next step, mid-block. Unused without drift_min
    drift_defer: bool = True

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        if self.block_length is None:
            object.__setattr__(self, "block_length", min(DEFAULT_BLOCK_LENGTH, self.max_tokens))
        _check_int("block_length", self.block_length, 1)
        if self.max_tokens % self.block_length:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a multiple of block_length "
                             f"({self.block_length})")
        if self.steps is None:
            object.__setattr__(self, "steps", self.max_tokens)
        _check_int("steps", self.steps, 1)
        if self.steps > self.max_tokens:
            raise ValueError(f"steps must be in [1, max_tokens={self.max_tokens}], got {self.steps}")
        if self.steps % self.num_blocks:
            raise ValueError(f"steps ({self.steps}) must be a multiple of the number of blocks "
                             f"max_tokens/block_length = {self.num_blocks}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0)
        _check_fraction("top_p", self.top_p)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        _check_choice("decode", self.decode, DECODE_POLICIES)
        _check_choice("cache", self.cache, CACHE_MODES)
        _check_fraction("threshold", self.threshold)
        if (isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float))
                or not 0.0 < self.gamma < float("inf")):
            raise ValueError(f"gamma must be a finite number > 0 (values > 1 accept no draft), "
                             f"got {self.gamma!r}")
        _check_choice("verify_rule", self.verify_rule, VERIFY_RULES)
        if self.max_verify is None:
            object.__setattr__(self, "max_verify", self.block_length)
        _check_int("max_verify", self.max_verify, 1)
        if self.max_verify > self.block_length:
            raise ValueError(f"max_verify must be in [1, block_length={self.block_length}], "
                             f"got {self.max_verify}")
        for name in ("entropy_max", "perturb_sigma"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0 or None, got {v!r}")
            if self.decode != "verify":
                raise ValueError(f"{name} needs decode='verify' (a slot it flags is drafted for "
                                 f"verification), got decode={self.decode!r}")
        _check_fraction("kv_jaccard_min", self.kv_jaccard_min, optional=True)
        _check_int("kv_top_k", self.kv_top_k, 1)
        _check_int("flash_budget", self.flash_budget, 0)
        _check_fraction("drift_min", self.drift_min, optional=True)
        if self.drift_min is not None and self.decode == "verify":
            raise ValueError("drift_min does not run with decode='verify' (the verification "
                             "rows' attention would enter the drift test's mass)")
        if not isinstance(self.drift_defer, bool):
            raise ValueError(f"drift_defer must be a bool, got {self.drift_defer!r}")
        if self.drift_min is not None and not CACHE_MODES[self.cache].block_refresh:
            ok = " or ".join(repr(m) for m in CACHE_MODES if CACHE_MODES[m].block_refresh)
            raise ValueError(f"drift_min needs cache {ok} (the caches refreshed at block "
                             f"starts), got cache={self.cache!r}")

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide knobs."""

    max_num_seqs: int = 64               # requests decoded together in one forward
    # --- KV pages (serving): admission control. A request reserves ceil(canvas / page_size) pages
    # when admitted and frees them when it finishes or aborts; one that does not fit waits.
    page_size: int = 16                  # tokens per KV page
    kv_cache_gb: float = 1.0             # pool size: kv_cache_gb * 2**30 // (page_size * kv bytes/token)
    num_kv_pages: int | None = None      # explicit pool size (overrides kv_cache_gb; tests)
    # GPU only: size the pool to this fraction of the device's memory minus what is allocated when
    # the engine starts (the weights); the rest of the fraction is KV, 1 - fraction is left for
    # activations and CUDA graphs. Overrides kv_cache_gb; num_kv_pages overrides both.
    gpu_memory_utilization: float | None = None
    max_waiting: int = 256               # AsyncEngine: queued requests before new ones are refused
    # CUDA only: replay the model forward from CUDA graphs (one graph per padded step shape:
    # rows, requests and query length rounded up to powers of two; captured on its second
    # sighting (third above cuda_graph_max_rows rows per request), or by a server's warm-up,
    # never after it; at most max_cuda_graphs kept; steps above cuda_graph_max_tokens rows run
    # eagerly).
    cuda_graphs: bool = True
    max_cuda_graphs: int = 256
    cuda_graph_max_rows: int = 128       # steps with more rows per request: captured later
    # steps with more rows in all always run eagerly: 64 requests of up to 256 positions fit (at
    # 8192, a small model served at concurrency 64 ran ~half its steps eagerly, issue 21)
    cuda_graph_max_tokens: int = 16384
    # steady greedy threshold/vanilla/verify steps of dual/prefix requests as ONE graph (forward, LM
    # head, proposal, commit; the runner's ``step`` capture mode, ``worker/fused_step.py``) while
    # batch x block_length <= the row cap (2048: batch 64 x 32). None (default): on when CUDA
    # graphs are (H200, same machine, A/B: batch-1 eval 1.7-1.8 s vs 1.9-2.1 s on the general
    # path; serving no worse, see benchmarks/FINDINGS.md); True: also on the CPU, where the body
    # runs eagerly (the tests compare it with the general path); False: off.
    fused_step: bool | None = None
    fused_step_max_rows: int = 2048
    # q/k/v and gate/up projections as one GEMM each (``DiffusionTransformer.fuse_projections``,
    # in place on the engine's model). None: on CUDA only (on the CPU the unfused GEMMs keep
    # results bit-identical to a plain forward of the same model).
    fuse_projections: bool | None = None
    # --- memory tiers and prefix reuse (cache/kv_manager.py, cache/tiers.py, cache/io/kv_offload.py)
    # keep finished requests' full pages as cached blocks and reuse them for prompts that start
    # with the same tokens (multi-turn chat); reused K/V are approximate (bidirectional model)
    prefix_reuse: bool = False
    kv_cpu_gb: float = 0.0               # L1: pinned host memory for cached pages (0: none)
    kv_disk_path: str | None = None      # L2: a file for cached pages (None: none)
    kv_disk_gb: float = 0.0              # L2 size
    kv_offload_dtype: str = "bf16"       # pages below L0: "bf16" (the pool's, exact), fp8, int8
    # pinned host memory for a request larger than the whole GPU pool (``cache/io/kv_overflow.py``):
    # its pages that fit stay in the pool, the rest stream over PCIe layer by layer at every
    # step; such a request runs alone. 0: refused (as before)
    kv_overflow_gb: float = 0.0
    # lazy loading for those requests (approximate): a step that does not rewrite the host
    # pages attends to the GPU-resident pages plus this share of the pages it does not write,
    # those of most predicted attention (``lazy_load_predictor``), loading only the host pages
    # among them. None: every page, every step (exact)
    lazy_load_budget: float | None = None
    # its sentinel: each lazy step measures which loaded host pages its block attends to most
    # (top-k) and compares them with the block's measuring step; an overlap (Jaccard) below this
    # makes the next step load every page and measure again (force-load). None: off
    lazy_load_sentinel: float | None = None
    # which pages a lazy step loads: "mass" (the most attended at the block's measuring step) or
    # "quest" (re-chosen after every step from an upper bound of the attention its queries can
    # give each page, from per-page key summaries; ``cache/io/lazy_load.quest_scores``)
    lazy_load_predictor: str = "mass"
    # which cached pages leave a tier first; with lazy_load_budget also which pages of a request
    # larger than the pool stay resident (``cache/io/overflow_placement.py``). None: each use's
    # winner on the benchmarks (``placement_cpu.json``, ``placement_overflow_*_h200.json``):
    # "lru" for cached pages (no policy beat it beyond run-to-run spread), "ema" for the
    # resident set (19-33 % fewer bytes than lru; "kag" no better than ema)
    kv_placement: str | None = None
    # with a disk tier: read the disk copies of waiting requests' reusable prefixes into host
    # memory while they wait (queue-ahead prefetch, ``KVCacheManager.prefetch``); off until a
    # GPU benchmark shows it pays (on the CPU it helped one host-tier size and hurt another:
    # benchmarks/results/kv-tiers/prefetch_multiturn_cpu.json)
    kv_prefetch: bool = False
    # ema / kag (cache/access_graph.py): neighbours kept per page, and when a request's
    # attention evidence is handed over: "every-block" or "every-N-steps" (N >= 1)
    kag_top_k: int = 8
    kag_update: str = "every-block"
    # debug / tests: after every step, every running request's pages go down to host memory and
    # back (the tiers' data path end to end; outputs must not change with bf16)
    kv_tier_stress: bool = False

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("page_size", self.page_size, 1)
        if (isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, (int, float))
                or not self.kv_cache_gb > 0):
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb!r}")
        if self.num_kv_pages is not None:
            _check_int("num_kv_pages", self.num_kv_pages, 1)
        _check_int("max_waiting", self.max_waiting, 1)
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        _check_int("max_cuda_graphs", self.max_cuda_graphs, 1)
        _check_int("cuda_graph_max_rows", self.cuda_graph_max_rows, 1)
        _check_int("cuda_graph_max_tokens", self.cuda_graph_max_tokens, 1)
        if self.fused_step is not None and not isinstance(self.fused_step, bool):
            raise ValueError(f"fused_step must be a bool or None, got {self.fused_step!r}")
        _check_int("fused_step_max_rows", self.fused_step_max_rows, 1)
        if self.fuse_projections is not None and not isinstance(self.fuse_projections, bool):
            raise ValueError(f"fuse_projections must be a bool or None, got "
                             f"{self.fuse_projections!r}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float))
                              or not 0.0 < u < 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1) or None, got {u!r}")
        for name in ("prefix_reuse", "kv_tier_stress", "kv_prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("kv_cpu_gb", "kv_disk_gb", "kv_overflow_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 << 20:
                raise ValueError(f"{name} must be a number of GiB >= 0, got {v!r}")
        if (self.kv_disk_path is None) != (self.kv_disk_gb == 0):
            raise ValueError("kv_disk_path and kv_disk_gb go together: give both (a file path "
                             f"and a size > 0) or neither, got kv_disk_path={self.kv_disk_path!r}, "
                             f"kv_disk_gb={self.kv_disk_gb!r}")
        if self.kv_disk_path is not None and self.kv_cpu_gb == 0:
            raise ValueError("kv_disk_path needs kv_cpu_gb > 0: pages reach the disk through "
                             "pinned host memory")
        b = self.lazy_load_budget
        _check_fraction("lazy_load_budget", b, optional=True)
        if b is not None:
            if not self.kv_overflow_gb:
                raise ValueError("lazy_load_budget applies to requests larger than the GPU pool: "
                                 "set kv_overflow_gb (--kv-overflow-gb) too")
        j = self.lazy_load_sentinel
        _check_fraction("lazy_load_sentinel", j, optional=True)
        if j is not None:
            if b is None:
                raise ValueError("lazy_load_sentinel watches lazy loading: set lazy_load_budget "
                                 "(--lazy-load-budget) too")
        _check_choice("lazy_load_predictor", self.lazy_load_predictor, ("mass", "quest"))
        if self.lazy_load_predictor != "mass" and b is None:
            raise ValueError("lazy_load_predictor chooses what lazy loading loads: set "
                             "lazy_load_budget (--lazy-load-budget) too")
        _check_choice("kv_offload_dtype", self.kv_offload_dtype, ("bf16", "fp8", "int8"))
        if self.kv_placement is not None:
            _check_choice("kv_placement", self.kv_placement, ("lru", "ema", "kag"))
        _check_int("kag_top_k", self.kag_top_k, 1)
        self.kag_update_steps      # validates kag_update
        if (self.kv_cpu_gb or self.kv_disk_gb) and not self.prefix_reuse:
            raise ValueError("kv_cpu_gb / kv_disk_gb hold cached pages for prefix reuse: set "
                             "prefix_reuse=True (--prefix-reuse) too")

    @property
    def kag_update_steps(self) -> int | None:
        """``kag_update`` as a step count (None: at the end of every block)."""
        import re

        if self.kag_update == "every-block":
            return None
        m = re.fullmatch(r"every-(\d+)-steps?", str(self.kag_update))
        if m is None or int(m.group(1)) < 1:
            raise ValueError(f"kag_update must be 'every-block' or 'every-N-steps' with N >= 1, "
                             f"got {self.kag_update!r}")
        return int(m.group(1))

    def num_pages(self, kv_bytes_per_token: int, budget_bytes: int | None = None) -> int:
        """Pages in the pool for a model whose cached token takes ``kv_bytes_per_token`` bytes;
        ``budget_bytes`` (from ``gpu_memory_utilization``) replaces ``kv_cache_gb`` when given."""
        if self.num_kv_pages is not None:
            return self.num_kv_pages
        budget = int(self.kv_cache_gb * 2**30) if budget_bytes is None else budget_bytes
        n = budget // (self.page_size * kv_bytes_per_token)
        if n < 1:
            what = (f"kv_cache_gb={self.kv_cache_gb}" if budget_bytes is None else
                    f"gpu_memory_utilization={self.gpu_memory_utilization} "
                    f"({budget_bytes / 2**30:.2f} GiB left for KV)")
            raise ValueError(f"{what} holds no page of {self.page_size} tokens x "
                             f"{kv_bytes_per_token} bytes")
        return n
