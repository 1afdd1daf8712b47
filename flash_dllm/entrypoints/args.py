"""Command-line arguments in one place: ``EngineArgs`` (model, device, engine knobs) and the
sampling flags. The knobs' flags are generated from ``EngineConfig`` / ``SamplingParams``
(``flash_dllm/knobs.py``): name, type, default, choices and help are written once, on the field.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from flash_dllm.config import AUTO_GPU_MEMORY_UTILIZATION, EngineConfig, SamplingParams
from flash_dllm.defaults import SamplingDefaults
from flash_dllm.knobs import Knob, knobs

_CONFIG_DEFAULTS = {k.name: k.default for k in knobs(EngineConfig)}


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


# ------------------------------------------------------------------------------ knob flags
def add_knob_flags(group, cls: type, defaults: dict | None = None,
                   described: dict[str, str] | None = None) -> None:
    """One flag per knob of the config class ``cls`` that has one (``knob(cli=True)``).

    Args:
        group: the parser or argument group that gets the flags.
        cls: a dataclass whose fields are ``knob()``s (``SamplingParams``, ``EngineConfig``).
        defaults: a command's own defaults, by field name (``serve`` turns prefix reuse on).
        described: flags left None for the command to fill in, by field name, with the text
            their help shows as the default.
    """
    for k in knobs(cls):
        if k.cli:
            _add_knob_flag(group, k, defaults, described)


def _add_knob_flag(group, k: Knob, defaults: dict | None = None,
                   described: dict[str, str] | None = None) -> None:
    defaults, described = defaults or {}, described or {}
    default = None if k.name in described else defaults.get(k.name, k.default)
    help = k.help
    if k.name in described and help is not None:
        help = help.replace("%(default)s", described[k.name])
    if k.type is bool and k.flag_name.startswith("--no-"):
        # a single off switch for a knob on by default (--no-early-stop)
        group.add_argument(k.flag_name, dest=k.name, action="store_false", default=default,
                           help=help)
    elif k.type is bool:
        group.add_argument(k.flag_name, dest=k.name, action=argparse.BooleanOptionalAction,
                           default=default, help=help)
    else:
        # NOTE: choices are read here, when the parser is built: a decode policy or cache mode
        # registered after import is a valid value of a parser built after it
        group.add_argument(k.flag_name, dest=k.name, type=k.type, default=default,
                           choices=None if k.choices is None else list(k.choices), help=help)


def knob_values(ns: argparse.Namespace, cls: type) -> dict:
    """The values of ``cls``' knob flags parsed into ``ns``, by field name."""
    return {k.name: getattr(ns, k.name) for k in knobs(cls) if k.cli}


def _with_config_knobs(after: str):
    """Class decorator (under ``@dataclass``): a field per ``EngineConfig`` knob with a flag,
    inserted after the field ``after``, with the knob's annotation, default and metadata."""
    def wrap(cls):
        config = {f.name: f for f in dataclasses.fields(EngineConfig)}
        annotations = {}
        for name, annotation in cls.__dict__["__annotations__"].items():
            annotations[name] = annotation
            if name == after:
                for k in knobs(EngineConfig):
                    if k.cli:
                        annotations[k.name] = config[k.name].type
                        setattr(cls, k.name, field(default=k.default,
                                                   metadata=config[k.name].metadata))
        cls.__annotations__ = annotations
        return cls
    return wrap


@dataclass
@_with_config_knobs(after="threads")
class EngineArgs:
    """What loads an engine: the checkpoint, the device, and ``EngineConfig``'s knobs (one field
    per knob with a flag, after ``threads``; ``kv_cache_gb`` may also be None, see
    ``kv_sizing``)."""

    model: str | None = field(default=None, metadata={
        "type": str, "help": "checkpoint folder (Hugging Face layout), or a name: demo (the "
                             "shipped model, the default), proxy-llada, proxy-dream, "
                             "proxy-llada2 (the repository's checkpoints/)"})
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
                "when other processes share the machine, serve included: on a shared 2-core "
                "VM, serve with 1 thread answered 16 concurrent clients at 32-34 req/s against "
                "23-30 with 2, benchmarks/results/serving/serve_threads_cpu.json; elsewhere "
                "torch's own choice)"})
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
        config = {k.name: k for k in knobs(EngineConfig)}
        for f in dataclasses.fields(cls):
            if f.name in config:
                _add_knob_flag(g, config[f.name], defaults)
            else:
                g.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                               type=f.metadata["type"], default=defaults.get(f.name, f.default),
                               choices=f.metadata.get("choices"), help=f.metadata["help"])
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
# what the default mode costs in accuracy, from the committed reports (docs/sampling.md#the-
# default-mode: benchmarks/results/accuracy/eval_chat_*_h200.json, eval_exact_*_h200.json,
# benchmarks/results/verify/eval_*_dual_b1_h200.json, pareto_*_h200.json)
DEFAULT_MODE_EVIDENCE = (
    "Measured, threshold 0.99 + dual against the exact sampler (greedy): demo model arith 98.5% "
    "vs 96.8%, code 99.0% vs 99.8% (CPU, n = 200) in 2.2-2.7 forwards per answer instead of "
    "32-64; trained proxies' 256-token answers (H200, n = 50) LLaDA chain 86% vs 87.5%, "
    "code-long 100% vs 99%, Dream chain 64% vs 64%, code-long 94% vs 96.5%, in 18-57 forwards "
    "instead of 256. --threshold 0.9 saves 15-30% more forwards but is 3.5-14.5 points below "
    "exact on the proxies (docs/sampling.md#the-default-mode)")
# the sampling flags' group: where a knob left out comes from (flash_dllm/defaults.py)
SAMPLING_GROUP = ("sampling (mirrors SamplingParams)",
                  "A flag left out comes from the checkpoint's generation_config.json, else the "
                  "recommended default: threshold decoding at 0.99 with the model family's fast "
                  "cache, dual for LLaDA / Dream, the exact block cache for block-causal "
                  "families. Exact reference sampler: --decode vanilla --cache none. "
                  + DEFAULT_MODE_EVIDENCE + ".")


def add_sampling_flags(p: argparse.ArgumentParser, max_tokens_default: str | None = None,
                       cls: type = SamplingParams,
                       group: tuple[str, str] = SAMPLING_GROUP) -> None:
    """The sampling flags, one per knob of ``cls``, all None when not given (a flag given is a
    layer above the checkpoint's generation_config.json: ``flash_dllm.defaults``); the help
    shows the knob's own default. ``max_tokens_default`` (a description): what --max-tokens
    falls back to instead, as ``eval`` fills it in from the suite. ``group``: the help's
    (title, description)."""
    g = p.add_argument_group(*group)
    described = {k.name: str(k.default) for k in knobs(cls) if k.cli}
    if max_tokens_default is not None:
        described["max_tokens"] = max_tokens_default
    add_knob_flags(g, cls, described=described)


def sampling_flags(a: argparse.Namespace, cls: type = SamplingParams) -> dict:
    """The sampling flags given (``add_sampling_flags``), by knob name; a namespace without
    some of them (a benchmark's) gives what it has."""
    return {k.name: getattr(a, k.name) for k in knobs(cls)
            if k.cli and getattr(a, k.name, None) is not None}


def sampling_from_args(a: argparse.Namespace, cls: type = SamplingParams,
                       defaults: SamplingDefaults | None = None, **override) -> SamplingParams:
    """``cls`` (``SamplingParams``) from the flags ``add_sampling_flags`` added, with
    ``override``'s values instead of some, over ``defaults`` (the checkpoint's
    generation_config.json: ``LLM.sampling_defaults``) for the flags not given."""
    request = {**sampling_flags(a, cls), **override}
    return (defaults or SamplingDefaults()).params(request, cls)


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
