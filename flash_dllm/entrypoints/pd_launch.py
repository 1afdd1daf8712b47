"""Starting prefill/decode disaggregation: the worker processes and the front end that drives them.

``launch`` spawns ``P + D`` workers (fresh interpreters, ``distributed/launch.spawn``), each
running ``worker_main``: join the KV transport's process group, load the engine (a checkpoint or
a random-init shape), warm it up, say hello on the control connection, then serve the front end
(``disagg/worker.Worker``). The front end is ``disagg/router.PDEngine``.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Listener

import torch

from flash_dllm.disagg.messages import Channel
from flash_dllm.disagg.router import DECODE, PREFILL, PDEngine, WorkerHandle
from flash_dllm.disagg.worker import Worker
from flash_dllm.engine.engine import Engine
from flash_dllm.entrypoints.args import is_cuda


def launch(args, prefill_workers: int = 1, decode_workers: int = 1, *,
           timeout_s: float = 30.0, staging_gb: float = 0.25, role_switching: bool = False,
           model_shape: str | None = None, warmup: str = "none",
           backend: str | None = None, layer_groups: int = 1,
           **config_override) -> PDEngine:
    """Spawn the workers (ranks 0..P-1 prefill, P..P+D-1 decode). Devices: the CPU for all,
    or GPU ``rank % visible`` each. KV transport (``backend``; default by devices): gloo on the
    CPU, NCCL when every worker has its own GPU, CUDA IPC when workers share a GPU (the decode
    worker unpacks straight from the prefill worker's staging buffer); ``backend="nixl"``: NIXL
    (UCX) one-sided writes between workers, e.g. across hosts."""
    from flash_dllm.distributed.launch import free_port, spawn
    from flash_dllm.models.loader import model_path, read_config

    for name, n in (("prefill_workers", prefill_workers), ("decode_workers", decode_workers)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    if isinstance(layer_groups, bool) or not isinstance(layer_groups, int) \
            or not 1 <= layer_groups <= 16:
        raise ValueError(f"layer_groups must be an integer in [1, 16], got {layer_groups!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not staging_gb > 0:
        raise ValueError(f"staging_gb (--pd-staging-gb) must be > 0, got {staging_gb!r}")
    if args.tensor_parallel_size != 1:
        raise ValueError("disaggregation with tensor_parallel_size > 1 is not supported yet")
    config = args.engine_config(**config_override)
    if config.kv_cpu_gb or config.kv_disk_path:
        raise ValueError("KV tiers (--kv-cpu-gb / --kv-disk-path) are not supported with "
                         "--disaggregate yet")
    if config.kv_overflow_gb:
        raise ValueError("--kv-overflow-gb (requests larger than the GPU pool) is not supported "
                         "with --disaggregate yet")
    if model_shape:
        from flash_dllm.bench.shapes import shape_config
        from flash_dllm.models import registry
        raw = shape_config(model_shape)
        cfg = registry.resolve(raw).parse_config(raw)
    else:
        folder = model_path(args.model)
        _, cfg, _ = read_config(folder)
    world = prefill_workers + decode_workers
    devices = ["cpu"] * world
    if is_cuda(args.device):
        n = torch.cuda.device_count()
        if n < 1:
            raise ValueError(f"device {args.device!r}: no CUDA device is visible")
        devices = [f"cuda:{r % n}" for r in range(world)]
    if backend is None:            # NCCL needs a GPU per rank; workers sharing one read
        backend = ("gloo" if devices[0] == "cpu"     # each other's staging over CUDA IPC
                   else "nccl" if len(set(devices)) == world else "ipc")
    if backend not in ("gloo", "nccl", "ipc", "nixl"):
        raise ValueError(f"backend must be gloo, nccl, ipc or nixl, got {backend!r}")
    if backend == "nixl":
        from flash_dllm.distributed.nixl_transport import nixl_available
        if not nixl_available():
            raise ValueError("the NIXL transport needs `pip install nixl` (it does not import)")
    if backend == "ipc" and devices[0] == "cpu":
        raise ValueError("the CUDA IPC transport needs CUDA devices")
    authkey = os.urandom(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    init = f"tcp://127.0.0.1:{free_port()}"
    workers = []
    for r in range(world):
        spec = WorkerSpec(rank=r, world=world, init_method=init, address=listener.address,
                          authkey=authkey, args=args,
                          # serve's auto KV sizing: workers sharing a GPU split its memory
                          config_override={**args.kv_sizing(share=devices.count(devices[r])),
                                           **config_override},
                          device=devices[r], backend=backend, timeout_s=timeout_s,
                          staging_bytes=max(1 << 20, int(staging_gb * 2**30)),
                          warmup=warmup, model_shape=model_shape, layer_groups=layer_groups)
        workers.append(WorkerHandle(r, PREFILL if r < prefill_workers else DECODE,
                                  spawn(worker_main, spec)))
    controller = None
    if role_switching:
        from flash_dllm.disagg.roles import RoleController
        controller = RoleController()
    eng = PDEngine(cfg, config, workers, listener, timeout_s, controller,
                   layer_groups=layer_groups if backend != "ipc" else 1)
    eng.backend = backend
    eng.start_accepting()
    return eng


@dataclass
class WorkerSpec:
    """What a spawned worker needs (pickled to it by the front end)."""

    rank: int
    world: int
    init_method: str
    address: tuple
    authkey: bytes
    args: object                      # EngineArgs
    config_override: dict = field(default_factory=dict)
    device: str = "cpu"
    backend: str = "gloo"             # the KV transport's; "ipc": CUDA IPC (+ a gloo group)
    timeout_s: float = 30.0
    staging_bytes: int = 64 << 20
    warmup: str = "none"
    model_shape: str | None = None
    layer_groups: int = 1


def worker_main(spec: WorkerSpec) -> None:
    """A spawned worker process (``distributed/launch.spawn``): join the KV transport's group,
    load the engine, say hello, serve the front end until it says stop."""
    from datetime import timedelta
    from multiprocessing.connection import Client

    import torch.distributed as dist

    from flash_dllm.distributed.torch_transport import TorchDistTransport

    dev = torch.device(spec.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        share = max(1, (os.cpu_count() or 1) // max(1, spec.world))
        torch.set_num_threads(min(torch.get_num_threads(), share))
    conn = Channel(Client(spec.address, authkey=spec.authkey))
    transport = None
    try:
        ipc, nixl = spec.backend == "ipc", spec.backend == "nixl"
        backend = "gloo" if ipc else spec.backend
        if nixl:                         # one-sided WRITEs over UCX; no process group needed
            from flash_dllm.distributed.nixl_transport import NixlTransport
            transport = NixlTransport(spec.rank, spec.world)
        else:
            dist.init_process_group(backend, init_method=spec.init_method, rank=spec.rank,
                                    world_size=spec.world,
                                    timeout=timedelta(seconds=max(300, 4 * spec.timeout_s)))
            transport = TorchDistTransport(device=dev if backend == "nccl" else "cpu")
        engine = _load(spec, dev)
        wire = dev if backend == "nccl" or ipc else torch.device("cpu")
        worker = Worker(engine, transport, conn, timeout_s=spec.timeout_s,
                        staging_bytes=spec.staging_bytes, wire_device=wire, ipc=ipc,
                        layer_groups=spec.layer_groups)
        _warm_up(engine, spec.warmup)
        share = None                     # what the other workers need to reach this one
        if ipc:
            from torch.multiprocessing.reductions import reduce_tensor
            share = ("ipc", reduce_tensor(worker.staging)[1])
        elif nixl:                       # registered before the metadata goes out
            transport.register(worker.staging)
            share = ("nixl", transport.metadata())
        conn.send(("ready", spec.rank, os.getpid(), engine.pool.num_pages, engine.pool.page_size,
                   engine.config.max_num_seqs, share))
        worker.run()
    except BaseException:     # noqa: BLE001 - the front end must hear why
        try:
            conn.send(("error", spec.rank, traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        if transport is not None and spec.backend == "nixl":
            transport.close()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _load(spec: WorkerSpec, dev: torch.device) -> Engine:
    import dataclasses

    from flash_dllm.entrypoints.loader import load_engine, load_random_engine

    args = dataclasses.replace(spec.args, device=str(dev), tensor_parallel_size=1)
    if spec.model_shape:
        return load_random_engine(spec.model_shape, args, **spec.config_override).engine
    return load_engine(args, **spec.config_override).engine


def _warm_up(engine: Engine, level: str) -> None:
    from flash_dllm.worker.warmup import filler, level_of, warm_up
    if not level_of(level).runs:
        return

    warm_up(engine, level, filler(engine.cfg, range(5, 200)), lambda line: None)

