"""Starting a tensor-parallel engine: rank 0 here, ranks 1..N-1 in worker processes (one per GPU),
or every rank under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` in the environment). The ranks'
devices, process groups and processes: ``distributed/launch.py``.
"""
from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as dist

from flash_dllm.distributed.launch import init_groups, rank_device, spawn_ranks

def check_supported(config) -> None:
    """Refuse, before any rank starts, what tensor parallelism does not support yet."""
    if config.kv_cpu_gb or config.kv_disk_path or config.kv_tier_stress:
        raise ValueError("KV tiers (--kv-cpu-gb / --kv-disk-path) are not supported with "
                         "tensor_parallel_size > 1 yet: the ranks' offload copies finish at "
                         "different times, so their schedules could differ; prefix reuse in "
                         "GPU memory works")
    if config.kv_overflow_gb:
        raise ValueError("--kv-overflow-gb (requests larger than the GPU pool) is not supported "
                         "with tensor_parallel_size > 1 yet")


def _load(args, tp, dev):
    """(engine model, cfg, tokenizer, folder) of this rank's shard."""
    from flash_dllm.models.loader import load_model, model_path
    from flash_dllm.models.tokenizer import Tokenizer

    folder = model_path(args.model)
    model, cfg = load_model(folder, device=dev, dtype=args.dtype, tp=tp)
    tok = Tokenizer(folder)
    return model, tok.resolve_ids(cfg), tok, folder


def _worker(rank: int, world: int, init_method: str, args, config_override: dict) -> None:
    """A spawned rank of ``launch``: load this rank's shard and follow rank 0."""
    from flash_dllm.engine.engine import Engine
    from flash_dllm.engine.tp_engine import follow

    dev = rank_device(args.device, rank, world)
    tp, control = init_groups(rank, world, init_method, dev)
    try:
        model, cfg, _, _ = _load(args, tp, dev)
        engine = Engine(model, cfg, args.engine_config(**config_override))
        follow(engine, control)
    finally:
        dist.destroy_process_group()


def launch(args, world: int, **config_override):
    """Rank 0 of a new group of ``world`` ranks (the others are spawned here):
    (``TPEngine``, tokenizer, checkpoint folder).

    The other ranks are fresh interpreters (``spawn_ranks``)."""
    from flash_dllm.distributed.tp import check_divisible
    from flash_dllm.engine.tp_engine import TPEngine
    from flash_dllm.models.loader import model_path, read_config

    folder = model_path(args.model)
    _, cfg, _ = read_config(folder)
    check_divisible(cfg, world)
    check_supported(args.engine_config(**config_override))
    rank_device(args.device, 0, world)                    # fail before spawning anything
    procs, init_method = spawn_ranks(world, _worker, args, config_override)
    threads = torch.get_num_threads()            # restored by TPEngine.close
    try:
        dev = rank_device(args.device, 0, world)
        tp, control = init_groups(0, world, init_method, dev)
        model, cfg, tok, folder = _load(args, tp, dev)
        engine = TPEngine(model, cfg, args.engine_config(**config_override), control)
    except BaseException:
        for p in procs:
            p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
        raise
    engine.workers = procs
    engine.threads = threads
    atexit.register(engine.close)
    return engine, tok, folder


def from_environment(args, **config_override):
    """Under ``torchrun``: rank 0 gets (``TPEngine``, tokenizer, checkpoint folder); every other
    rank follows rank 0 until it stops, then exits the process."""
    from flash_dllm.distributed.tp import check_divisible
    from flash_dllm.engine.engine import Engine
    from flash_dllm.engine.tp_engine import TPEngine, follow
    from flash_dllm.models.loader import model_path, read_config

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = args.engine_config(**config_override)
    check_supported(config)
    folder = model_path(args.model)
    check_divisible(read_config(folder)[1], world)
    dev = rank_device(args.device, int(os.environ.get("LOCAL_RANK", rank)), world)
    tp, control = init_groups(rank, world, "env://", dev)
    model, cfg, tok, folder = _load(args, tp, dev)
    if rank != 0:
        follow(Engine(model, cfg, config), control)
        dist.destroy_process_group()
        sys.exit(0)
    engine = TPEngine(model, cfg, config, control)
    atexit.register(engine.close)
    return engine, tok, folder

