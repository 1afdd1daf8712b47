"""Checkpoints published already quantized: which layouts are read, and reading them.

Read: **compressed-tensors** (llm-compressor's and vLLM's format) ``"format": "float-quantized"``
FP8: e4m3 weights with one scale per output channel (``strategy: channel``) or one per tensor,
activations quantized dynamically per token or not at all (llm-compressor's ``FP8_DYNAMIC``
and FP8 weight-only schemes). Each weight is dequantized as it is read (codes x scale, in
float32) and the engine quantizes the model to ``--quantization fp8`` at load unless told
otherwise (``layers/quant.py``): per-channel scales are recomputed from the same row maxima, so
the e4m3 codes come back as the checkpoint stored them (tests/test_ckpt_quant.py checks it).

Read: compressed-tensors ``"format": "pack-quantized"`` **int4** (llm-compressor's W4A16 /
GPTQ-style schemes): symmetric int4 weights, one scale per ``group_size`` inputs, no activation
quantization, no activation reordering. The packed int32 words hold eight ``q + 8`` nibbles,
lowest first: read as bytes they are ``quant_gemm``'s int4 layout already, so the codes are
carried to the engine as stored (``Dequantizer.carried``; ``layers/quant.py`` builds its int4
layers from them under ``--quantization int4`` with the checkpoint's group size, the default for
it); the parameters themselves get the dequantized weights (codes x scales), which any other
mode quantizes from. The scales are kept in float16 (``quant_gemm``'s scale dtype).

Written (``flash-dllm quantize``, ``entrypoints/quantize.py``): the same pack-quantized int4
layout, from the int4 codes a model carries (GPTQ's or round to nearest's): ``put_packed`` per
checkpoint tensor (``write_packed`` for a model's), ``pack_quantized_config`` for
``config.json``.

Refused, in one line naming the layout: every other ``quant_method`` / ``format`` (GPTQ, AWQ,
bitsandbytes, compressed-tensors ``pack-quantized`` int8 or asymmetric, static activation
scales, block or group FP8 scales). Those can be served by loading the bf16 checkpoint with
``--quantization int4`` / ``int8``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from flash_dllm.kernels import quant_decode

READ = ("compressed-tensors 'float-quantized' FP8 (per-channel or per-tensor weight scales, "
        "dynamic per-token or no activation quantization, e.g. llm-compressor's FP8_DYNAMIC) "
        "and 'pack-quantized' int4 (symmetric, group scales, weight-only, e.g. W4A16)")
# tensors a quantized layer carries beside its weight: consumed by the reader
_COMPANIONS = ("weight_scale", "input_scale", "weight_zero_point", "weight_global_scale",
               "weight_shape", "weight_g_idx")
PACKED = ".weight_packed"                 # pack-quantized: the codes, in place of ``.weight``


class UnreadQuantization(ValueError):
    """A checkpoint's quantization_config names a layout flash-dllm does not read."""


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint's weights are stored, and the ``--quantization`` mode that keeps them."""

    mode: str                    # "fp8" / "int4"
    layout: str                  # for messages
    group_size: int | None = None    # int4: the checkpoint's group


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
    if fmt == "pack-quantized":
        return _pack_quantized(qc, where)
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


def _pack_quantized(qc: dict, where) -> CheckpointQuant:
    groups, sizes = qc.get("config_groups") or {}, set()
    if not groups:
        raise _refuse(where, "compressed-tensors without config_groups")
    for name, g in groups.items():
        w = g.get("weights") or {}
        if g.get("format") not in (None, "pack-quantized") \
                or (w.get("num_bits"), w.get("type"), w.get("strategy")) != (4, "int", "group") \
                or w.get("symmetric") is False or w.get("dynamic") or w.get("actorder") \
                or not isinstance(w.get("group_size"), int) or w["group_size"] < 2 \
                or w["group_size"] % 2:
            raise _refuse(where, f"compressed-tensors pack-quantized group {name!r} with "
                                 f"weights {w}")
        if g.get("input_activations") or g.get("output_activations"):
            raise _refuse(where, f"compressed-tensors pack-quantized group {name!r} with "
                                 "activation quantization")
        sizes.add(w["group_size"])
    if len(sizes) != 1:
        raise _refuse(where, f"compressed-tensors pack-quantized with group sizes {sorted(sizes)}")
    g = sizes.pop()
    return CheckpointQuant("int4", f"compressed-tensors int4 (pack-quantized, group {g})", g)


def quantized_reader(folder: Path, raw: dict, names: dict, tp) -> "Dequantizer | None":
    """The reader of the checkpoint at ``folder`` (``config.json`` ``raw``, its files' tensor
    ``names``) when it is published quantized, else None; refused under tensor parallelism."""
    ckq = checkpoint_quantization(raw, folder)
    if ckq is None:
        return None
    if tp is not None and tp.world > 1:
        raise UnreadQuantization(f"{folder}: a {ckq.layout} checkpoint with tensor parallelism "
                                 "is not supported yet: use one device")
    return Dequantizer(ckq, names)


class Dequantizer:
    """Reads a quantized checkpoint's weights dequantized: ``weight`` codes x ``weight_scale``
    (the scale may sit in another shard of the checkpoint)."""

    def __init__(self, layout: CheckpointQuant, names: dict[Path, list[str]]) -> None:
        """``names``: each weight file's tensor names."""
        self.layout = layout
        self._where = {n: p for p, ns in names.items() for n in ns
                       if n.endswith((".weight_scale", ".weight_shape"))}
        reordered = [n for ns in names.values() for n in ns if n.endswith(".weight_g_idx")]
        if reordered:
            raise UnreadQuantization(f"{reordered[0]}: activation-reordered (g_idx) int4 is "
                                     "not read; load the unquantized checkpoint with "
                                     "--quantization int4")
        # int4: the codes and scales of the weight just read, as stored; ``kept``: per model
        # parameter, its pieces' codes and scales gathered (``carry``), for ``layers/quant``
        self.carried: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def hidden(name: str) -> bool:
        """A companion tensor (scale, zero point) rather than a parameter of the model."""
        return name.rsplit(".", 1)[-1] in _COMPANIONS

    @staticmethod
    def param_name(name: str) -> str:
        """The checkpoint name a model parameter is planned under (``.weight_packed`` holds a
        pack-quantized ``.weight``)."""
        return name[: -len(PACKED)] + ".weight" if name.endswith(PACKED) else name

    def _companion(self, f, path: Path, name: str, open_file) -> torch.Tensor:
        if self._where[name] == path:
            return f.get_tensor(name)
        with open_file(self._where[name]) as g:          # (in another shard)
            return g.get_tensor(name)

    def read(self, f, path: Path, name: str, open_file) -> torch.Tensor:
        """Tensor ``name`` of the open file ``f`` (at ``path``), dequantized when it has a
        scale; ``open_file(path)``: a context manager opening another shard. A pack-quantized
        weight also leaves its (codes, scales) in ``carried``."""
        self.carried = None
        if name.endswith(PACKED):
            return self._read_packed(f, path, name, open_file)
        t = f.get_tensor(name)
        sname = name[: -len("weight")] + "weight_scale" if name.endswith(".weight") else None
        if sname not in self._where:
            return t
        s = self._companion(f, path, sname, open_file).float()
        if s.numel() == 1:
            s = s.reshape(())
        elif s.shape != (t.shape[0], 1):
            raise UnreadQuantization(f"{sname} has shape {tuple(s.shape)}: per-channel FP8 "
                                     f"scales are [{t.shape[0]}, 1] (or one per tensor)")
        return t.float() * s

    def _read_packed(self, f, path: Path, name: str, open_file) -> torch.Tensor:
        """int32 words of eight ``q + 8`` nibbles (lowest first) -> quant_gemm's bytes (two
        nibbles each, low first: the same bits on a little-endian host) and float16 scales;
        returns the dequantized weight (float32, exact: a 4-bit code times a scale)."""
        base = name[: -len(PACKED)]
        for companion in ("weight_scale", "weight_shape"):
            if f"{base}.{companion}" not in self._where:
                raise UnreadQuantization(f"{name}: no {base}.{companion} in the checkpoint")
        n, k = (int(v) for v in self._companion(f, path, f"{base}.weight_shape", open_file))
        words = f.get_tensor(name)
        g = self.layout.group_size
        if words.dtype != torch.int32 or tuple(words.shape) != (n, k // 8) or k % 8 or k % g:
            raise UnreadQuantization(f"{name}: {words.dtype} {tuple(words.shape)} is not an "
                                     f"int4 pack of [{n}, {k}] in int32 words along the input "
                                     f"dim (group {g})")
        s = self._companion(f, path, f"{base}.weight_scale", open_file)
        if tuple(s.shape) != (n, k // g):
            raise UnreadQuantization(f"{base}.weight_scale has shape {tuple(s.shape)}: group "
                                     f"scales of a [{n}, {k}] weight are [{n}, {k // g}]")
        if sys.byteorder != "little":          # (int32 words seen as their bytes)
            raise UnreadQuantization(f"{name}: int4 packs are read on little-endian hosts only")
        codes = words.contiguous().view(torch.uint8)                     # [N, K / 2]
        scales = s.to(quant_decode.SCALE_DTYPE)
        self.carried = (codes, scales)
        return quant_decode.dequantize(codes, scales, 4)

    def carry(self, ours: str, shape: tuple, piece) -> None:
        """Copy ``piece`` (``models.family.Piece``) of the weight just read's codes and scales
        into the parameter-shaped pair kept for parameter ``ours`` (of ``shape``; the input dim
        whole: its packed bytes and groups cannot be cut)."""
        codes, scales = self.carried
        if len(piece.dest) == len(shape) or len(piece.src) == len(piece.shape):
            raise UnreadQuantization(f"{piece.ckpt}: an int4 weight split along its input dim "
                                     "cannot keep its packed codes")
        if ours not in self.kept:
            lead = tuple(shape[:-1])
            self.kept[ours] = (torch.zeros(lead + (shape[-1] // 2,), dtype=torch.uint8),
                               torch.zeros(lead + (scales.shape[-1],), dtype=scales.dtype))
        self.kept[ours][0][piece.dest] = codes[piece.src]
        self.kept[ours][1][piece.dest] = scales[piece.src]

    def attach(self, model: torch.nn.Module) -> None:
        """Each kept pair as ``ckpt_codes[attr] = (codes, scales, group)`` of the module owning
        the parameter (``layers/quant`` builds its int4 layers from them; it drops them)."""
        for ours, (codes, scales) in self.kept.items():
            owner, attr = ours.rsplit(".", 1)
            module = model.get_submodule(owner)
            module.ckpt_codes = {**getattr(module, "ckpt_codes", {}),
                                 attr: (codes, scales, self.layout.group_size)}
        self.kept = {}


def read_weight(f, path: Path, name: str, deq: Dequantizer | None, open_file) -> torch.Tensor:
    """Tensor ``name`` of the open weight file ``f``, through ``deq`` when the checkpoint is
    quantized."""
    return f.get_tensor(name) if deq is None else deq.read(f, path, name, open_file)


def put_packed(tensors: dict, piece, shape: tuple, codes: torch.Tensor, scales: torch.Tensor,
               group: int) -> None:
    """Write ``piece`` (``models.family.Piece``) of a parameter of ``shape`` whose int4
    ``codes`` / ``scales`` (on the host) are ``quant_decode``'s byte layout into ``tensors`` as compressed-tensors'
    pack-quantized ``<name>.weight_packed`` (int32 words of eight ``q + 8`` nibbles, lowest
    first: the codes' bytes read as little-endian words), ``.weight_scale`` and
    ``.weight_shape`` (what ``Dequantizer`` reads back; the scales in float16, as read)."""
    if not piece.ckpt.endswith(".weight"):
        raise UnreadQuantization(f"{piece.ckpt}: pack-quantized int4 is written for Linear "
                                 "weights ('<name>.weight') only")
    if not piece.whole and (len(piece.dest) == len(shape) or len(piece.src) == len(piece.shape)):
        raise UnreadQuantization(f"{piece.ckpt}: an int4 weight split along its input dim "
                                 "cannot keep its packed codes")
    k = piece.shape[-1]
    if k % 8 or sys.byteorder != "little":
        raise UnreadQuantization(f"{piece.ckpt}: int4 packs are int32 words of 8 codes along "
                                 f"the input dim (here {k}) written on little-endian hosts")
    base = piece.ckpt[: -len(".weight")]
    lead = tuple(piece.shape[:-1])
    if base + PACKED not in tensors:
        tensors[base + PACKED] = torch.zeros(lead + (k // 2,), dtype=torch.uint8)
        tensors[base + ".weight_scale"] = torch.zeros(lead + (k // group,),
                                                      dtype=quant_decode.SCALE_DTYPE)
        tensors[base + ".weight_shape"] = torch.tensor(piece.shape, dtype=torch.int64)
    tensors[base + PACKED][piece.src] = codes[piece.dest]
    tensors[base + ".weight_scale"][piece.src] = scales[piece.dest]


def write_packed(tensors: dict, model: torch.nn.Module, family, packed: dict) -> None:
    """``packed`` (parameter name -> int4 ``(codes, scales, group)``) into ``tensors`` as the
    checkpoint tensors ``family`` maps each parameter to (``put_packed``), the codes as the
    int32 words the format stores; the caller adds the ``quantization_config``."""
    params = dict(model.named_parameters())
    for n, (codes, scales, group) in packed.items():
        shape = tuple(params[n].shape)
        # (to the host once a parameter: a MoE stack has two pieces an expert)
        codes, scales = quant_decode.words_to_bytes(codes).cpu(), scales.cpu()
        for piece in family.pieces(n, shape, model.cfg):
            put_packed(tensors, piece, shape, codes, scales, group)
    for name in [n for n in tensors if n.endswith(PACKED)]:
        tensors[name] = tensors[name].contiguous().view(torch.int32)


def pack_quantized_config(group: int, ignore: list[str]) -> dict:
    """``config.json``'s ``quantization_config`` of a pack-quantized int4 checkpoint
    (compressed-tensors' names; symmetric group scales, weight-only, no activation order)."""
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "pack-quantized",
                "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                            "strategy": "group", "group_size": group, "dynamic": False,
                            "actorder": None, "observer": "minmax"},
                "input_activations": None, "output_activations": None}},
            "ignore": sorted(ignore)}
