"""``flash-dllm serve``: load a checkpoint, build the app, run it under uvicorn (SIGTERM drains)."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import signal
import sys

from flash_dllm.config import EngineConfig
from flash_dllm.defaults import SamplingDefaults
from flash_dllm.entrypoints.args import (DEFAULT_MODE_EVIDENCE, CommandError, EngineArgs,
                                         add_sampling_flags, positive_int, sampling_flags)
from flash_dllm.worker.warmup import WARMUP_LEVELS


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_server_flags(s)
    EngineArgs.add_cli_args(s, defaults=SERVE_DEFAULTS)
    add_sampling_flags(s, group=SERVE_SAMPLING_GROUP)
    s.set_defaults(func=run)


SERVE_SAMPLING_GROUP = (
    "request defaults (mirror SamplingParams)",
    "What a request gets for a knob it does not send (a body field wins; a flag left out comes "
    "from the checkpoint's generation_config.json, else the recommended default: threshold "
    "decoding at 0.99 with the model family's fast cache, dual for LLaDA / Dream, the exact block "
    "cache for block-causal families; GET /v1/models shows the result). Exact reference "
    "sampler: --decode vanilla --cache none. " + DEFAULT_MODE_EVIDENCE + ".")


# serving turns prefix reuse on (multi-turn chat reuses its history's KV pages; elsewhere off)
# and sizes the KV pool from the GPU's memory (``EngineArgs.kv_sizing``; elsewhere 1 GiB)
SERVE_DEFAULTS = {"prefix_reuse": True, "kv_cache_gb": None}


def add_server_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=port_number, default=8000, help="TCP port (default: 8000)")
    s.add_argument("--api-key", default=os.environ.get("FLASH_DLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /generate "
                        "(default: $FLASH_DLLM_API_KEY, else none)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the checkpoint folder's name)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="larger request bodies get 413")
    s.add_argument("--drain-timeout", type=_seconds, default=30.0,
                   help="after SIGTERM/SIGINT: seconds in-flight requests get to finish while "
                        "/ready, /health and new requests answer 503 with Retry-After; at the "
                        "limit the rest end with an error (an OpenAI error body; streams an error "
                        "event, then [DONE]) and the server exits (status 0); a second signal "
                        "exits at once, cutting the requests in flight the same way (status "
                        "130) (default: 30)")
    s.add_argument("--strict-params", action="store_true",
                   help="refuse (400) every OpenAI parameter the engine does not use, instead "
                        "of ignoring the harmless ones (user, store, metadata, ...) and "
                        "accepting the others at their neutral value (presence_penalty 0, ...)")
    s.add_argument("--warmup", choices=WARMUP_LEVELS, default=None,
                   help="before /ready says ready, run synthetic batches so that kernels "
                        "compile and CUDA graphs are captured while no request waits; after "
                        "it nothing is captured (a step outside the captured shapes runs "
                        "eagerly). full: the default request and threshold+dual, three prompt "
                        "lengths, and the graphs of every power-of-two batch up to "
                        "--max-num-seqs (5-15 s for the demo model on an H200; the time is "
                        "logged and exported); minimal: the default request and graphs at "
                        "batch 1 and --max-num-seqs only (other batch sizes run eagerly); "
                        "none: start at once, and the first requests of each new shape pay "
                        "the compiles and captures (default: full on a GPU, none on the CPU, "
                        "where nothing compiles)")
    d = s.add_argument_group("prefill/decode disaggregation")
    d.add_argument("--disaggregate", action="store_true",
                   help="run the model in worker processes: prefill workers run each request's "
                        "first forward (prompt + masked canvas) and send its KV to a decode "
                        "worker, which runs the other steps; this process only routes (one "
                        "device per worker: GPU rank %% visible GPUs, or the CPU)")
    d.add_argument("--prefill-workers", type=positive_int, default=1,
                   help="with --disaggregate: prefill worker processes (default: 1)")
    d.add_argument("--decode-workers", type=positive_int, default=1,
                   help="with --disaggregate: decode worker processes (default: 1)")
    d.add_argument("--pd-timeout", type=_positive_seconds, default=30.0,
                   help="with --disaggregate: seconds a KV transfer may take before its request "
                        "(alone) fails (default: 30)")
    d.add_argument("--pd-staging-gb", type=float, default=0.25,
                   help="with --disaggregate: each worker's receive staging buffer in GiB; a "
                        "request's KV must fit it (default: 0.25)")
    d.add_argument("--pd-layer-groups", type=positive_int, default=1,
                   help="with --disaggregate: send a request's KV in this many layer groups "
                        "while its first forward computes the later layers (pipelined; 1: one "
                        "send after the forward; at most 16; not with CUDA IPC, where the "
                        "decode worker reads the segment after the step) (default: 1)")
    d.add_argument("--pd-transport", choices=["auto", "gloo", "nccl", "ipc", "nixl"],
                   default="auto",
                   help="with --disaggregate: how KV moves between workers. auto: gloo on the "
                        "CPU, NCCL with a GPU per worker, CUDA IPC when workers share a GPU; "
                        "nixl: NIXL/UCX one-sided writes (pip install nixl)")
    d.add_argument("--pd-role-switching", action="store_true",
                   help="with --disaggregate: move workers between the prefill and decode roles "
                        "as the load shifts (drained first; at least one of each)")
    s.add_argument("--test-fault-file", default=None, metavar="PATH",
                   help="testing only (the soak, 'bench soak'): whenever the file PATH exists, "
                        "the next engine step raises (as a device fault would) and PATH is "
                        "removed, so one file makes one failed step; not with --disaggregate")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])


def port_number(text: str) -> int:
    """argparse ``type``: a TCP port, 1-65535 (a bad one is a usage error naming --port, not a
    traceback after the model loaded)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port number in 1-65535, got {text!r}")
    return value


def check_port_free(host: str, port: int) -> None:
    """``CommandError`` (exit 1) when ``host:port`` cannot be bound: checked before the model
    loads, so a busy port costs a second, not a load and then uvicorn's own message and status.
    NOTE: a check, not a reservation: another process may still take the port before uvicorn
    binds it (uvicorn then reports it)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CommandError(f"cannot serve on host {host!r}: {e.strerror}", exit_code=2) from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        # as uvicorn binds: SO_REUSEADDR, so a port in TIME_WAIT after a restart is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise CommandError(f"port {port} is in use on {host}") from None
            raise CommandError(f"cannot bind {host}:{port}: {e.strerror or e}") from None


def _positive_seconds(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return v


def _seconds(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text!r}")
    return v


def load_async_engine(model=None, device: str = "cpu", dtype: str = "auto",
                      config: EngineConfig | None = None, args: EngineArgs | None = None):
    """(AsyncEngine, Tokenizer, folder) for a checkpoint folder (default: the demo model), with
    ``config`` replacing the engine knobs; or for parsed ``args``."""
    from flash_dllm.engine.async_engine import AsyncEngine
    from flash_dllm.entrypoints.loader import load_engine

    if args is None:
        args = EngineArgs(model=None if model is None else str(model), device=device, dtype=dtype)
    override = {} if config is None else dataclasses.asdict(config)
    loaded = load_engine(args, **override)
    loaded.engine.isolate_step_failures = True      # a failed step fails its batch, not the server
    return AsyncEngine(loaded.engine), loaded.tokenizer, loaded.folder


def build_server_app(a: argparse.Namespace):
    """(app, async engine, served model name) from parsed ``serve`` flags."""
    from flash_dllm.server.app import build_app

    shape = getattr(a, "model_shape", None)
    flags = sampling_flags(a)
    SamplingDefaults.of(flags).params()   # bad flags fail before the model loads
    if getattr(a, "disaggregate", False):
        aeng, tok, folder = load_disaggregated(a, shape)
    elif shape:                        # benchmarks: a random-init model of a real shape
        from flash_dllm.engine.async_engine import AsyncEngine
        from flash_dllm.entrypoints.loader import load_random_engine
        loaded = load_random_engine(shape, EngineArgs.from_cli_args(a),
                                    max_len=getattr(a, "model_max_len", None))
        loaded.engine.isolate_step_failures = True
        aeng, tok, folder = AsyncEngine(loaded.engine), loaded.tokenizer, loaded.folder
    else:
        aeng, tok, folder = load_async_engine(args=EngineArgs.from_cli_args(a))
    # what a request gets for the knobs it leaves out: the flags given, then the checkpoint's
    # generation_config.json, then the recommended defaults (flash_dllm/defaults.py)
    defaults = SamplingDefaults.of(flags, None if shape else folder, flags_source="serve flags",
                                   model_block=aeng.engine.cfg.attention.block_size or None)
    default = defaults.params()
    try:                                  # e.g. --cache block for a bidirectional model
        aeng.engine.validate([0], default)
    except ValueError as e:
        raise ValueError(f"the default request (serve's sampling flags, the checkpoint's "
                         f"generation_config.json) cannot run on this model: {e}") from None
    if not getattr(a, "disaggregate", False):
        attach_warmup(aeng, tok, getattr(a, "warmup", None), default)
        if getattr(a, "test_fault_file", None):
            arm_step_fault_file(aeng.engine, a.test_fault_file)
    elif getattr(a, "test_fault_file", None):
        raise CommandError("--test-fault-file is not supported with --disaggregate")
    name = getattr(a, "served_model_name", None) or folder.name
    app = build_app(aeng, tok, name, api_key=a.api_key,
                    max_body_bytes=getattr(a, "max_body_bytes", 1 << 20),
                    strict_params=getattr(a, "strict_params", False),
                    drain_timeout=getattr(a, "drain_timeout", 30.0),
                    sampling_defaults=defaults)
    return app, aeng, name


def load_disaggregated(a: argparse.Namespace, shape: str | None = None):
    """(AsyncEngine over a ``PDEngine``, tokenizer, folder) from parsed ``serve`` flags. The
    workers load (and warm up) in their own processes: the engine is ready once all are."""
    from pathlib import Path

    from flash_dllm.engine.async_engine import AsyncEngine
    from flash_dllm.entrypoints.pd_launch import launch
    from flash_dllm.models.loader import DEMO_MODEL, model_path, resolve_device
    from flash_dllm.models.tokenizer import Tokenizer
    from flash_dllm.worker.warmup import default_level

    args = EngineArgs.from_cli_args(a)
    level = getattr(a, "warmup", None) or default_level(resolve_device(args.device))
    _log_warnings("flash_dllm.disagg")       # a lost worker: one line on stderr, at once
    pd = launch(args, a.prefill_workers, a.decode_workers, timeout_s=a.pd_timeout,
                         staging_gb=a.pd_staging_gb, role_switching=a.pd_role_switching,
                         model_shape=shape, warmup=level, layer_groups=a.pd_layer_groups,
                         backend=None if a.pd_transport == "auto" else a.pd_transport)
    folder = Path(shape) if shape else model_path(args.model)
    tok = Tokenizer(DEMO_MODEL if shape else folder)
    aeng = AsyncEngine(pd)

    def wait_workers(engine):
        print(f"flash-dllm: starting {a.prefill_workers} prefill + {a.decode_workers} decode "
              "worker(s)", file=sys.stderr, flush=True)
        engine.wait_ready()
        print("flash-dllm: every worker is ready", file=sys.stderr, flush=True)

    aeng.set_warmup(wait_workers)
    return aeng, tok, folder


def _log_warnings(name: str) -> None:
    """Logger ``name``'s warnings on stderr as uvicorn prints its own ("WARNING:  ..."), unless
    logging is configured already (a handler on the way up: the user's, or pytest's)."""
    logger = logging.getLogger(name)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:  %(message)s"))
        logger.addHandler(handler)


def arm_step_fault_file(engine, path: str) -> None:
    """``--test-fault-file``: wrap the runner's ``execute`` (the seam tests/test_step_failures.py
    injects faults at) so that a step raises once per appearance of the file at ``path``. Off
    unless the flag is given; then one ``stat`` per step."""
    real = engine.runner.execute

    def execute(plan):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return real(plan)
        raise RuntimeError(f"injected step fault (--test-fault-file {path})")
    engine.runner.execute = execute


WARMUP_TEXT = ("The quick brown fox jumps over the lazy dog. Ivy has 23 pens; Vic has 12 fewer. "
               "How many pens do they have in all? ")


def attach_warmup(aeng, tokenizer, level: str | None, default=None) -> str:
    """Give the async engine its warm-up (``worker/warmup.py``); ``level`` None: the device's
    default; ``default``: the ``SamplingParams`` a request without knobs gets. Returns the
    level."""
    from flash_dllm.worker.warmup import default_level, filler, level_of, warm_up

    level = level or default_level(aeng.engine.runner.device)
    if not level_of(level).runs:
        return level
    filler_ids = filler(aeng.engine.cfg, tokenizer.encode(WARMUP_TEXT))

    def log(line: str) -> None:
        print(f"flash-dllm: {line}", file=sys.stderr, flush=True)

    def run_warmup(engine):
        log(f"warming up ({level}): compiling kernels and capturing CUDA graphs before ready")
        rep = warm_up(engine, level, filler_ids, log, default)
        log(f"ready after a {rep.seconds:.1f} s warm-up ({rep.cases} cases, "
            f"{rep.kernel_compiles} kernel compiles, {rep.graph_captures} graph captures"
            + (f"; skipped {len(rep.skipped)}: {rep.skipped[0]}" if rep.skipped else "") + ")")
        return rep

    aeng.set_warmup(run_warmup)
    return level


def run(a: argparse.Namespace) -> int:
    from flash_dllm.server.launch import make_uvicorn_server

    check_port_free(a.host, a.port)
    app, aeng, name = build_server_app(a)
    if a.host not in ("127.0.0.1", "localhost", "::1") and a.api_key is None:
        print(f"warning: serving on {a.host} without --api-key", file=sys.stderr)
    snap = aeng.stats
    what = (f"{a.prefill_workers} prefill + {a.decode_workers} decode workers"
            if getattr(a, "disaggregate", False) else
            f"{snap.pages_total} KV pages of {snap.page_size} tokens = "
            f"{snap.pages_total * snap.page_size} tokens, KV dtype {aeng.config.kv_cache_dtype})")
    print(f"flash-dllm: serving '{name}' on http://{a.host}:{a.port} ({what}, "
          f"max_num_seqs={aeng.config.max_num_seqs})", file=sys.stderr, flush=True)
    server = make_uvicorn_server(app, aeng, a.host, a.port, a.log_level)
    # NOTE: uvicorn handles SIGTERM / SIGINT while it serves, then puts back the handlers it
    # found, and the interpreter's exit puts back the system's (its own finalisation takes a
    # few tenths of a second): a signal that came while the process wound down, its drain
    # over, killed it (status -15). After the drain such a signal changes nothing (the
    # shutdown under way is the one asked for): ignored while uvicorn returns, then SIG_IGN,
    # which the interpreter's exit leaves in place
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if server.interrupted_at is not None:
        print("error: interrupted (a second signal): the requests in flight were cut",
              file=sys.stderr)
        return 130
    return 0
