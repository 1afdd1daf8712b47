"""``flash-dllm quantize``: write an int4 copy of a checkpoint, so a GPTQ fit runs once.

The checkpoint's projections (and MoE experts) are quantized to int4 with group scales, fitted by
GPTQ on ``--quantization-calibration`` samples (``layers/gptq.py``) or rounded to nearest without
it, and written as a compressed-tensors ``pack-quantized`` checkpoint in the family's own tensor
names (``models/ckpt_quant.put_packed``): the layout llm-compressor's W4A16 writes (vLLM reads it
too, its Marlin kernels at groups 32 / 64 / 128; its scales are float16 here), which every
flash-dllm command then loads on its stored codes (``--quantization int4`` by default for it).
The model is loaded in float32 (``--dtype`` otherwise) and every other tensor (embeddings,
norms, the LM head and MoE routers, listed under ``ignore``) is written in the dtype the
checkpoint stores most of its bytes in; shards of 5 GiB at most; the tokenizer, generation,
licence and README files are copied. A failed run leaves no ``--out``.

    flash-dllm quantize --model checkpoints/proxy-llada2 --quantization int4 \\
        --quantization-group-size 4 --quantization-calibration chain,code-long --out DIR
"""
from __future__ import annotations

import argparse
import math
import shutil
import sys
from pathlib import Path

from flash_dllm.entrypoints.args import EngineArgs

_COPIED = ("tokenizer", "special_tokens_map", "generation_config", "chat_template",
           "added_tokens", "vocab", "merges", "LICENSE", "NOTICE", "README")
SHARD_BYTES = 5 * 2**30


def add_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write an int4 copy of a checkpoint (compressed-tensors "
                                        "pack-quantized; GPTQ-fitted with "
                                        "--quantization-calibration)")
    q.add_argument("--out", required=True, help="the folder to write (new or empty)")
    EngineArgs.add_cli_args(q)
    q.set_defaults(func=run)


def round_to_nearest(model, group: int) -> None:
    """int4 codes rounded to nearest for every projection ``quantize_model`` quantizes, left as
    ``ckpt_codes`` as GPTQ leaves its own (``layers/gptq.calibrate``)."""
    from flash_dllm.kernels import quant_decode
    from flash_dllm.layers.gptq import _targets
    from flash_dllm.layers.moe import MoE

    for block in model.layers:
        for parent, name in _targets(block):
            lin = getattr(parent, name)
            lin.ckpt_codes = {"weight": (*quant_decode.quantize(lin.weight.detach(), 4, group),
                                         group)}
        for moe in (m for m in block.modules() if isinstance(m, MoE)):
            moe.ckpt_codes = {p: (*quant_decode.quantize(getattr(moe, p).detach(), 4, group),
                                  group) for p in ("w_gate_up", "w_down")}


def packed_codes(model) -> tuple[dict, list[str]]:
    """``(packed, ignore)``: parameter name -> ``(codes, scales, group)`` of every layer that
    carries int4 codes, and the module names of the linears left unquantized (LM head, routers)
    in the checkpoint's names."""
    from torch import nn

    from flash_dllm.models import registry
    family = registry.by_name(model.cfg.arch)
    packed, ignore = {}, []
    for name, module in model.named_modules():
        codes = getattr(module, "ckpt_codes", None) or {}
        for attr, c in codes.items():
            packed[f"{name}.{attr}"] = c
        if type(module) is nn.Linear and "weight" not in codes:
            for piece in family.pieces(f"{name}.weight", tuple(module.weight.shape), model.cfg):
                ignore.append(piece.ckpt.rsplit(".", 1)[0])
    return packed, ignore


def _stored_dtype(folder: Path):
    """The floating dtype that holds most of the checkpoint's bytes, so the unquantized
    tensors (embeddings, norms, LM head, routers) are written as they were stored."""
    import torch
    from safetensors import safe_open

    from flash_dllm.models.loader import weight_files
    by_code = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    total = dict.fromkeys(by_code, 0)
    for path in weight_files(folder):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                code = sl.get_dtype()
                if code in total:
                    total[code] += math.prod(sl.get_shape()) * by_code[code].itemsize
    best = max(total, key=total.get)
    return by_code[best] if total[best] else torch.bfloat16


def _check(model, method) -> None:
    """Every weight to pack takes the group (``method.check``) and whole int32 words of codes
    (its input width a multiple of 8: the format's words run along it)."""
    from flash_dllm.layers.gptq import target_widths

    device = next(model.parameters()).device
    if method.group_size < 2 or method.group_size % 2:
        raise ValueError(f"flash-dllm quantize: quantization_group_size={method.group_size}: a "
                         "pack-quantized checkpoint's group is even and at least 2 (what "
                         "flash-dllm and compressed-tensors read)")
    for layer, k in target_widths(model):
        method.check(layer, k, device)
        if k % 8:
            raise ValueError(f"flash-dllm quantize: layer {layer} has input width {k}, not a "
                             "multiple of 8: the pack-quantized format stores int4 codes "
                             "as int32 words of 8 along it (serve this model with "
                             "--quantization int4 at load instead)")


def run(a: argparse.Namespace) -> int:
    from flash_dllm.entrypoints.calibration import calibrate_as_configured
    from flash_dllm.layers.quant import DEFAULT_GROUP_SIZE, make_method
    from flash_dllm.models.ckpt_quant import checkpoint_quantization, pack_quantized_config
    from flash_dllm.models.loader import (load_model, model_path, read_config, resolve_device,
                                          save_checkpoint)
    from flash_dllm.models.tokenizer import Tokenizer

    args = EngineArgs.from_cli_args(a)
    config = args.engine_config()
    if config.quantization != "int4":
        raise ValueError("flash-dllm quantize writes int4 checkpoints (compressed-tensors "
                         f"pack-quantized): pass --quantization int4, got {config.quantization!r}")
    if args.tensor_parallel_size != 1 or config.quantize_lm_head:
        raise ValueError("flash-dllm quantize runs on one device and keeps the LM head "
                         "unquantized: drop --tensor-parallel-size / --quantize-lm-head")
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder")
    folder = model_path(args.model)
    raw = read_config(folder)[2]
    if checkpoint_quantization(raw, folder) is not None:
        raise ValueError(f"{folder} is published quantized already: quantize its unquantized "
                         "checkpoint")
    group = config.quantization_group_size or DEFAULT_GROUP_SIZE
    tok = Tokenizer(folder)
    model, cfg = load_model(folder, device=resolve_device(args.device),
                            dtype="float32" if args.dtype == "auto" else args.dtype)
    _check(model, make_method("int4", group))          # before any work: one line naming it
    cfg = tok.resolve_ids(cfg)
    report = calibrate_as_configured(model, tok, cfg, config)
    if report is None:
        round_to_nearest(model, group)
    packed, ignore = packed_codes(model)
    hf = {**raw, "quantization_config": pack_quantized_config(group, ignore)}
    created = not out.exists()
    try:
        save_checkpoint(model, out, hf_config=hf, dtype=_stored_dtype(folder),
                        max_shard_bytes=SHARD_BYTES, packed=packed)
        for p in folder.iterdir():          # the tokenizer, generation and remote-code files
            if p.is_file() and (p.name.startswith(_COPIED) or p.suffix in (".py", ".model",
                                                                           ".tiktoken")):
                shutil.copy2(p, out / p.name)
    except BaseException:
        if created:                         # (a half-written folder would be refused next)
            shutil.rmtree(out, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    how = (f"GPTQ on {config.quantization_calibration}" if report is not None
           else "rounded to nearest")
    print(f"flash-dllm: wrote {out}: int4, group {group}, {how}; {len(packed)} weights packed, "
          f"{size / 2**20:.1f} MiB of weights (load it with --model {out})", file=sys.stderr)
    return 0
