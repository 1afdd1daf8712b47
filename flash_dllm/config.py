"""Per-request (``SamplingParams``) and engine-wide (``EngineConfig``) settings, validated on
creation.

Every field is a ``knob()`` (``flash_dllm/knobs.py``): its help, range, choices and flag are
written here once; the per-field checks, the CLI flags and the HTTP body fields are generated
from them. ``__post_init__`` adds only the rules that tie fields together.

NOTE (size): past 400 lines since the quantization knobs (issue 40): the file is the two
classes' field lists, each knob's help written once beside its reason; splitting ``EngineConfig``
by concern (KV tiers, serving, weights) is the cut when it grows again.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.cache.paged import KV_POOL_DTYPES
from flash_dllm.decoding.registry import DECODE_POLICIES
from flash_dllm.knobs import check_knobs, knob, knob_of

# CACHE_MODES and DECODE_POLICIES are registries (``flash_dllm.registry``): iterating gives the
# names, so a mode or policy registered after import is a valid choice from then on
VERIFY_RULES = ("agree", "cumprod")      # flash_dllm.decoding.verify.accept_prefix
DEFAULT_BLOCK_LENGTH = 32

# the largest seed a torch.Generator takes (an unsigned 64-bit integer): a larger one failed the
# engine's step that made the request's generator, and with it every request
MAX_SEED = 2**64 - 1
# serving on a GPU sizes the KV pool from the device's memory (``EngineArgs.kv_sizing``): the 1 GiB
# library default holds ~2k tokens of an 8B model, which capped the LLaDA-8B shape's served batch
# at ~13 requests (issue 21). 0.8 as lm-eval's adapter: the rest holds activations (a 64 x 256
# canvas of an 8B model in one forward) and CUDA graphs.
AUTO_GPU_MEMORY_UTILIZATION = 0.8
KV_CACHE_DTYPES = tuple(KV_POOL_DTYPES)  # EngineConfig.kv_cache_dtype (cache/paged.py's traits)
_GIB_LIMIT = 1 << 20                     # host tiers: sizes below 1 PiB (an int() of bytes)
# --quantization (``flash_dllm.layers.quant.QUANT_MODES``, checked equal in tests/test_quant.py;
# not imported from there: layers/quant imports the kernels, heavier than the config needs)
QUANT_MODES = ("fp8", "int8", "int4")
LM_HEAD_SUFFIX = "+head"   # a mode name's suffix where the LM head is quantized too (stats, bench)
# what each mode cost in accuracy, from the committed reports (benchmarks/README.md, "Quantized
# weights"); filled in from benchmarks/results/accuracy/quant_*_cpu.json and
# precision_fallback_chain_*_b1_cpu.json
QUANT_ACCURACY = ("Measured on the CPU against unquantized: demo model, exact sampler, n = 200: "
                  "arith int8 97.5%% (same), int4 96.5%% (-1), fp8 98%% (+0.5), code 100%% in "
                  "each mode; proxy-llada chain, default mode, batch 1, n = 200, group 32: "
                  "int8 88.5%% (+1), int4 85.5%% (-2; 88.0%% fitted by GPTQ), fp8 85.5%% (-2; -0.5 "
                  "over 400); "
                  "proxy-llada2 (MoE) chain fp8 +0.5 over 400, int4 -3.2 over 600 (-1.2 with "
                  "--quantization-calibration chain,code-long), code-long "
                  "fp8 -0.2 over 600; proxy-dream chain int8 0, int4 +0.5, fp8 0. "
                  "Step time on an H100 (LLaDA-8B shape, dual cache, against bf16's): batch 1 "
                  "fp8 0.73x, int4 0.65x (0.70x / 0.62x with --quantize-lm-head; int8 0.82x "
                  "with older tiles); batch 64 fp8 1.31x the throughput, int4 0.92x (slower: "
                  "from 512 rows a GEMM dequantizes a copy) (benchmarks/README.md)")


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

    The defaults are the recommended mode: ``decode="threshold"`` at 0.99 with ``cache=None``,
    which the engine resolves to the model family's fast cache (``Family.default_cache``: dual
    for LLaDA and Dream, the exact block cache for block-causal families). The exact reference
    sampler is ``decode="vanilla", cache="none"``. What the entry points put below a request's
    own fields (flags, generation_config.json): ``flash_dllm.defaults``.
    """

    # the endpoints carry their own (max_tokens, max_completion_tokens, max_new_tokens)
    max_tokens: int = knob(64, "MASK slots after the prompt (default: %(default)s)", ge=1,
                           http=False)
    block_length: int | None = knob(None, "tokens per block (default: min(32, max-tokens))",
                                    ge=1)
    steps: int | None = knob(None, "vanilla: total denoising steps (default: max-tokens, one "
                                   "token per step)", ge=1)
    temperature: float = knob(0.0, "sampling temperature; 0: greedy (default: %(default)s)",
                              ge=0, le=100)
    top_k: int = knob(0, "sample among the k most likely tokens; 0: all (default: %(default)s)",
                      ge=0)
    top_p: float = knob(1.0, "sample among the most likely tokens holding this probability mass "
                             "(default: %(default)s)", gt=0, le=1)
    seed: int | None = knob(None, "the request's random seed (default: none)", ge=0, le=MAX_SEED)
    # NOTE: the recommended defaults (issue 42): threshold decoding with the model family's
    # fast cache; the exact reference sampler is `decode="vanilla", cache="none"`. The evidence
    # (docs/sampling.md#the-default-mode): at 0.99 with the dual cache, the demo model is at or
    # above exact and the trained proxies' long answers within 1.5 points of exact on three
    # suites of four (2.5 on the fourth) in 4.5-14x fewer forwards; 0.9 saves 15-30 % more
    # forwards but falls 3.5-14.5 points below exact on the proxies.
    decode: str = knob("threshold", "decode policy: which slots a step commits (default: "
                                    "%(default)s; `--decode vanilla --cache none` is the exact "
                                    "reference sampler, 1 token per forward)",
                       choices=DECODE_POLICIES)
    # None: the model family's fast cache (``Family.default_cache``), resolved by the engine
    # when the request is validated (``engine.core.resolve_params``)
    cache: str | None = knob(None, "cache mode: which positions a step recomputes (default: "
                                   "the model family's fast cache: dual for LLaDA and Dream, "
                                   "the exact block cache for block-causal families)",
                             choices=CACHE_MODES)
    threshold: float = knob(0.99, "threshold / verify: commit every slot with confidence >= this "
                                 "(default: %(default)s)", gt=0, le=1)
    early_stop: bool = knob(True, "off: decode every block even after the answer ended "
                                  "(default: on, finish once a completed block holds an "
                                  "end-of-answer id)", flag="--no-early-stop")
    # --- decode="verify" (Flash-Verify)
    gamma: float = knob(0.8, "verify: acceptance level (> 1 accepts nothing)", gt=0)
    verify_rule: str = knob("agree", "verify: how drafts are accepted (default: %(default)s)",
                            choices=VERIFY_RULES)
    max_verify: int | None = knob(None, "verify: drafts checked per forward (default: block "
                                        "length)", ge=1)
    # --- sentinels (None = off)
    entropy_max: float | None = knob(None, "verify sentinel: verify slots with entropy above "
                                           "this (nats)", gt=0)
    perturb_sigma: float | None = knob(None, "verify sentinel: verify slots whose top-1 flips "
                                             "under this logit noise", gt=0)
    kv_jaccard_min: float | None = knob(None, "KV sentinel: refresh keys when a slot's top-k "
                                              "overlap drops below this", gt=0, le=1)
    kv_top_k: int = knob(8, "k of the KV sentinel and of the drift test (default: %(default)s)",
                         ge=1)
    # --- cache="flash": cached positions (most attended last step) recomputed per step
    flash_budget: int = knob(8, "cache=flash: most-attended cached positions recomputed per "
                                "step", ge=0)
    # --- cache="dual" / "prefix": Elastic-Cache-style drift trigger (``decoding/drift.py``).
    # None: the whole canvas is recomputed at every block's first step (Fast-dLLM). A number:
    # only when the attention the cached keys get has drifted (cosine similarity of the
    # ``kv_top_k`` most-attended cached keys' mass between consecutive steps below it);
    # otherwise a block's first step recomputes the previous and the active block only
    drift_min: float | None = knob(None, "cache=dual/prefix: refresh the cache only when the "
                                         "cached keys' attention drifts (similarity below this) "
                                         "instead of at every block", gt=0, le=1)
    # True: the refresh a failed test asks for waits for the next block's first step (where
    # Fast-dLLM refreshes); False: it runs at the next step, mid-block. Unused without drift_min
    drift_defer: bool = knob(True, "with --drift-min: refresh at the next block's first step "
                                   "(default), or at the next step, mid-block "
                                   "(--no-drift-defer)")
    # --- decode="edit" (LLaDA2.1's token-to-token editing, ``decoding/policies/edit.py``)
    edit_threshold: float = knob(0.0, "decode=edit: replace a decoded token of the active block "
                                      "by the model's prediction when its probability is above "
                                      "this (default: %(default)s, any disagreement)", ge=0, le=1)
    max_post_edit_steps: int = knob(16, "decode=edit: steps a block may keep editing once it "
                                        "has no mask left (default: %(default)s)", ge=0)

    def __post_init__(self) -> None:
        # the derived defaults first (they read max_tokens and block_length), then every field
        # on its own, then the rules that tie fields together
        knob_of(SamplingParams, "max_tokens").check(self.max_tokens)
        if self.block_length is None:
            object.__setattr__(self, "block_length", min(DEFAULT_BLOCK_LENGTH, self.max_tokens))
        if self.steps is None:
            object.__setattr__(self, "steps", self.max_tokens)
        if self.max_verify is None:
            object.__setattr__(self, "max_verify", self.block_length)
        check_knobs(self)
        if self.max_tokens % self.block_length:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a multiple of block_length "
                             f"({self.block_length})")
        if self.steps > self.max_tokens:
            raise ValueError(f"steps must be in [1, max_tokens={self.max_tokens}], "
                             f"got {self.steps}")
        if self.steps % self.num_blocks:
            raise ValueError(f"steps ({self.steps}) must be a multiple of the number of blocks "
                             f"max_tokens/block_length = {self.num_blocks}")
        if self.max_verify > self.block_length:
            raise ValueError(f"max_verify must be in [1, block_length={self.block_length}], "
                             f"got {self.max_verify}")
        # a policy's own knobs (``DecodePolicy.own_knobs``: verify's sentinels) with another
        own = DECODE_POLICIES[self.decode].own_knobs
        for owner in DECODE_POLICIES:
            for name in DECODE_POLICIES[owner].own_knobs:
                if getattr(self, name) is not None and name not in own:
                    raise ValueError(f"{name} needs decode={owner!r} (a knob of that policy "
                                     f"only), got decode={self.decode!r}")
        if self.drift_min is not None and DECODE_POLICIES[self.decode].adds_rows:
            raise ValueError(f"drift_min does not run with decode={self.decode!r} (its extra "
                             "query rows' attention would enter the drift test's mass)")
        # (cache None is checked once the engine resolved it: ``dataclasses.replace`` runs this
        # again)
        if self.drift_min is not None and self.cache is not None \
                and not CACHE_MODES[self.cache].block_refresh:
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

    max_num_seqs: int = knob(64, "requests decoded together in one forward (default: "
                                 "%(default)s)", ge=1)
    # --- KV pages (serving): admission control. A request reserves ceil(canvas / page_size) pages
    # when admitted and frees them when it finishes or aborts; one that does not fit waits.
    page_size: int = knob(16, "tokens per KV page (default: %(default)s)", ge=1)
    # pool size: kv_cache_gb * 2**30 // (page_size * kv bytes/token)
    kv_cache_gb: float = knob(1.0, "KV page pool size in GiB; requests are admitted while their "
                                   "pages fit (default: 1; serve, bench serve and bench multiturn "
                                   "on a GPU: --gpu-memory-utilization "
                                   f"{AUTO_GPU_MEMORY_UTILIZATION} unless a pool size is given, "
                                   "as serving engines do)", gt=0)
    num_kv_pages: int | None = knob(None, "explicit KV pool size in pages (overrides "
                                          "--kv-cache-gb)", ge=1)
    # GPU only: size the pool to this fraction of the device's memory minus what is allocated when
    # the engine starts (the weights); the rest of the fraction is KV, 1 - fraction is left for
    # activations and CUDA graphs. Overrides kv_cache_gb; num_kv_pages overrides both.
    gpu_memory_utilization: float | None = knob(
        None, "CUDA: size the KV pool to this fraction of GPU memory minus the weights "
              "(overrides --kv-cache-gb)", gt=0, lt=1)
    # the GPU pool's element type (``cache/paged.py``): auto = the model's dtype; fp8 = e4m3 pages
    # with one fp32 scale per (page, layer, K/V, kv head), about twice the tokens per GiB
    kv_cache_dtype: str = knob("auto", "KV page pool element type: auto (the model's dtype) or "
                                       "fp8 (e4m3 with per-page, per-head scales: ~2x the tokens "
                                       "in the same memory; approximate) (default: %(default)s)",
                               choices=KV_CACHE_DTYPES)
    max_waiting: int = knob(256, "serving: queued requests before new ones get 429 (default: "
                                 "%(default)s)", ge=1)
    # NOTE (issue 44): the count above bounds memory, not time: 64 clients of a 2-core server
    # all queued with a 24 s median wait and no 429. A request that would queue longer than a
    # reverse proxy waits (nginx's proxy_read_timeout: 60 s) is answered 429 + Retry-After
    # instead, so a client can back off or go elsewhere; 0 queues without a time bound (vLLM's
    # behaviour). The wait is estimated from the requests ahead and the recent finish rate
    max_queue_wait: float = knob(60.0, "serving: a request that would wait longer than this "
                                       "many seconds for admission (estimated: the requests "
                                       "ahead of it over the recent finish rate) gets 429 with "
                                       "Retry-After; 0: no time bound (default: %(default)s, "
                                       "nginx's default proxy read timeout)", ge=0)
    # CUDA only: replay the model forward from CUDA graphs (one graph per padded step shape:
    # rows, requests and query length rounded up to powers of two; captured on its second
    # sighting (third above cuda_graph_max_rows rows per request), or by a server's warm-up,
    # never after it; at most max_cuda_graphs kept; steps above cuda_graph_max_tokens rows run
    # eagerly).
    cuda_graphs: bool = knob(True, "CUDA: replay step forwards from CUDA graphs (default: on)")
    max_cuda_graphs: int = knob(256, "CUDA graphs kept at most", ge=1, cli=False)
    cuda_graph_max_rows: int = knob(128, "steps with more rows per request are captured later",
                                    ge=1, cli=False)
    # steps with more rows in all always run eagerly: 64 requests of up to 256 positions fit (at
    # 8192, a small model served at concurrency 64 ran ~half its steps eagerly, issue 21)
    cuda_graph_max_tokens: int = knob(16384, "steps with more rows in all run eagerly", ge=1,
                                      cli=False)
    # steady greedy threshold/vanilla/verify steps of dual/prefix requests as ONE graph (forward, LM
    # head, proposal, commit; the runner's ``step`` capture mode, ``worker/fused_step.py``) while
    # batch x block_length <= the row cap (2048: batch 64 x 32). None (default): on when CUDA
    # graphs are (H200, same machine, A/B: batch-1 eval 1.7-1.8 s vs 1.9-2.1 s on the general
    # path; serving no worse, see benchmarks/FINDINGS.md); True: also on the CPU, where the body
    # runs eagerly (the tests compare it with the general path); False: off.
    fused_step: bool | None = knob(None, "run steady greedy dual/prefix steps as one CUDA graph "
                                         "each (default: on with CUDA graphs)")
    fused_step_max_rows: int = knob(2048, "fused steps: batch x block length at most", ge=1,
                                    cli=False)
    # a block-cache request's block-start step (the block before with its final tokens, and the
    # new block's first proposal; ``CacheMode.fusable_first``) as a fused step too, its attention
    # cut at block bounds as the general path cuts it (SDAR-4B batch 128, H100: 38.5 -> 24.2 ms a
    # block start). Off until batch 1 and serving with requests in mixed phases are timed
    fused_first_steps: bool = knob(False, "block cache: run each block's first step as a fused "
                                          "step too (default: off)", cli=False)
    # several steady fused steps of one plan per engine step, each launched before the host
    # applied the one before it (``engine/multi_step.py``: the host's ~0.2 ms a step hides
    # behind the device); only where the policy knows its next steps (vanilla) and no admission
    # is due; a call's steps also stay within ``multi_step.CALL_SECONDS``. None: 4 with CUDA
    # graphs, else 1 (off)
    multi_step: int | None = knob(None, "fused steps one engine step may launch ahead of the "
                                        "host (vanilla decoding within a block; default: 4 "
                                        "with CUDA graphs, 1 = off otherwise)", ge=1)
    # q/k/v and gate/up projections as one GEMM each (``DiffusionTransformer.fuse_projections``,
    # in place on the engine's model). None: on CUDA only (on the CPU the unfused GEMMs keep
    # results bit-identical to a plain forward of the same model).
    fuse_projections: bool | None = knob(None, "q/k/v and gate/up projections as one GEMM each "
                                               "(default: on CUDA only)", cli=False)
    # --- quantized weights (issue 40; ``layers/quant.py``): the checkpoint's weights quantized at
    # load, after the projections are fused; embeddings, LM head and MoE routers stay unquantized
    quantization: str | None = knob(
        None, "quantize the weights at load: fp8 (e4m3 weights, one scale per output channel, "
              "activations quantized at each call (blocks of 128 values below 64 rows, per "
              "token from there), GEMMs on FP8 tensor cores: CUDA "
              "compute capability >= 8.9; emulated on the CPU; 1 byte/weight), int8 or int4 "
              "(weight-only, one scale per --quantization-group-size inputs, dequantized inside "
              "the GEMM kernel; 1 or 0.5 byte/weight + scales). " + QUANT_ACCURACY
              + " (default: none, the checkpoint's dtype; a checkpoint published in "
              "compressed-tensors FP8 or int4: its own mode)", choices=QUANT_MODES)
    quantization_group_size: int | None = knob(
        None, "int8 / int4: input columns sharing one scale; must divide every quantized "
              "layer's input width (default: 128; for a checkpoint published in int4, its "
              "own group)", ge=1)
    quantize_lm_head: bool = knob(
        False, "with --quantization (or a checkpoint published quantized): quantize the LM "
               "head too, in that mode. It is read at every step "
               "(LLaDA-8B's: 1.04 GB in bf16), which pays where steps are few rows (batch 1); "
               "from 512 rows a call, int8 / int4 dequantize it per call. The confidence every "
               "decode policy ranks by comes from its logits: its accuracy cost is in "
               "docs/models.md (default: off)")
    # GPTQ at load (``layers/gptq.py``, ``entrypoints/calibration.py``): int8 / int4 codes
    # fitted to the model's activations on calibration text, instead of rounded to nearest
    quantization_calibration: str | None = knob(
        None, "int8 / int4: fit the codes to activations by GPTQ at load, on samples from "
              "built-in eval suites (their training split, e.g. chain), .jsonl files ('text', "
              "or 'prompt' and 'answer' per line) and text files (a sample per non-empty "
              "line), separated by ',' or '+' (lm-eval's model_args: '+'). Costs a partial "
              "dense forward of the samples per layer at start-up (default: none, round to "
              "nearest)")
    quantization_calibration_samples: int = knob(
        128, "with --quantization-calibration: how many samples GPTQ fits to, drawn evenly "
             "from its sources", ge=1)
    # --- memory tiers and prefix reuse (cache/kv_manager.py, cache/tiers.py,
    # cache/io/kv_offload.py)
    # keep finished requests' full pages as cached blocks and reuse them for prompts that start
    # with the same tokens (multi-turn chat); reused K/V are approximate (bidirectional model)
    prefix_reuse: bool = knob(False, "keep finished requests' KV pages and reuse them for "
                                     "prompts that start with the same tokens (multi-turn chat); "
                                     "reused K/V are approximate (bidirectional attention). "
                                     "Default: on for serve, off elsewhere")
    # issue 44: a request's temperature-0 answer independent of load, batch composition and
    # cache state. No request reuses K/V another request computed: a bidirectional family's
    # (LLaDA, Dream, LLaDA-MoE) were computed with another suffix (approximate), and a
    # block-causal family's, exact in exact arithmetic, are not bitwise a recompute's (measured:
    # ``tests/test_same_answer.py``); either way whether they are still cached would change the
    # answer (``Engine.prefix_reuse``). On the CPU the token-wise GEMMs run on rows padded to a fixed multiple
    # (``layers/batch_invariant.py``); a batch-invariant GPU path is future work
    # (docs/serving.md#same-answer-under-load)
    deterministic: bool = knob(False, "the same request gives the same answer whatever else runs "
                                      "and whatever is cached: no cross-request prefix reuse "
                                      "(--prefix-reuse is ignored), batch-invariant GEMMs and "
                                      "kernel launches (padded rows on the CPU; fixed tiles on "
                                      "a GPU, not yet checked there) (default: off)")
    kv_cpu_gb: float = knob(0.0, "GiB of pinned host memory for cached KV pages that leave the "
                                 "GPU (L1; needs --prefix-reuse; default: %(default)s, none)",
                            ge=0, lt=_GIB_LIMIT)
    kv_disk_path: str | None = knob(None, "a file for cached KV pages below host memory (L2; "
                                          "created and preallocated; records of an earlier "
                                          "process are never used)")
    kv_disk_gb: float = knob(0.0, "size of --kv-disk-path in GiB", ge=0, lt=_GIB_LIMIT)
    kv_offload_dtype: str = knob("bf16", "how pages are stored below the GPU: bf16 (the pool's "
                                         "own dtype, exact), fp8 (e4m3) or int8 (one scale per "
                                         "page, layer and head; half the bytes) (default: "
                                         "%(default)s)", choices=("bf16", "fp8", "int8"))
    # pinned host memory for a request larger than the whole GPU pool (``cache/io/kv_overflow.py``):
    # its pages that fit stay in the pool, the rest stream over PCIe layer by layer at every
    # step; such a request runs alone. 0: refused (as before)
    kv_overflow_gb: float = knob(0.0, "GiB of pinned host memory for a request whose KV is "
                                      "larger than the whole GPU pool: the pages that fit stay on "
                                      "the GPU, the rest are copied in layer by layer at every "
                                      "step (slow: PCIe-bound), and the request runs alone; cache "
                                      "dual or prefix (default: %(default)s, such requests are "
                                      "refused)", ge=0, lt=_GIB_LIMIT)
    # lazy loading for those requests (approximate): a step that does not rewrite the host
    # pages attends to the GPU-resident pages plus this share of the pages it does not write,
    # those of most predicted attention (``lazy_load_predictor``), loading only the host pages
    # among them. None: every page, every step (exact)
    lazy_load_budget: float | None = knob(
        None, "with --kv-overflow-gb: a step that does not rewrite a long request's host pages "
              "attends to its GPU-resident pages plus this share (0-1] of its other pages, those "
              "of most predicted attention, and loads only the host pages among them; its "
              "attention skips the rest (approximate; default: every page, exact)", gt=0, le=1)
    # its sentinel: each lazy step measures which loaded host pages its block attends to most
    # (top-k) and compares them with the block's measuring step; an overlap (Jaccard) below this
    # makes the next step load every page and measure again (force-load). None: off
    lazy_load_sentinel: float | None = knob(
        None, "with --lazy-load-budget: each lazy step compares the host pages its block attends "
              "to most (top 8 of those loaded) with the block's measuring step; an overlap "
              "(Jaccard) below this value makes the next step load every page and measure again "
              "(counted as sentinel 'lazy_load'; default: off)", gt=0, le=1)
    # which pages a lazy step loads: "mass" (the most attended at the block's measuring step) or
    # "quest" (re-chosen after every step from an upper bound of the attention its queries can
    # give each page, from per-page key summaries; ``cache/io/lazy_load.quest_scores``)
    lazy_load_predictor: str = knob(
        "mass", "with --lazy-load-budget: which host pages a lazy step loads: mass (those its "
                "block attended to most at its first step) or quest (re-chosen after every step "
                "from an upper bound of the attention the step's queries can give each page, from "
                "per-page key summaries) (default: %(default)s)", choices=("mass", "quest"))
    # which cached pages leave a tier first; with lazy_load_budget also which pages of a request
    # larger than the pool stay resident (``cache/io/overflow_placement.py``). None: each use's
    # winner on the benchmarks (``placement_cpu.json``, ``placement_overflow_*_h200.json``):
    # "lru" for cached pages (no policy beat it beyond run-to-run spread), "ema" for the
    # resident set (19-33 % fewer bytes than lru; "kag" no better than ema)
    kv_placement: str | None = knob(
        None, "which cached pages leave a tier first: lru (least recently used), ema (least "
              "attended: moving average of the attention mass their pages got), kag (least "
              "central in the KV access graph, PageRank); ema and kag learn from cache=flash "
              "steps only. With --lazy-load-budget also which pages of a request larger than the "
              "pool stay on the GPU (re-chosen at each block refresh; lru keeps its last pages). "
              "Default: lru for cached pages, ema for that resident set (each the winner of its "
              "benchmark)", choices=("lru", "ema", "kag"))
    # with a disk tier: read the disk copies of waiting requests' reusable prefixes into host
    # memory while they wait (queue-ahead prefetch, ``KVCacheManager.prefetch``); off until a
    # GPU benchmark shows it pays (on the CPU it helped one host-tier size and hurt another:
    # benchmarks/results/kv-tiers/prefetch_multiturn_cpu.json)
    kv_prefetch: bool = knob(False, "with a disk tier: read the disk copies of waiting requests' "
                                    "reusable prefixes into host memory while they wait, so that "
                                    "admission loads them from host memory (default: off; "
                                    "measured on the CPU only)")
    # ema / kag (cache/access_graph.py): neighbours kept per page, and when a request's
    # attention evidence is handed over: "every-block" or "every-N-steps" (N >= 1)
    kag_top_k: int = knob(8, "ema / kag: neighbours kept per page in the KV access graph "
                             "(default: %(default)s)", ge=1)
    kag_update: str = knob("every-block", "ema / kag: hand a request's attention evidence to the "
                                          "graph every-block or every-N-steps (e.g. "
                                          "every-4-steps; default: %(default)s)")
    # debug / tests: after every step, every running request's pages go down to host memory and
    # back (the tiers' data path end to end; outputs must not change with bf16)
    kv_tier_stress: bool = knob(False, "after every step, move every running request's pages to "
                                       "host memory and back (debug)", cli=False)

    def __post_init__(self) -> None:
        check_knobs(self)
        self.kag_update_steps      # validates kag_update's form
        if (self.kv_disk_path is None) != (self.kv_disk_gb == 0):
            raise ValueError("kv_disk_path and kv_disk_gb go together: give both (a file path "
                             f"and a size > 0) or neither, got kv_disk_path={self.kv_disk_path!r}, "
                             f"kv_disk_gb={self.kv_disk_gb!r}")
        if self.kv_disk_path is not None and self.kv_cpu_gb == 0:
            raise ValueError("kv_disk_path needs kv_cpu_gb > 0: pages reach the disk through "
                             "pinned host memory")
        b = self.lazy_load_budget
        if b is not None and not self.kv_overflow_gb:
            raise ValueError("lazy_load_budget applies to requests larger than the GPU pool: "
                             "set kv_overflow_gb (--kv-overflow-gb) too")
        if self.lazy_load_sentinel is not None and b is None:
            raise ValueError("lazy_load_sentinel watches lazy loading: set lazy_load_budget "
                             "(--lazy-load-budget) too")
        if self.lazy_load_predictor != knob_of(EngineConfig, "lazy_load_predictor").default \
                and b is None:
            raise ValueError("lazy_load_predictor chooses what lazy loading loads: set "
                             "lazy_load_budget (--lazy-load-budget) too")
        if KV_POOL_DTYPES[self.kv_cache_dtype].quantized:
            # NOTE: fp8 pages carry scales beside the codes: the tiers move both (as they are);
            # overflow streaming copies codes only so far: refused, not corrupted
            if self.kv_overflow_gb:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} does not support "
                                 "kv_overflow_gb yet (the streamed pages would lose their "
                                 "scales): use "
                                 "kv_cache_dtype='auto' with it")
            if self.kv_offload_dtype == "int8":
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} pages leave the GPU "
                                 "as they are (fp8 "
                                 "codes and scales): kv_offload_dtype must be bf16 or fp8 "
                                 "with it, got 'int8'")
        if self.quantization_calibration is not None and self.quantization not in ("int8",
                                                                                  "int4"):
            raise ValueError("quantization_calibration fits int8 / int4 codes (GPTQ): set "
                             "quantization to 'int8' or 'int4' (--quantization), got "
                             f"{self.quantization!r}")
        if self.quantization_calibration is not None \
                and not self.quantization_calibration.replace(",", "").replace("+", "").strip():
            raise ValueError("quantization_calibration names no source: give suites or files, "
                             f"separated by ',' or '+', got {self.quantization_calibration!r}")
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

    def num_pages(self, kv_bytes_per_token: int, budget_bytes: int | None = None,
                  page_extra_bytes: int = 0) -> int:
        """Pages in the pool for a model whose cached token takes ``kv_bytes_per_token`` bytes
        (plus ``page_extra_bytes`` per page: fp8 pages' scales); ``budget_bytes`` (from
        ``gpu_memory_utilization``) replaces ``kv_cache_gb`` when given."""
        if self.num_kv_pages is not None:
            return self.num_kv_pages
        budget = int(self.kv_cache_gb * 2**30) if budget_bytes is None else budget_bytes
        n = budget // (self.page_size * kv_bytes_per_token + page_extra_bytes)
        if n < 1:
            what = (f"kv_cache_gb={self.kv_cache_gb}" if budget_bytes is None else
                    f"gpu_memory_utilization={self.gpu_memory_utilization} "
                    f"({budget_bytes / 2**30:.2f} GiB left for KV)")
            raise ValueError(f"{what} holds no page of {self.page_size} tokens x "
                             f"{kv_bytes_per_token} bytes")
        return n
