"""``load_engine``: the one way every entry point (``LLM``, ``serve``, ``eval``, ``bench serve``)
turns a checkpoint folder and ``EngineArgs`` into a ready engine and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flash_dllm.engine.engine import Engine
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.models.loader import default_model_path, load_model, resolve_device
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
    folder = Path(args.model) if args.model is not None else default_model_path()
    net, cfg = load_model(folder, device=resolve_device(args.device), dtype=args.dtype)
    tok = Tokenizer(folder)
    cfg = tok.resolve_ids(cfg)
    return LoadedEngine(Engine(net, cfg, args.engine_config(**config_override)), tok, folder)


def load_random_engine(shape: str, args: EngineArgs | None = None,
                       **config_override) -> LoadedEngine:
    """An engine over a random-init model of a real shape (``llada-8b``, ``dream-7b``, ``demo``)
    with the demo model's tokenizer and chat template: what serving benchmarks time where no
    checkpoint of that size can be shipped (its answers are noise; its costs are real)."""
    from flash_dllm.bench.step import shape_config
    from flash_dllm.models.loader import DEMO_MODEL, build_model

    args = args or EngineArgs()
    model = build_model(shape_config(shape), device=resolve_device(args.device),
                        dtype=args.dtype, seed=0)
    return LoadedEngine(Engine(model, model.cfg, args.engine_config(**config_override)),
                        Tokenizer(DEMO_MODEL), Path(shape))
