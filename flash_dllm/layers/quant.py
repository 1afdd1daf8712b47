"""Quantized weights: a linear method per mode, the module that holds a quantized weight, and
``quantize_model`` that swaps them in after loading (and after ``fuse_projections``).

One seam, as vLLM's ``LinearMethod``: a ``QuantLinear`` keeps its packed tensors as (frozen)
parameters and its ``forward`` is ``method.apply(self, x)``; the attention, MLP and MoE code call
it as they call an ``nn.Linear``. Modes (``QUANT_MODES``):

- ``fp8``: e4m3 weights with one float32 scale per output channel, activations quantized at
  every call (dynamic), the GEMMs on FP8 tensor cores: below ``fp8_gemm.W8A8_MIN_ROWS`` rows per
  call x in blocks of 128 values with power-of-two scales inside the GEMM kernel
  (``kernels/fp8_skinny.py``), from there per token by a kernel of its own and cuBLAS's product
  (``kernels/fp8_gemm.py``; the CPU emulates both by the same rule). 1 byte per weight.
- ``int8`` / ``int4``: weight-only, one float16 scale per output row and ``group_size`` inputs,
  dequantized inside the GEMM kernel (``kernels/quant_gemm.py``, W8A16 / W4A16). 1 / 0.5 bytes
  per weight plus 2 / group_size for the scales.

What is quantized: every projection of the transformer blocks (q/k/v or qkv, o, gate/up or
gate_up, down, a MoE layer's packed experts and its shared expert). Kept in the model's dtype:
the embeddings, the LM head (the confidence every decode policy ranks slots by is read from its
logits) and a MoE router (which experts run is a discrete choice; its weight is E x d, tiny).

NOTE (LM head): ``quantize_lm_head`` quantizes the head too, by the same mode (a tied model's
head gets its own quantized copy: the embedding stays). Its bytes are read at every step
(LLaDA-8B: 1.04 GB in bf16, ~8 % of the int4 step), so it is the one unquantized weight a
batch-1 step streams; off by default: what it costs in accuracy is in docs/models.md.

NOTE (MoE experts): int8 / int4 experts run in ``kernels/fused_moe_quant`` (the fused MoE with
each expert tile dequantized in registers: an int4 expert streams a quarter of bf16's bytes; on
an H100 LLaDA2-mini's int4 step is 0.60x bf16's at batch 1: benchmarks/findings/
quantization.md). Under ``fp8`` the experts are weight-only too: their e4m3 codes (one scale
per row) run in the same fused kernel.

NOTE (int4 words): on a GPU an int4 weight whose input width is whole 128-column tiles inside
its scale groups stores its codes as ``quant_decode``'s interleaved words (int32), read by
``quant_gemm``'s word read, its dequantize kernel and the fused MoE: fewer instructions a weight
than the byte read. On an H100 LLaDA-8B's int4 GEMMs take 2.75 ms of a batch-1 step instead of
3.45, and LLaDA2-mini's words experts take its step 5.76 -> 5.41 ms (benchmarks/findings/
quantization.md). The CPU keeps bytes (its reference would de-interleave every call).
``FLASH_DLLM_INT4_WORDS`` = 0 / 1 forces either layout on any device (A/B timing, tests);
``EXPERT_WORDS`` False keeps MoE experts in bytes (the A/B).

NOTE (checkpoints published in int4): a layer whose loader left it ``ckpt_codes`` (a
compressed-tensors pack-quantized checkpoint: ``models/ckpt_quant``) takes those codes and
scales as they are under ``int4`` with the checkpoint's group size, instead of quantizing its
dequantized weight again (which would move codes: the checkpoint's scale is absmax / 7.5, ours
absmax / 7). Any other mode or group quantizes the dequantized weight.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from flash_dllm.kernels import fp8_gemm, fused_moe_quant, quant_decode, quant_gemm
from flash_dllm.kernels._triton import use_triton
from flash_dllm.layers.moe import MoE

QUANT_MODES = ("fp8", "int8", "int4")
WORDS_ENV = "FLASH_DLLM_INT4_WORDS"      # "0" / "1": int4 linears' layout forced (the NOTE)
EXPERT_WORDS = True                      # MoE experts as int4 words too (the NOTE)
DEFAULT_GROUP_SIZE = 128


class QuantError(ValueError):
    """A quantization request this model cannot take, in one line naming the field and layer."""


class Fp8Method:
    """fp8 e4m3 weights, per-output-channel scales, dynamic activation scales (``fp8_gemm``)."""

    name = "fp8"
    names = ("qweight", "wscale")
    # why a deterministic engine refuses this mode on a GPU (None: batch-invariant there)
    not_batch_invariant = ("torch._scaled_mm picks its kernel by shape, and how x is quantized "
                           "follows the rows of the call (fp8_gemm.W8A8_MIN_ROWS)")

    def check(self, layer: str, in_features: int, device: torch.device) -> None:
        if device.type == "cuda" and not fp8_gemm.supported(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise QuantError(f"quantization='fp8' needs FP8 tensor cores (CUDA compute "
                             f"capability >= 8.9), {device} has {cap}: use 'int8' or 'int4'")

    def quantize(self, w: torch.Tensor, carried=None) -> tuple[torch.Tensor, ...]:
        return fp8_gemm.quantize_weight(w)

    def dequantize(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        return fp8_gemm.dequantize(*tensors, dtype)

    def apply(self, layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        return fp8_gemm.op(x, layer.qweight, layer.wscale, layer.bias)

    def apply_experts(self, layer: "QuantExperts", x, topk_ids, topk_weights) -> torch.Tensor:
        """Weight-only: the e4m3 codes in the fused MoE on packed experts (``fused_moe_quant``,
        one scale per row: each code converted in registers; the CPU dequantizes them)."""
        return fused_moe_quant.op(x, layer.gate_up_qweight, layer.gate_up_wscale.unsqueeze(-1),
                                  layer.down_qweight, layer.down_wscale.unsqueeze(-1), 8,
                                  topk_ids, topk_weights)


class IntMethod:
    """int8 / int4 weight-only with group scales (W8A16 / W4A16)."""

    names = ("qweight", "scales")
    not_batch_invariant = None       # (deterministic: one tile for any rows, quant_gemm.op)

    def __init__(self, bits: int, group_size: int, words: bool | None = None) -> None:
        self.bits, self.group_size = bits, group_size
        self.name = f"int{bits}"
        # int4 linears stored as interleaved words (the module's NOTE); None: where Triton runs
        env = os.environ.get(WORDS_ENV, "")
        if env not in ("", "0", "1"):
            raise QuantError(f"{WORDS_ENV} must be 0 (int4 bytes) or 1 (int4 words), or unset "
                             f"(words on a GPU), got {env!r}")
        forced = {"0": False, "1": True}.get(env)
        self.words = bits == 4 and (words if words is not None else forced)

    def _words(self, w: torch.Tensor) -> bool:
        """Whether this float weight is stored as int4 words (int32 ``[..., N, K / 8]``, so the
        stored tensor says its layout): where Triton runs (or as forced), whole 128-column
        tiles inside scale groups; a MoE layer's 3-D experts as ``EXPERT_WORDS`` says."""
        wanted = use_triton(w) if self.words is None else self.words
        return (wanted and (w.dim() == 2 or (w.dim() == 3 and EXPERT_WORDS))
                and quant_decode.takes_words(w.shape[-1], self.group_size))

    def check(self, layer: str, in_features: int, device: torch.device) -> None:
        if self.bits == 4 and in_features % 2:
            raise QuantError(f"quantization='int4' packs two weights per byte: the input width "
                             f"{in_features} of layer {layer} is odd (use 'int8')")
        if in_features % self.group_size:
            raise QuantError(f"quantization_group_size={self.group_size} does not divide the "
                             f"input width {in_features} of layer {layer}: pass a group size "
                             f"that divides it (e.g. --quantization-group-size "
                             f"{_largest_pow2_divisor(in_features, self.group_size)})")

    def quantize(self, w: torch.Tensor, carried=None) -> tuple[torch.Tensor, ...]:
        """(qweight, scales) of ``w``; ``carried`` codes (a checkpoint's int4 ones, or GPTQ's
        int8 / int4: ``layers/gptq``), ``(codes, scales, group)``, as they are when they fit
        this method (its group, and its bits: int4's codes are half as wide)."""
        if carried is not None and carried[2] == self.group_size \
                and carried[0].shape[-1] * 8 == w.shape[-1] * self.bits:
            q, s = carried[0].to(w.device), carried[1].to(w.device)
        else:
            q, s = quant_gemm.quantize(w, self.bits, self.group_size)
        return (quant_decode.interleave_int4(q).view(torch.int32) if self._words(w) else q), s

    def dequantize(self, tensors, dtype: torch.dtype) -> torch.Tensor:
        return quant_gemm.dequantize(*tensors, self.bits, dtype)      # (words: unpack reads)

    def apply(self, layer: "QuantLinear", x: torch.Tensor) -> torch.Tensor:
        return quant_gemm.op(x, layer.qweight, layer.scales, layer.bias, self.bits)

    def apply_experts(self, layer: "QuantExperts", x, topk_ids, topk_weights) -> torch.Tensor:
        """The fused MoE dequantizing the packed experts in registers (``fused_moe_quant``)."""
        return fused_moe_quant.op(x, layer.gate_up_qweight, layer.gate_up_scales,
                                  layer.down_qweight, layer.down_scales, self.bits, topk_ids,
                                  topk_weights)


def _largest_pow2_divisor(n: int, at_most: int) -> int:
    g = 1
    while g * 2 <= at_most and n % (g * 2) == 0:
        g *= 2
    return g


def make_method(mode: str, group_size: int | None = DEFAULT_GROUP_SIZE):
    """The linear method of ``mode``; ``group_size`` None: ``DEFAULT_GROUP_SIZE``."""
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    if mode == "fp8":
        return Fp8Method()
    if mode in ("int8", "int4"):
        return IntMethod(int(mode[3:]), group_size)
    raise QuantError(f"quantization must be one of {list(QUANT_MODES)}, got {mode!r}")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized (``method``'s tensors, as parameters, so
    ``.to()`` moves them and weight counts see them); the bias stays in the model's dtype."""

    def __init__(self, linear: nn.Linear, method) -> None:
        super().__init__()
        self.method = method
        self.out_features, self.in_features = linear.weight.shape
        carried = getattr(linear, "ckpt_codes", {}).get("weight")
        for name, t in zip(method.names, method.quantize(linear.weight.detach(), carried)):
            setattr(self, name, _frozen(t))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as the GEMM sees it, [out, in] (tests, debugging)."""
        return self.method.dequantize([getattr(self, n) for n in self.method.names], dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.method.name}"


class QuantExperts(nn.Module):
    """A MoE layer's packed experts, quantized (``w_gate_up`` [E, 2I, d], ``w_down`` [E, d, I])
    and called as ``(x, topk_ids, topk_weights) -> out``; see the module's NOTE."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, method,
                 carried: dict | None = None) -> None:
        super().__init__()
        self.method = method
        for part, w in (("gate_up", w_gate_up), ("down", w_down)):
            codes = (carried or {}).get(f"w_{part}")
            for name, t in zip(method.names, method.quantize(w.detach(), codes)):
                setattr(self, f"{part}_{name}", _frozen(t))

    def weights(self, part: str, dtype: torch.dtype) -> torch.Tensor:
        return self.method.dequantize([getattr(self, f"{part}_{n}") for n in self.method.names],
                                      dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.method.apply_experts(self, x, topk_ids, topk_weights)


# the linears kept in the model's dtype, by their attribute name (see the module)
KEEP = ("lm_head", "embed")


def quantize_model(model: nn.Module, mode: str,
                   group_size: int | None = DEFAULT_GROUP_SIZE,
                   deterministic: bool = False, lm_head: bool = False) -> dict:
    """Replace the model's projections (and MoE experts) by quantized ones, in place.

    Every layer is checked before any is changed, so a bad group size fails with the model
    intact; ``deterministic``: the engine must be batch-invariant (a mode that is not on this
    device is refused); ``lm_head``: the LM head too (see the module's NOTE). Returns
    ``{"quantization", "group_size", "weight_bytes", "unquantized_bytes", "layers",
    "lm_head", "int4_words"}`` (int4_words: how many layers, experts included, hold int4
    words: the NOTE)."""
    if getattr(model, "tp", None) is not None:
        raise QuantError(f"quantization={mode!r} with tensor parallelism is not supported yet "
                         "(the shards would need their own group boundaries): use one device")
    method = make_method(mode, group_size)
    before = weight_bytes(model)
    device = next(model.parameters()).device
    if deterministic and device.type == "cuda" and method.not_batch_invariant:
        raise QuantError(f"deterministic=True with quantization={mode!r} is not batch-invariant "
                         f"on a GPU yet ({method.not_batch_invariant}): use "
                         f"{[m for m in QUANT_MODES if not make_method(m).not_batch_invariant]}, "
                         "or no quantization")
    targets = []                                   # (parent, attribute, qualified name)
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            qual = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and child_name not in KEEP \
                    and not (isinstance(module, MoE) and child_name == "gate"):
                method.check(qual, child.in_features, device)
                targets.append((module, child_name, qual))
        if isinstance(module, MoE):
            method.check(f"{name}.w_gate_up", module.w_gate_up.shape[-1], device)
            method.check(f"{name}.w_down", module.w_down.shape[-1], device)
            targets.append((module, None, name))
    if lm_head:
        method.check("lm_head", model.embed.weight.shape[1], device)
    for parent, attr, _ in targets:
        if attr is None:                                       # a MoE layer's experts
            parent.quant_experts = QuantExperts(parent.w_gate_up, parent.w_down, method,
                                                getattr(parent, "ckpt_codes", None))
            del parent.w_gate_up, parent.w_down
        else:
            setattr(parent, attr, QuantLinear(getattr(parent, attr), method))
    if lm_head:
        model.lm_head = QuantLinear(_head_linear(model), method)
    for m in model.modules():                  # a checkpoint's int4 codes: used or not, done
        m.__dict__.pop("ckpt_codes", None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"quantization": mode, "group_size": getattr(method, "group_size", None),
            "weight_bytes": weight_bytes(model), "unquantized_bytes": before,
            "layers": len(targets) + lm_head, "lm_head": lm_head,
            "int4_words": sum(isinstance(m, (QuantLinear, QuantExperts)) and any(
                p.dtype == torch.int32 for p in m.parameters(recurse=False))
                for m in model.modules())}


def check_lm_head(quantization: str | None, lm_head: bool) -> None:
    """``quantize_lm_head`` needs a mode. Checked where the mode is final (the runner, LLM's
    engine-less path): a checkpoint published quantized gives its own after the config is
    built."""
    if lm_head and quantization is None:
        raise QuantError("quantize_lm_head=True needs a quantization mode (--quantization fp8 / "
                         "int8 / int4): the LM head is quantized by it")


def quantize_as_configured(model: nn.Module, config) -> dict | None:
    """An engine config's quantization of ``model`` (its ``quantization``, group size,
    ``deterministic`` and ``quantize_lm_head``): ``quantize_model``'s report, or None when no
    mode is set. The runner and ``LLM``'s engine-less path both load a model this way."""
    check_lm_head(config.quantization, config.quantize_lm_head)
    if config.quantization is None:
        return None
    fitted = getattr(model, "calibrated", None)
    if config.quantization_calibration is not None and not fitted:
        raise QuantError("quantization_calibration: the model was not fitted (GPTQ runs where "
                         "the tokenizer is: entrypoints.calibration.calibrate_as_configured, "
                         "as load_engine and LLM do); load it with load_engine / LLM")
    if fitted and (f"int{fitted['bits']}" != config.quantization
                   or fitted["group"] != (config.quantization_group_size or DEFAULT_GROUP_SIZE)):
        raise QuantError(f"the model's codes were fitted for int{fitted['bits']}, group "
                         f"{fitted['group']}, but quantization={config.quantization!r}, "
                         f"quantization_group_size={config.quantization_group_size}: fit and "
                         "quantize with the same settings")
    info = quantize_model(model, config.quantization, config.quantization_group_size,
                          deterministic=config.deterministic, lm_head=config.quantize_lm_head)
    if config.quantization_calibration is not None:
        info["calibration"] = {"sources": config.quantization_calibration,
                               **model.calibrated}
    return info


def _head_linear(model: nn.Module) -> nn.Linear:
    """The model's LM head as an ``nn.Linear``: its own, or a tied model's embedding matrix
    (shared, not copied: the embedding keeps it)."""
    if model.lm_head is not None:
        return model.lm_head
    emb = model.embed.weight
    lin = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta")
    lin.weight = emb
    return lin


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as stored (quantized ones included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
