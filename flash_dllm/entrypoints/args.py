"""Command-line arguments in one place: ``EngineArgs`` (model, device, engine knobs) and the
sampling flags, each flag built from the field it sets, with its default read from
``EngineConfig`` / ``SamplingParams`` (so a default is written exactly once).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, VERIFY_RULES, EngineConfig, SamplingParams

_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# serving on a GPU sizes the KV pool from the device's memory (``EngineArgs.kv_sizing``): the 1 GiB
# library default holds ~2k tokens of an 8B model, which capped the LLaDA-8B shape's served batch
# at ~13 requests (issue 21). 0.8 as lm-eval's adapter: the rest holds activations (a 64 x 256
# canvas of an 8B model in one forward) and CUDA graphs.
AUTO_GPU_MEMORY_UTILIZATION = 0.8


class CommandError(Exception):
    """A failure a command explains in one line: the CLI prints ``error: <message>`` and exits
    with ``exit_code`` (1: something failed while running; 2: bad input)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def require_matplotlib(what: str = "--matrix") -> None:
    """CommandError naming the install when matplotlib is missing (a figure is an extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError(f"{what} draws its figure with matplotlib, which is not installed: "
                           "pip install -e \".[plot]\" (or pip install matplotlib)") from None


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (a bad value is a usage error naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _knob(name: str, kind, help: str, **extra):
    """A field of ``EngineArgs`` mirroring ``EngineConfig.<name>`` (same default)."""
    return field(default=_CONFIG_DEFAULTS[name], metadata={"type": kind, "help": help, **extra})


@dataclass
class EngineArgs:
    """What loads an engine: the checkpoint, the device, and ``EngineConfig``'s knobs."""

    model: str | None = field(default=None, metadata={
        "type": str, "help": "checkpoint folder (Hugging Face layout), or a name: demo (the "
                             "shipped model, the default), proxy-llada, proxy-dream (the "
                             "repository's checkpoints/)"})
    device: str = field(default="cpu", metadata={
        "type": str, "help": "cpu, cuda, cuda:N or auto (default: %(default)s)"})
    dtype: str = field(default="auto", metadata={
        "type": str, "choices": ["auto", "float32", "bfloat16", "float16"],
        "help": "weights and activations; auto: bfloat16 on a GPU (the real checkpoints' dtype; "
                "float32 there runs its GEMMs without tensor cores, slower), float32 on "
                "the CPU (default: %(default)s)"})
    threads: int | None = field(default=None, metadata={
        "type": positive_int,
        "help": "CPU threads for torch's operators (default: $OMP_NUM_THREADS when set; on the "
                "CPU device half the CPUs this process may use, at most 4, which stays fast "
                "when other processes share the machine; elsewhere torch's own choice)"})
    max_num_seqs: int = _knob("max_num_seqs", int, "requests decoded together in one forward "
                                                   "(default: %(default)s)")
    page_size: int = _knob("page_size", int, "tokens per KV page (default: %(default)s)")
    # None (serve's default): auto, see ``kv_sizing``
    kv_cache_gb: float | None = _knob("kv_cache_gb", float,
                                      "KV page pool size in GiB; requests are admitted while "
                                      "their pages fit (default: 1; serve, bench serve and bench "
                                      "multiturn on a GPU: --gpu-memory-utilization "
                                      f"{AUTO_GPU_MEMORY_UTILIZATION} unless a pool size is "
                                      "given, as serving engines do)")
    num_kv_pages: int | None = _knob("num_kv_pages", int,
                                     "explicit KV pool size in pages (overrides --kv-cache-gb)")
    gpu_memory_utilization: float | None = _knob(
        "gpu_memory_utilization", float, "CUDA: size the KV pool to this fraction of GPU memory "
                                         "minus the weights (overrides --kv-cache-gb)")
    max_waiting: int = _knob("max_waiting", int, "serving: queued requests before new ones get "
                                                 "429 (default: %(default)s)")
    cuda_graphs: bool = _knob("cuda_graphs", bool, "CUDA: replay step forwards from CUDA graphs "
                                                   "(default: on)")
    fused_step: bool | None = _knob("fused_step", bool,
                                    "run steady greedy dual/prefix steps as one CUDA graph each "
                                    "(default: on with CUDA graphs)")
    prefix_reuse: bool = _knob("prefix_reuse", bool,
                               "keep finished requests' KV pages and reuse them for prompts that "
                               "start with the same tokens (multi-turn chat); reused K/V are "
                               "approximate (bidirectional attention). Default: on for serve, "
                               "off elsewhere")
    kv_cpu_gb: float = _knob("kv_cpu_gb", float,
                             "GiB of pinned host memory for cached KV pages that leave the GPU "
                             "(L1; needs --prefix-reuse; default: %(default)s, none)")
    kv_disk_path: str | None = _knob("kv_disk_path", str,
                                     "a file for cached KV pages below host memory (L2; created "
                                     "and preallocated; records of an earlier process are never "
                                     "used)")
    kv_disk_gb: float = _knob("kv_disk_gb", float, "size of --kv-disk-path in GiB")
    kv_offload_dtype: str = _knob("kv_offload_dtype", str,
                                  "how pages are stored below the GPU: bf16 (the pool's own dtype, "
                                  "exact), fp8 (e4m3) or int8 (one scale per page, layer and "
                                  "head; half the bytes) (default: %(default)s)",
                                  choices=["bf16", "fp8", "int8"])
    kv_overflow_gb: float = _knob("kv_overflow_gb", float,
                                  "GiB of pinned host memory for a request whose KV is larger "
                                  "than the whole GPU pool: the pages that fit stay on the GPU, "
                                  "the rest are copied in layer by layer at every step (slow: "
                                  "PCIe-bound), and the request runs alone; cache dual or prefix "
                                  "(default: %(default)s, such requests are refused)")
    lazy_load_budget: float | None = _knob(
        "lazy_load_budget", float,
        "with --kv-overflow-gb: a step that does not rewrite a long request's host pages "
        "attends to its GPU-resident pages plus this share (0-1] of its other pages, those of "
        "most predicted attention, and loads only the host pages among them; its attention "
        "skips the rest (approximate; default: every page, exact)")
    lazy_load_sentinel: float | None = _knob(
        "lazy_load_sentinel", float,
        "with --lazy-load-budget: each lazy step compares the host pages its block attends to "
        "most (top 8 of those loaded) with the block's measuring step; an overlap (Jaccard) "
        "below this value makes the next step load every page and measure again (counted as "
        "sentinel 'lazy_load'; default: off)")
    lazy_load_predictor: str = _knob(
        "lazy_load_predictor", str,
        "with --lazy-load-budget: which host pages a lazy step loads: mass (those its block "
        "attended to most at its first step) or quest (re-chosen after every step from an upper "
        "bound of the attention the step's queries can give each page, from per-page key "
        "summaries) (default: %(default)s)", choices=["mass", "quest"])
    kv_placement: str | None = _knob("kv_placement", str,
                                     "which cached pages leave a tier first: lru (least "
                                     "recently used), ema (least attended: moving average of "
                                     "the attention mass their pages got), kag (least central "
                                     "in the KV access graph, PageRank); ema and kag learn from "
                                     "cache=flash steps only. With --lazy-load-budget also "
                                     "which pages of a request larger than the pool stay on the "
                                     "GPU (re-chosen at each block refresh; lru keeps its last "
                                     "pages). Default: lru for cached pages, ema for that "
                                     "resident set (each the winner of its benchmark)",
                                     choices=["lru", "ema", "kag"])
    kv_prefetch: bool = _knob("kv_prefetch", bool,
                              "with a disk tier: read the disk copies of waiting requests' "
                              "reusable prefixes into host memory while they wait, so that "
                              "admission loads them from host memory (default: off; "
                              "measured on the CPU only)")
    kag_top_k: int = _knob("kag_top_k", int, "ema / kag: neighbours kept per page in the KV "
                                             "access graph (default: %(default)s)")
    kag_update: str = _knob("kag_update", str, "ema / kag: hand a request's attention evidence "
                                               "to the graph every-block or every-N-steps "
                                               "(e.g. every-4-steps; default: %(default)s)")
    tensor_parallel_size: int = field(default=1, metadata={
        "type": int, "help": "GPUs (or CPU processes) that split the model's weights, heads and "
                             "KV pages; one worker process per extra rank, or the ranks "
                             "torchrun started (default: %(default)s)"})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     defaults: dict | None = None) -> argparse.ArgumentParser:
        """Add a flag per field; ``defaults`` overrides a few for one command (``serve`` turns
        prefix reuse on, as serving engines do)."""
        defaults = defaults or {}
        g = parser.add_argument_group("model and engine (mirror EngineConfig)")
        for f in dataclasses.fields(cls):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            if meta["type"] is bool:
                g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=meta["help"])
            else:
                g.add_argument(flag, dest=f.name, type=meta["type"], default=default,
                               choices=meta.get("choices"), help=meta["help"])
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})

    def kv_sizing(self, share: int = 1) -> dict:
        """The KV pool sizing ``kv_cache_gb=None`` (serve's default) stands for: on a CUDA device,
        unless ``num_kv_pages`` or ``gpu_memory_utilization`` is given, the pool takes
        ``AUTO_GPU_MEMORY_UTILIZATION`` of the GPU's memory minus the weights (split between
        ``share`` engines on one GPU); elsewhere ``EngineConfig``'s 1 GiB. Empty when
        ``kv_cache_gb`` was given."""
        if self.kv_cache_gb is not None:
            return {}
        out = {"kv_cache_gb": _CONFIG_DEFAULTS["kv_cache_gb"]}
        if self.num_kv_pages is None and self.gpu_memory_utilization is None \
                and is_cuda(self.device):
            out["gpu_memory_utilization"] = round(AUTO_GPU_MEMORY_UTILIZATION / share, 4)
        return out

    def engine_config(self, **override) -> EngineConfig:
        names = set(_CONFIG_DEFAULTS)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}
        kw.update(self.kv_sizing())
        kw.update(override)
        return EngineConfig(**kw)


def is_cuda(device: str) -> bool:
    """Whether ``device`` (cpu, cuda, cuda:N or auto) means a GPU, without loading anything."""
    if device == "auto":
        import torch
        return torch.cuda.is_available()
    return str(device).startswith("cuda")


# --------------------------------------------------------------------------------- sampling
def add_sampling_flags(p: argparse.ArgumentParser, max_tokens_default: str | None = None) -> None:
    """The sampling flags; ``max_tokens_default`` (a description): --max-tokens is left None and
    the command fills it in, as ``eval`` does from the suite."""
    d = SamplingParams()
    g = p.add_argument_group("sampling (mirrors SamplingParams)")
    g.add_argument("--max-tokens", type=int,
                   default=d.max_tokens if max_tokens_default is None else None,
                   help="MASK slots after the prompt (default: "
                        f"{max_tokens_default or '%(default)s'})")
    g.add_argument("--block-length", type=int, default=None,
                   help="tokens per block (default: min(32, max-tokens))")
    g.add_argument("--steps", type=int, default=None,
                   help="vanilla: total denoising steps (default: max-tokens, one token per step)")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--decode", default=d.decode, choices=DECODE_POLICIES)
    g.add_argument("--cache", default=d.cache, choices=CACHE_MODES)
    g.add_argument("--threshold", type=float, default=d.threshold)
    g.add_argument("--gamma", type=float, default=d.gamma,
                   help="verify: acceptance level (> 1 accepts nothing)")
    g.add_argument("--verify-rule", default=d.verify_rule, choices=VERIFY_RULES)
    g.add_argument("--max-verify", type=int, default=None,
                   help="verify: drafts checked per forward (default: block length)")
    g.add_argument("--entropy-max", type=float, default=None,
                   help="verify sentinel: verify slots with entropy above this (nats)")
    g.add_argument("--perturb-sigma", type=float, default=None,
                   help="verify sentinel: verify slots whose top-1 flips under this logit noise")
    g.add_argument("--kv-jaccard-min", type=float, default=None,
                   help="KV sentinel: refresh keys when a slot's top-k overlap drops below this")
    g.add_argument("--kv-top-k", type=int, default=d.kv_top_k)
    g.add_argument("--flash-budget", type=int, default=d.flash_budget,
                   help="cache=flash: most-attended cached positions recomputed per step")
    g.add_argument("--drift-min", type=float, default=None,
                   help="cache=dual/prefix: refresh the cache only when the cached keys' "
                        "attention drifts (similarity below this) instead of at every block")
    g.add_argument("--drift-defer", action=argparse.BooleanOptionalAction, default=d.drift_defer,
                   help="with --drift-min: refresh at the next block's first step (default), "
                        "or at the next step, mid-block (--no-drift-defer)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-early-stop", action="store_true",
                   help="decode every block even after the answer ended")


def sampling_from_args(a: argparse.Namespace, **override) -> SamplingParams:
    kw = dict(max_tokens=a.max_tokens, block_length=a.block_length, steps=a.steps,
              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, decode=a.decode,
              cache=a.cache, threshold=a.threshold, seed=a.seed, early_stop=not a.no_early_stop,
              gamma=a.gamma, verify_rule=a.verify_rule, max_verify=a.max_verify,
              entropy_max=a.entropy_max, perturb_sigma=a.perturb_sigma,
              kv_jaccard_min=a.kv_jaccard_min, kv_top_k=a.kv_top_k, flash_budget=a.flash_budget,
              drift_min=a.drift_min, drift_defer=a.drift_defer)
    kw.update(override)
    return SamplingParams(**kw)


# ---------------------------------------------------------------------------------- threads
# NOTE: why the CPU default is not one thread per core (issue 18). Measured on the 2-core CI-like
# VM, demo model, the README's generate (answer time as printed, 3 runs each;
# benchmarks/step/threads_cpu.py -> threads_cpu.json): with another process keeping one core busy,
# 2 threads took 3.4-5.3 s and 1 thread 1.3-1.6 s; on an idle machine 2 threads took 1.0 s and
# 1 thread 1.05-1.5 s. torch's OpenMP workers spin-wait at
# the end of every parallel region: when a neighbour holds a core, every matmul waits for the
# thread queued behind it while its partner burns the other core spinning (the wait policy is
# read when torch loads, too late for a flag). So the default leaves room: half the CPUs this
# process may use (the physical cores on an SMT machine), at most 4 (the demo model's matmuls
# are 256 wide: more threads add barriers, not speed), at least 1. --threads or
# $OMP_NUM_THREADS choose otherwise (an idle machine gains ~30 % from 2 threads).
MAX_DEFAULT_THREADS = 4


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota
    (containers started with ``--cpus``)."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(n, 1)


def choose_threads(threads: int | None, device: str, environ=None,
                   cpus: int | None = None) -> int | None:
    """The intra-op thread count to set: ``threads`` when given; None (keep torch's) when
    ``$OMP_NUM_THREADS`` is set (torch read it when it loaded) or the device is not the CPU;
    else the busy-machine default above."""
    import os

    if threads is not None:
        return threads
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return None
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, min(MAX_DEFAULT_THREADS, cpus // 2))


def apply_threads(threads: int | None, device: str) -> int:
    """Set torch's intra-op threads (``choose_threads``) and one inter-op thread; call before
    the first parallel operator. Returns the intra-op count in force."""
    import torch

    n = choose_threads(threads, device)
    if n is not None:
        torch.set_num_threads(n)
        # the engine never forks operators (no torch.jit.fork), so a larger inter-op pool would
        # only be idle threads; torch allows this once, before any inter-op work
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
    return torch.get_num_threads()


# ------------------------------------------------------------------------------ text input
def check_text_arg(value: str | None, name: str) -> str | None:
    """A text argument (a prompt) as valid Unicode. Python decodes argv bytes that are not
    UTF-8 into lone surrogates (PEP 383); sending those on would fail deep inside the tokenizer,
    so name the argument and the first bad byte instead."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = value[e.start]
        what = (f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF
                else f"lone surrogate U+{ord(bad):04X}")
        raise ValueError(f"{name} is not valid UTF-8 text ({what} at character {e.start}); "
                         "pass the prompt in UTF-8") from None
    return value
