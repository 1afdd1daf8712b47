"""GPTQ: int8 / int4 codes fitted to calibration activations (Frantar et al., 2022), at load.

Round-to-nearest (``quant_decode.quantize``) picks each weight's code alone; GPTQ picks them one
input column at a time and moves the columns not yet quantized to absorb the error, weighted by
the layer's input statistics ``H = sum x x^T`` over calibration tokens, so the layer's *output*
on such inputs moves least. The result is in the same layout as round-to-nearest (symmetric
codes, one float16 scale per ``group`` inputs: the scale of a group is its amax / 7 (int4) or
/ 127 (int8) taken when the column loop reaches it, after the earlier columns' corrections), so
every kernel runs it unchanged; only the codes differ.

``calibrate(model, samples, bits, group)`` runs the model's dense forward over the calibration
sequences block by block (true-sequential, as the paper: block ``l``'s inputs come from blocks
``0 .. l-1`` already quantized), and for every projection ``quantize_model`` would quantize it

- writes the dequantized weight into the parameter (so later blocks see the quantized model),
- leaves the codes as ``ckpt_codes`` in the form a checkpoint's int4 codes take
  (``(codes, scales, group)``), which ``layers/quant.IntMethod`` then uses as they are.

A MoE layer's experts get one ``H`` each from the tokens routed to them (gate/up: their inputs;
down: their SwiGLU activations times the routing weight, the scale their output is summed with);
an expert no calibration token reached, and any input column that was always zero, fall back to
round-to-nearest (``H`` = identity there). The router, embeddings and LM head are not touched.

Cost: one partial dense forward of every sample per block, and per layer a Cholesky of ``H``
(``K x K``) and ``K`` rank-1 updates of the weight; memory: one block's ``H`` (LLaDA-8B's
largest, the down projection's 12288^2, 0.6 GB in float32; LLaDA2-mini's 256 experts' gate/up
``H``, 4 GB).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.kernels import quant_decode
from flash_dllm.layers.moe import MoE

_QMAX = {8: 127, 4: 7}
SEARCH = True               # each group's scale by least squared error (``_group_scale``)
DAMP = 0.01                 # of H's mean diagonal, added to the diagonal (the paper's 1 %)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group: int,
                  damp: float = DAMP, search: bool = SEARCH) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one weight ``w [N, K]`` under input statistics ``H [K, K]`` (sum of x x^T):
    ``(codes, scales)`` in ``quant_decode.quantize``'s layout. ``H`` all zero (no calibration
    input): round-to-nearest's codes."""
    N, K = w.shape
    qmax = _QMAX[bits]
    W = w.detach().float().clone()
    H = H.detach().float().clone()
    dead = torch.diag(H) <= 0
    H[dead, :] = 0
    H[:, dead] = 0
    H[dead, dead] = 1.0                   # a column no input reached: quantized alone (RTN)
    H.diagonal().add_(damp * torch.diag(H).mean())
    U = _inverse_cholesky_upper(H)
    Q = torch.empty(N, K, dtype=torch.int8, device=W.device)
    scales = torch.empty(N, K // group, dtype=quant_decode.SCALE_DTYPE, device=W.device)
    block = group * max(1, 128 // group)  # column blocks hold whole groups
    scale = None
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        W1, U1 = W[:, b0:b1].clone(), U[b0:b1, b0:b1]
        E1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:            # the group's scale, from its columns as they are now
                scale = _group_scale(W1[:, i:i + group], bits, search)
                scales[:, c // group] = scale
            s = scale.float()
            col = W1[:, i]
            q = torch.round(col / s).clamp(-qmax - (bits == 4), qmax)
            Q[:, c] = q.to(torch.int8)
            err = (col - q * s) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, b1:] -= E1 @ U[b0:b1, b1:]
    if bits == 4:
        u = (Q + 8).to(torch.uint8)
        Q = u[:, 0::2] | (u[:, 1::2] << 4)
    return Q.contiguous(), scales.contiguous()


def _group_scale(g: torch.Tensor, bits: int, search: bool) -> torch.Tensor:
    """One group's scale per row (float16): amax / qmax, or with ``search`` the candidate of
    least squared error over amax / d, d in qmax - 1 ... qmax + 2 in quarters, either sign
    (int4's codes run -8 ... 7: a negative scale puts the largest weight on -8's side)."""
    qmax = _QMAX[bits]
    big = g.gather(1, g.abs().argmax(1, keepdim=True))[:, 0]
    if not search:
        return (big.abs() / qmax).clamp_min(1e-7).to(quant_decode.SCALE_DTYPE)
    best = scale = None
    for d in [qmax - 1 + k / 4 for k in range(13)]:
        for sign in ((1.0, -1.0) if bits == 4 else (1.0,)):
            s = (sign * (big.abs() / d).clamp_min(1e-7)).to(quant_decode.SCALE_DTYPE)
            sf = s.float()[:, None]
            err = ((torch.round(g / sf).clamp(-qmax - (bits == 4), qmax) * sf - g) ** 2).sum(1)
            if best is None:
                best, scale = err, s
            else:
                better = err < best
                best, scale = torch.where(better, err, best), torch.where(better, s, scale)
    return scale


def _inverse_cholesky_upper(H: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of ``H^-1`` (the paper's form of the column updates), adding
    damping until ``H`` factors (float32 rounding on a nearly singular ``H``)."""
    extra = 0.0
    for _ in range(8):
        try:
            L = torch.linalg.cholesky(H + extra * torch.eye(len(H), device=H.device))
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        except torch.linalg.LinAlgError:
            extra = max(extra * 10, 1e-6 * float(torch.diag(H).mean()))
    raise torch.linalg.LinAlgError("gptq: the calibration Hessian does not factor")


class _Recorder(nn.Module):
    """Stands in for an ``nn.Linear`` during calibration: the same output, and ``H += x^T x``.
    (Not an ``nn.Linear``: ``layers/linear.dense`` then calls it rather than its weight.)"""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        k = linear.in_features
        self.H = torch.zeros(k, k, dtype=torch.float32, device=linear.weight.device)
        self.tokens = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = x.reshape(-1, x.shape[-1]).float()
        self.H.addmm_(f.t(), f)
        self.tokens += f.shape[0]
        return F.linear(x, self.linear.weight, self.linear.bias)


class _ExpertStats:
    """A MoE layer's experts' ``H`` (gate/up inputs; down inputs times the routing weight),
    collected by a forward pre-hook from its own routing of the layer's input."""

    def __init__(self, moe: MoE) -> None:
        E, I2, d = moe.w_gate_up.shape
        dev = moe.w_gate_up.device
        self.moe = moe
        self.H_gate_up = torch.zeros(E, d, d, device=dev)
        self.H_down = torch.zeros(E, I2 // 2, I2 // 2, device=dev)
        self.tokens = torch.zeros(E, dtype=torch.long)

    @torch.no_grad()
    def __call__(self, module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1])
        ids, w = self.moe.route(x)
        I = self.moe.w_gate_up.shape[1] // 2
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            xe = x[rows].float()
            gu = xe @ self.moe.w_gate_up[e].float().t()
            h = F.silu(gu[:, :I]) * gu[:, I:] * w[rows, slot].float()[:, None]
            self.H_gate_up[e].addmm_(xe.t(), xe)
            self.H_down[e].addmm_(h.t(), h)
            self.tokens[e] += len(rows)


class _Stop(Exception):
    """Raised to end a calibration forward once the block being calibrated has run."""


def _stop(*_):
    raise _Stop


@dataclass
class CalibrationReport:
    layers: int = 0                       # projections fitted (a MoE layer's experts: one each)
    experts_unreached: int = 0            # experts no calibration token was routed to (RTN)
    tokens: int = 0
    seconds: float = 0.0
    relative_error_rtn: float = 0.0       # sum over layers of ||(W - Wq) X||^2 / ||W X||^2
    relative_error_gptq: float = 0.0

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in vars(self).items()}


def _targets(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every ``nn.Linear`` ``quantize_model`` quantizes in ``block``."""
    out = []
    for module in block.modules():
        for name, child in module.named_children():
            if type(child) is nn.Linear and not (isinstance(module, MoE) and name == "gate"):
                out.append((module, name))
    return out


def _output_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> tuple[float, float]:
    """``||(W - Wq) X||^2`` and ``||W X||^2`` from ``H = X^T X`` (traces)."""
    d = (w - wq).float()
    return float(((d @ H) * d).sum()), float(((w.float() @ H) * w.float()).sum())


@torch.no_grad()
def _fit(weight: torch.Tensor, H: torch.Tensor, bits: int, group: int, report) -> tuple:
    """GPTQ ``weight`` in place (its dequantized value) -> its ``(codes, scales, group)``."""
    codes, scales = gptq_quantize(weight, H, bits, group)
    wq = quant_decode.dequantize(codes, scales, bits)
    if H.any():
        rtn = quant_decode.dequantize(*quant_decode.quantize(weight, bits, group), bits)
        e_rtn, ref = _output_error(weight, rtn, H)
        e_gptq, _ = _output_error(weight, wq, H)
        report.relative_error_rtn += e_rtn / max(ref, 1e-30)
        report.relative_error_gptq += e_gptq / max(ref, 1e-30)
    weight.copy_(wq.to(weight.dtype))
    return codes, scales, group


@torch.no_grad()
def calibrate(model: nn.Module, samples: list[torch.Tensor], bits: int, group: int,
              progress=None) -> dict:
    """GPTQ every projection of ``model`` (a ``DiffusionTransformer``) over ``samples`` (1-D
    token-id tensors), block by block, in place (the module's docstring); returns a report.
    ``progress(i, n)`` is called after each block."""
    import time
    if bits not in _QMAX:
        raise ValueError(f"gptq: bits must be one of {sorted(_QMAX)}, got {bits}")
    t0 = time.time()
    report = CalibrationReport(tokens=sum(len(s) for s in samples))
    device = next(model.parameters()).device
    blocks = model.layers
    for li, block in enumerate(blocks):
        targets = _targets(block)
        recs = []
        for parent, name in targets:
            rec = _Recorder(getattr(parent, name))
            setattr(parent, name, rec)
            recs.append((parent, name, rec))
        moes = [m for m in block.modules() if isinstance(m, MoE)]
        stats = [_ExpertStats(m) for m in moes]
        hooks = [m.register_forward_pre_hook(s) for m, s in zip(moes, stats)]
        if li + 1 < len(blocks):         # (``hidden`` calls each block's attention, not it)
            hooks.append(blocks[li + 1].attn.register_forward_pre_hook(_stop))
        try:
            for ids in samples:
                try:
                    model(ids.to(device)[None])
                except _Stop:
                    pass
        finally:
            for h in hooks:
                h.remove()
            for parent, name, rec in recs:
                setattr(parent, name, rec.linear)
        for parent, name, rec in recs:
            rec.linear.ckpt_codes = {"weight": _fit(rec.linear.weight, rec.H, bits, group,
                                                    report)}
            report.layers += 1
        for s in stats:
            moe, codes = s.moe, {}
            for part, H in (("w_gate_up", s.H_gate_up), ("w_down", s.H_down)):
                w = getattr(moe, part)
                fits = [_fit(w.data[e], H[e], bits, group, report) for e in range(len(w))]
                codes[part] = (torch.stack([f[0] for f in fits]),
                               torch.stack([f[1] for f in fits]), group)
            moe.ckpt_codes = codes
            report.layers += 2
            report.experts_unreached += int((s.tokens == 0).sum())
        if progress is not None:
            progress(li + 1, len(blocks))
    report.seconds = time.time() - t0
    model.calibrated = {"bits": bits, "group": group, **report.as_dict()}
    return report.as_dict()


__all__ = ["gptq_quantize", "calibrate", "DAMP"]
