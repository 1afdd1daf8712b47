"""Strict safetensors loading and writing of checkpoints in their Hugging Face layout."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from flash_dllm.models import registry
from flash_dllm.models.ckpt_quant import (Dequantizer, quantized_reader, read_weight,
                                          write_packed)
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, Piece, as_id_tuple

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it is; the message says what is wrong."""


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """``dtype`` as a torch dtype; ``"auto"``: bfloat16 on a CUDA ``device`` (the checkpoints'
    own dtype; float32 there runs its GEMMs without tensor cores, slower), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dev = torch.device(device) if device is not None else torch.device("cpu")
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES) + ['auto']}, got {dtype!r}")
    return _DTYPES[dtype]


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number",
               bool: "a boolean", type(None): "null"}


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file, which must hold an object (``{...}``)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
                              f"offset {e.start}): is it really a JSON file?") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds {_JSON_TYPES.get(type(data), 'a value')}, not a JSON "
                              "object ({\"key\": value, ...}) as a checkpoint's JSON files do")
    return data


def read_config(folder: str | os.PathLike) -> tuple[Family, ModelConfig, dict]:
    """(family, normalised config, raw config.json) of a checkpoint folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"{folder} is a file, not a checkpoint folder: a checkpoint is a "
                              "folder holding config.json and its weights (model.safetensors, "
                              "or model.safetensors.index.json and its shards)")
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"checkpoint folder {folder} has no config.json")
    raw = read_json(cfg_path)
    family = registry.resolve(raw)
    cfg = family.parse_config(raw)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file():
        gen = read_json(gen_path)
        # NOTE: instruct checkpoints list end-of-turn ids here (LLaDA's <|eot_id|>); they end answers.
        cfg = _with(cfg, eos_token_ids=as_id_tuple(cfg.eos_token_ids, gen.get("eos_token_id")))
    return family, cfg, raw


def _with(cfg: ModelConfig, **changes) -> ModelConfig:
    from dataclasses import replace
    return replace(cfg, **changes)


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f.name} listed in {index.name} is missing from {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")):
        raise CheckpointError(f"{folder} holds only PyTorch .bin weights; flash-dllm reads safetensors "
                              "(model.safetensors or model.safetensors.index.json + shards)")
    raise FileNotFoundError(f"no weights in {folder}: expected model.safetensors or "
                            "model.safetensors.index.json with its shards")


@contextmanager
def _open_weights(path: Path):
    """``safe_open`` with an unreadable file (truncated download, not safetensors) reported
    as a ``CheckpointError`` naming it."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}): truncated or "
                              "corrupt? Download it again") from None


def build_model(cfg: ModelConfig | dict, device: str | torch.device = "cpu",
                dtype: str | torch.dtype = torch.float32, init: bool = True,
                seed: int | None = None, tp=None) -> nn.Module:
    """The family's model of this config (a ``config.json`` dict, or a ``ModelConfig`` whose
    ``arch`` names a registered family); random weights when ``init`` (else uninitialised
    memory). ``tp`` (``distributed.tp.TPGroup``): only this rank's shard is ever allocated."""
    if isinstance(cfg, dict):
        family = registry.resolve(cfg)
        cfg = family.parse_config(cfg)
    else:
        family = registry.by_name(cfg.arch)
    dtype = parse_dtype(dtype, device)
    model = family.build(cfg, "meta", dtype)
    if tp is not None and tp.world > 1:
        from flash_dllm.distributed.tp import shard_model
        shard_model(model, tp)
    model = model.to_empty(device=device)
    if init:
        model.init_weights(seed=seed)
    return model.eval()


def load_model(folder: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32,
               tp=None) -> tuple[nn.Module, ModelConfig]:
    """Load a checkpoint folder strictly: every tensor must map, fit and be present. ``tp``
    (``distributed.tp.TPGroup``): read only this rank's slice of each sharded tensor."""
    folder = Path(folder)
    family, cfg, raw = read_config(folder)
    files = weight_files(folder)
    # the headers, read once, when a check or a quantized layout needs the names up front
    names = ({p: tensor_names([p]) for p in files}
             if family.check_tensors or "quantization_config" in raw else {})
    deq = quantized_reader(folder, raw, names, tp)
    if family.check_tensors is not None:       # before anything is allocated
        why = family.check_tensors(cfg, [n for ns in names.values() for n in ns
                                         if deq is None or not deq.hidden(n)])
        if why is not None:
            raise CheckpointError(f"{folder}: {why}")
    model = build_model(cfg, device=device, dtype=dtype, init=False, tp=tp)
    sharded = tp is not None and tp.world > 1
    if sharded:
        from flash_dllm.distributed.tp import shard_slices
    params = dict(model.named_parameters())
    # the full (unsharded) shape of each parameter: checkpoint tensors map to full shapes
    full_shapes = {ours: tuple(p.shape) for ours, p in params.items()}
    if sharded:
        full_shapes.update(model.tp.full_shapes)
    # what each checkpoint tensor fills: (engine parameter, piece) pairs, from the engine side,
    # so the set of tensors a checkpoint must hold is known before any is read
    plan: dict[str, list[tuple[str, Piece]]] = {}
    for ours in params:
        for piece in family.pieces(ours, full_shapes[ours], cfg):
            plan.setdefault(piece.ckpt, []).append((ours, piece))
    seen: set[str] = set()
    unexpected: list[str] = []
    for path in files:
        with _open_weights(path) as f:
            for stored in f.keys():
                if deq is not None and deq.hidden(stored):
                    continue
                name = stored if deq is None else deq.param_name(stored)
                targets = plan.get(name)
                if targets is None:
                    unexpected.append(name)
                    continue
                if sharded:
                    handle = f.get_slice(name)
                    _check_shape(name, path, tuple(handle.get_shape()), targets[0][1].shape)
                    for ours, piece in targets:
                        full = full_shapes[ours]
                        sl = shard_slices(ours, full, cfg, tp)
                        part = local_piece(piece, full, sl)
                        if part is None:            # another rank's (another rank's expert)
                            continue
                        dest, src = part
                        p = params[ours]
                        with torch.no_grad():
                            target = p[dest]
                            target.copy_(handle[src].reshape(target.shape).to(dtype=p.dtype))
                else:
                    _read_into(f, path, stored, name, targets, params, deq)
                seen.add(name)
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {folder} (no {family.name} parameter takes "
                              f"them): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    missing = [name for name in plan if name not in seen]
    if missing:
        raise CheckpointError(f"missing tensors in {folder}: {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}")
    if deq is not None:
        deq.attach(model)                     # the kept int4 codes, for layers/quant
    return model.eval(), cfg


def _read_into(f, path: Path, stored: str, name: str, targets: list, params: dict,
               deq: Dequantizer | None) -> None:
    """Tensor ``stored`` of ``f`` (planned as ``name``), read whole (through ``deq`` when the
    checkpoint is quantized) into its (parameter, piece) ``targets``; an int4 weight's codes and
    scales are kept as stored too (``Dequantizer.carry``)."""
    t = read_weight(f, path, stored, deq, _open_weights)
    _check_shape(name, path, tuple(t.shape), targets[0][1].shape)
    with torch.no_grad():
        for ours, piece in targets:
            p = params[ours]
            p[piece.dest].copy_(t[piece.src].to(dtype=p.dtype))
    if deq is not None and deq.carried is not None:
        for ours, piece in targets:
            deq.carry(ours, params[ours].shape, piece)


def local_piece(piece: Piece, full: tuple[int, ...],
                shard: tuple[slice, ...] | None) -> tuple[tuple, tuple] | None:
    """The part of ``piece`` that lies in this rank's ``shard`` (slices of a parameter of full
    shape ``full``; None: the whole parameter) as (index into the rank's parameter, slices of the
    checkpoint tensor, read with ``get_slice``), or None when none of it does.

    NOTE: a piece's ``dest`` (into the parameter) and ``src`` (into the checkpoint tensor) drop
    the dimensions that they index with an integer (an expert, say); the slices left pair up in
    order and have equal lengths. Integer entries of ``src`` are read as length-1 slices and
    reshaped away by the caller."""
    dest = tuple(piece.dest) + (slice(None),) * (len(full) - len(piece.dest))
    src_index = tuple(piece.src) + (slice(None),) * (len(piece.shape) - len(piece.src))
    src = [slice(i, i + 1) if isinstance(i, int) else slice(*i.indices(n)[:2])
           for i, n in zip(src_index, piece.shape)]
    pairs = iter([j for j, i in enumerate(src_index) if not isinstance(i, int)])
    shard = shard if shard is not None else (slice(None),) * len(full)
    local = []
    for d, s, n in zip(dest, shard, full):
        s0, s1, _ = s.indices(n)
        if isinstance(d, int):
            if not s0 <= d < s1:
                return None
            local.append(d - s0)
            continue
        d0, d1, step = d.indices(n)
        if step != 1:
            raise ValueError(f"Piece {piece.ckpt}: strided dest {d} is not supported")
        lo, hi = max(d0, s0), min(d1, s1)
        if lo >= hi:
            return None
        local.append(slice(lo - s0, hi - s0))
        j = next(pairs)                                  # the checkpoint dimension it maps to
        c0 = src[j].start
        src[j] = slice(c0 + lo - d0, c0 + hi - d0)
    return tuple(local), tuple(src)


def _check_shape(name: str, path: Path, got: tuple, expected: tuple) -> None:
    if got != tuple(expected):
        raise CheckpointError(f"shape mismatch for {name} in {path.name}: checkpoint {got}, "
                              f"model expects {tuple(expected)} (from config.json)")


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name of a checkpoint's weight files (read from their headers)."""
    names: list[str] = []
    for path in files:
        with _open_weights(path) as f:
            names.extend(f.keys())
    return names


def save_checkpoint(model: nn.Module, folder: str | os.PathLike,
                    hf_config: dict | None = None, dtype: str | torch.dtype = torch.bfloat16,
                    max_shard_bytes: int | None = None, packed: dict | None = None) -> Path:
    """Write ``config.json`` and weights (one file, or shards + index) in the family's names;
    ``packed``: parameters written as int4 packs instead (``ckpt_quant.write_packed``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    family = registry.by_name(model.cfg.arch)
    hf_config = dict(hf_config) if hf_config is not None else family.to_hf_config(model.cfg)
    dtype = parse_dtype(dtype)
    keep_fp32 = _float32_params(model)
    tensors: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        dt = torch.float32 if n in keep_fp32 else dtype
        if packed and n in packed:
            continue
        for piece in family.pieces(n, tuple(p.shape), model.cfg):
            if piece.whole:
                tensors[piece.ckpt] = p.detach().to("cpu", dt).contiguous()
                continue
            # NOTE: a fused checkpoint tensor (q | k | v) is assembled from several parameters
            if piece.ckpt not in tensors:
                tensors[piece.ckpt] = torch.empty(piece.shape, dtype=dt)
            tensors[piece.ckpt][piece.src] = p.detach()[piece.dest].to("cpu", dt)
    write_packed(tensors, model, family, packed or {})
    with open(folder / "config.json", "w", encoding="utf-8") as f:
        json.dump(hf_config, f, indent=2)
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(folder / "model.safetensors.index.json", "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return folder


def _float32_params(model: nn.Module) -> set[str]:
    """Names of the parameters a module keeps in float32 whatever the model's dtype (its
    ``KEEP_FLOAT32``, relative names): they are written in float32 too."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        for rel in getattr(module, "KEEP_FLOAT32", ()):
            out.add(f"{prefix}.{rel}" if prefix else rel)
    return out


# --------------------------------------------------------------------- model folder and device
DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"


def default_model_path() -> Path:
    """The small checkpoint shipped inside the package."""
    if not (DEMO_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"no model given and the shipped demo checkpoint is missing at "
                                f"{DEMO_MODEL}; pass a checkpoint folder")
    return DEMO_MODEL


# The proxy checkpoints live in the repository's checkpoints/ folder, outside the package (the
# wheel stays small): a source checkout finds them there, an installed package through
# FLASH_DLLM_CHECKPOINTS (folders that hold them, separated by os.pathsep).
NAMED_MODELS = ("demo", "proxy-llada", "proxy-dream", "proxy-llada2")
CHECKPOINTS_ENV = "FLASH_DLLM_CHECKPOINTS"
SOURCE_CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def model_path(model: str | os.PathLike | None) -> Path:
    """The checkpoint folder for ``--model``: None is the shipped demo model; an existing folder
    is itself; a name from ``NAMED_MODELS`` is looked up (a folder of that name wins)."""
    if model is None:
        return default_model_path()
    path = Path(model)
    if path.exists() or str(model) not in NAMED_MODELS:
        return path
    if str(model) == "demo":
        return default_model_path()
    roots = [Path(r) for r in os.environ.get(CHECKPOINTS_ENV, "").split(os.pathsep) if r]
    roots.append(SOURCE_CHECKPOINTS)
    for root in roots:
        if (root / str(model) / "config.json").is_file():
            return root / str(model)
    raise FileNotFoundError(
        f"model {str(model)!r} is one of the project's proxy checkpoints, but no "
        f"{model}/config.json is in {', '.join(str(r) for r in roots)}; they ship in the source "
        f"repository's checkpoints/ folder, not in the wheel: set {CHECKPOINTS_ENV} to the "
        f"folder that holds them, or pass the checkpoint folder itself")


def resolve_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA when available) -> a usable ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; run on the "
                         "CPU instead (--device cpu)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {device!r}")
    return dev
