"""Checkpoints published already quantized: which layouts are read, and reading them.

Read: **compressed-tensors** (llm-compressor's and vLLM's format) ``"format": "float-quantized"``
FP8: e4m3 weights with one scale per output channel (``strategy: channel``) or one per tensor,
activations quantized dynamically per token or not at all (llm-compressor's ``FP8_DYNAMIC``
and FP8 weight-only schemes). Each weight is dequantized as it is read (codes x scale, in
float32) and the engine quantizes the model to ``--quantization fp8`` at load unless told
otherwise (``layers/quant.py``): per-channel scales are recomputed from the same row maxima, so
the e4m3 codes come back as the checkpoint stored them (tests/test_ckpt_quant.py checks it).

Refused, in one line naming the layout: every other ``quant_method`` / ``format`` (GPTQ, AWQ,
bitsandbytes, compressed-tensors ``pack-quantized`` int4 / int8, static activation scales, block
or group FP8 scales). Those can be served by loading the bf16 checkpoint with ``--quantization
int4`` / ``int8``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

READ = ("compressed-tensors 'float-quantized' FP8 (per-channel or per-tensor weight scales, "
        "dynamic per-token or no activation quantization, e.g. llm-compressor's FP8_DYNAMIC)")
# tensors a quantized layer carries beside its weight: consumed by the reader
_COMPANIONS = ("weight_scale", "input_scale", "weight_zero_point", "weight_global_scale")


class UnreadQuantization(ValueError):
    """A checkpoint's quantization_config names a layout flash-dllm does not read."""


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's weights are stored, and the ``--quantization`` mode that keeps them."""

    mode: str                    # "fp8"
    layout: str                  # for messages


def _refuse(where, what: str) -> UnreadQuantization:
    return UnreadQuantization(f"{where}: its quantization_config is {what}, which flash-dllm "
                              f"does not read; it reads {READ}. Load the unquantized "
                              "checkpoint with --quantization int4 / int8 / fp8 instead")


def checkpoint_quantization(raw: dict, where: str | Path) -> CheckpointQuant | None:
    """The layout of the checkpoint at ``where`` whose ``config.json`` is ``raw`` (None: not
    quantized). Raises ``UnreadQuantization`` (naming ``where``) for a layout that is not read."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _refuse(where, f"{qc!r} (not an object)")
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors":
        raise _refuse(where, f"quant_method {method!r}")
    if fmt != "float-quantized":
        raise _refuse(where, f"compressed-tensors format {fmt!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse(where, "compressed-tensors without config_groups")
    for name, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations")
        if g.get("format") not in (None, "float-quantized"):
            raise _refuse(where, f"compressed-tensors group {name!r} of format {g.get('format')!r}")
        if (w.get("num_bits"), w.get("type")) != (8, "float") \
                or w.get("strategy") not in ("channel", "tensor") \
                or w.get("symmetric") is False or w.get("dynamic"):
            raise _refuse(where, f"compressed-tensors group {name!r} with weights {w}")
        if a is not None and not (a.get("dynamic") and a.get("strategy") == "token"
                                  and (a.get("num_bits"), a.get("type")) == (8, "float")):
            raise _refuse(where, f"compressed-tensors group {name!r} with input activations {a}")
        if g.get("output_activations"):
            raise _refuse(where, f"compressed-tensors group {name!r} with output activations")
    return CheckpointQuant("fp8", "compressed-tensors FP8")


class Dequantizer:
    """Reads a quantized checkpoint's weights dequantized: ``weight`` codes x ``weight_scale``
    (the scale may sit in another shard of the checkpoint)."""

    def __init__(self, layout: CheckpointQuant, names: dict[Path, list[str]]) -> None:
        """``names``: each weight file's tensor names."""
        self.layout = layout
        self._where = {n: p for p, ns in names.items() for n in ns
                       if n.endswith(".weight_scale")}

    @staticmethod
    def hidden(name: str) -> bool:
        """A companion tensor (scale, zero point) rather than a parameter of the model."""
        return name.rsplit(".", 1)[-1] in _COMPANIONS

    def read(self, f, path: Path, name: str, open_file) -> torch.Tensor:
        """Tensor ``name`` of the open file ``f`` (at ``path``), dequantized when it has a
        scale; ``open_file(path)``: a context manager opening another shard."""
        t = f.get_tensor(name)
        sname = name[: -len("weight")] + "weight_scale" if name.endswith(".weight") else None
        if sname not in self._where:
            return t
        if self._where[sname] == path:
            s = f.get_tensor(sname)
        else:                                  # (in another shard)
            with open_file(self._where[sname]) as g:
                s = g.get_tensor(sname)
        s = s.float()
        if s.numel() == 1:
            s = s.reshape(())
        elif s.shape != (t.shape[0], 1):
            raise UnreadQuantization(f"{sname} has shape {tuple(s.shape)}: per-channel FP8 "
                                     f"scales are [{t.shape[0]}, 1] (or one per tensor)")
        return t.float() * s


def read_weight(f, path: Path, name: str, deq: Dequantizer | None, open_file) -> torch.Tensor:
    """Tensor ``name`` of the open weight file ``f``, through ``deq`` when the checkpoint is
    quantized."""
    return f.get_tensor(name) if deq is None else deq.read(f, path, name, open_file)
