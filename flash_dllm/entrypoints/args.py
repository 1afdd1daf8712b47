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


def _knob(name: str, kind, help: str, **extra):
    """A field of ``EngineArgs`` mirroring ``EngineConfig.<name>`` (same default)."""
    return field(default=_CONFIG_DEFAULTS[name], metadata={"type": kind, "help": help, **extra})


@dataclass
class EngineArgs:
    """What loads an engine: the checkpoint, the device, and ``EngineConfig``'s knobs."""

    model: str | None = field(default=None, metadata={
        "type": str, "help": "checkpoint folder (Hugging Face layout); default: the shipped demo "
                             "model"})
    device: str = field(default="cpu", metadata={
        "type": str, "help": "cpu, cuda, cuda:N or auto (default: %(default)s)"})
    dtype: str = field(default="float32", metadata={
        "type": str, "choices": ["float32", "bfloat16", "float16"],
        "help": "weights and activations (default: %(default)s)"})
    max_num_seqs: int = _knob("max_num_seqs", int, "requests decoded together in one forward "
                                                   "(default: %(default)s)")
    page_size: int = _knob("page_size", int, "tokens per KV page (default: %(default)s)")
    kv_cache_gb: float = _knob("kv_cache_gb", float,
                               "KV page pool size in GiB; requests are admitted while their "
                               "pages fit (default: %(default)s)")
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
    kv_placement: str = _knob("kv_placement", str,
                              "which cached pages leave a tier first (default: %(default)s)",
                              choices=["lru"])
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

    def engine_config(self, **override) -> EngineConfig:
        names = set(_CONFIG_DEFAULTS)
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}
        kw.update(override)
        return EngineConfig(**kw)


# --------------------------------------------------------------------------------- sampling
def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling (mirrors SamplingParams)")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="MASK slots after the prompt (default: %(default)s)")
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
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-early-stop", action="store_true",
                   help="decode every block even after the answer ended")


def sampling_from_args(a: argparse.Namespace, **override) -> SamplingParams:
    kw = dict(max_tokens=a.max_tokens, block_length=a.block_length, steps=a.steps,
              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, decode=a.decode,
              cache=a.cache, threshold=a.threshold, seed=a.seed, early_stop=not a.no_early_stop,
              gamma=a.gamma, verify_rule=a.verify_rule, max_verify=a.max_verify,
              entropy_max=a.entropy_max, perturb_sigma=a.perturb_sigma,
              kv_jaccard_min=a.kv_jaccard_min, kv_top_k=a.kv_top_k, flash_budget=a.flash_budget)
    kw.update(override)
    return SamplingParams(**kw)

