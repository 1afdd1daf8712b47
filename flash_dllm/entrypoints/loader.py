"""``load_engine``: the one way every entry point (``LLM``, ``serve``, ``eval``, ``bench serve``)
turns a checkpoint folder and ``EngineArgs`` into a ready engine and its tokenizer."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flash_dllm.engine.engine import Engine
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.calibration import calibrate_as_configured
from flash_dllm.models.ckpt_quant import checkpoint_quantization
from flash_dllm.models.loader import load_model, model_path, read_config, resolve_device
from flash_dllm.models.tokenizer import Tokenizer


@dataclass
class LoadedEngine:
    engine: Engine
    tokenizer: Tokenizer
    folder: Path           # the checkpoint folder (its name is the default served model name)


def load_engine(args: EngineArgs | None = None, **config_override) -> LoadedEngine:
    """Load ``args.model`` (default: the shipped demo model) on ``args.device`` and build its
    engine; ``config_override`` replaces ``EngineConfig`` fields."""
    args = args or EngineArgs()
    world = tensor_parallel_world(args)
    quant = config_override.get("quantization", args.quantization)
    if world == 1:
        # a checkpoint published quantized keeps its mode unless told otherwise (as vLLM), and
        # an int4 one its group size (its codes are then used as stored: layers/quant.py)
        folder = model_path(args.model)
        ckq = checkpoint_quantization(read_config(folder)[2], folder)
        if quant is None and ckq is not None:
            quant = ckq.mode
            config_override = {**config_override, "quantization": quant}
        if ckq is not None and ckq.group_size and quant == ckq.mode \
                and config_override.get("quantization_group_size",
                                        args.quantization_group_size) is None:
            config_override = {**config_override, "quantization_group_size": ckq.group_size}
    if world > 1 and quant is not None:
        raise ValueError(f"quantization={quant!r} with tensor_parallel_size={world} is not "
                         "supported yet (each rank's shards would need their own group "
                         "boundaries): use one device")
    if world > 1:
        from flash_dllm.entrypoints import tp_launch
        if "WORLD_SIZE" in os.environ:
            return LoadedEngine(*tp_launch.from_environment(args, **config_override))
        return LoadedEngine(*tp_launch.launch(args, world, **config_override))
    folder = model_path(args.model)
    net, cfg = load_model(folder, device=resolve_device(args.device), dtype=args.dtype)
    tok = Tokenizer(folder)
    cfg = tok.resolve_ids(cfg)
    config = args.engine_config(**config_override)
    calibrate_as_configured(net, tok, cfg, config)       # GPTQ's codes, when asked for
    engine = Engine(net, cfg, config)
    report_weights(engine.runner.weight_info)
    return LoadedEngine(engine, tok, folder)


def report_weights(info: dict) -> None:
    """The start-up line of a quantized model: its stored weight bytes against unquantized."""
    if info.get("quantization") is None:
        return
    group = f", group {info['group_size']}" if info.get("group_size") else ""
    kept = "embeddings and MoE routers" if info.get("lm_head") else \
        "embeddings, LM head and MoE routers"
    print(f"flash-dllm: weights {info['weight_bytes'] / 2**20:.1f} MiB as "
          f"{info['quantization']}{group} ({info['unquantized_bytes'] / 2**20:.1f} MiB "
          f"unquantized; {info['layers']} layers quantized; {kept} kept)", file=sys.stderr,
          flush=True)


def tensor_parallel_world(args: EngineArgs) -> int:
    """The tensor-parallel size: ``args.tensor_parallel_size``, or torchrun's ``WORLD_SIZE``
    (which must then agree with it unless it was left at 1)."""
    n = args.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return n
    world = int(env)
    if n not in (1, world):
        raise ValueError(f"tensor_parallel_size {n} but torchrun started WORLD_SIZE={world} "
                         "ranks: give the same number (or leave --tensor-parallel-size out)")
    return world


def close_engine(engine) -> None:
    """Release what an engine holds beyond memory: a tensor-parallel engine's other ranks
    (idempotent; nothing to do for a single-device engine)."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def load_random_engine(shape: str, args: EngineArgs | None = None, max_len: int | None = None,
                       **config_override) -> LoadedEngine:
    """An engine over a random-init model of a real shape (``llada-8b``, ``dream-7b``, ``demo``)
    with the demo model's tokenizer and chat template: what serving benchmarks time where no
    checkpoint of that size can be shipped (its answers are noise; its costs are real).
    ``max_len``: at least this many positions."""
    from flash_dllm.bench.shapes import shape_config, with_max_len
    from flash_dllm.models.loader import DEMO_MODEL, build_model

    args = args or EngineArgs()
    if tensor_parallel_world(args) > 1:
        raise ValueError("a random-init model (--model-shape) runs on one device: tensor "
                         "parallelism needs a checkpoint folder (--model); for timings of a "
                         "split model use `flash-dllm bench step --tensor-parallel-size N`")
    config = args.engine_config(**config_override)
    if config.quantization_calibration is not None:
        raise ValueError("quantization_calibration fits a checkpoint's weights to its "
                         "activations: a random-init model (--model-shape) has nothing to fit; "
                         "drop --quantization-calibration or load a checkpoint (--model)")
    model = build_model(with_max_len(shape_config(shape), max_len), device=resolve_device(args.device),
                        dtype=args.dtype, seed=0)
    return LoadedEngine(Engine(model, model.cfg, config), Tokenizer(DEMO_MODEL), Path(shape))
