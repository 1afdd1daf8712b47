"""GPTQ: int8 / int4 codes fitted to calibration activations (Frantar et al., 2022), at load.

Round-to-nearest (``quant_decode.quantize``) picks each weight's code alone; GPTQ picks them one
input column at a time and moves the columns not yet quantized to absorb the error, weighted by
the layer's input statistics ``H = sum x x^T`` over calibration tokens, so the layer's *output*
on such inputs moves least. The result is in the same layout as round-to-nearest (symmetric
codes, one float16 scale per ``group`` inputs, chosen per row when the column loop reaches the
group, after the earlier columns' corrections: by least squared error over amax / (qmax - 1 ...
qmax + 2), either sign for int4, as ``_group_scale`` says; ``SEARCH`` False: amax / qmax), so
every kernel runs it unchanged; only the codes differ.

``calibrate(model, samples, bits, group)`` runs the model's dense forward over the calibration
sequences block by block (true-sequential, as the paper: block ``l``'s inputs come from blocks
``0 .. l-1`` already quantized), and for every projection ``quantize_model`` would quantize it

- writes the dequantized weight into the parameter (so later blocks see the quantized model),
- leaves the codes as ``ckpt_codes`` in the form a checkpoint's int4 codes take
  (``(codes, scales, group)``), which ``layers/quant.IntMethod`` then uses as they are.

A MoE layer's experts get one ``H`` each from the tokens routed to them (gate/up: their inputs;
down: their SwiGLU activations times the routing weight, the scale their output is summed with),
fitted ``EXPERT_CHUNK`` at a time in one batched loop; an expert routed fewer tokens than a weight
has inputs is rounded to nearest (on the searched scale) instead, as is any input column that was
always zero: a fit to a rank-deficient ``H`` does worse than rounding on other inputs (MoE models
want more samples: LLaDA2-mini's 256 experts, 8 a token, see 2048-wide inputs). The router,
embeddings and LM head are not touched.

Cost: a partial dense forward of every sample per block (blocks ``0 .. l`` for block ``l``: about
L / 2 whole forwards for L blocks), and per weight a Cholesky of ``H`` (``K x K``) and ``K``
column steps of a few small kernels each (batched over experts); memory: one block's ``H``
(LLaDA-8B's largest, the down projection's 12288^2, 0.6 GB in float32; LLaDA2-mini's 256
experts' gate/up ``H``, 4 GB). Neither real model was fitted here (no real weights).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.kernels import quant_decode
from flash_dllm.layers.moe import MoE

_QMAX = {8: 127, 4: 7}
SEARCH = True               # each group's scale by least squared error (``_group_scale``)
DAMP = 0.01                 # of H's mean diagonal, added to the diagonal (the paper's 1 %)
EXPERT_CHUNK = 32           # MoE experts fitted together (one batched column loop)


def gptq_quantize(w: torch.Tensor, H: torch.Tensor, bits: int, group: int,
                  damp: float | None = None,
                  search: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of ``w [N, K]`` under input statistics ``H [K, K]`` (sum of x x^T), or of a batch
    ``w [B, N, K]``, ``H [B, K, K]`` (experts): ``(codes, scales)`` in
    ``quant_decode.quantize``'s layout. A column no input reached (its ``H`` diagonal 0; all of
    them for an ``H`` of zeros) gets no error from the others and passes none on: with ``H`` all
    zero the codes are round to nearest's, on the scale ``_group_scale`` chooses. ``damp`` /
    ``search``: None takes the module's ``DAMP`` / ``SEARCH``."""
    damp = DAMP if damp is None else damp
    search = SEARCH if search is None else search
    one = w.dim() == 2
    W = w.detach().float().clone()
    H = H.detach().float().clone()
    if one:
        W, H = W[None], H[None]
    B, N, K = W.shape
    qmax = _QMAX[bits]
    dead = torch.diagonal(H, dim1=-2, dim2=-1) <= 0                        # [B, K]
    H.masked_fill_(dead[:, :, None] | dead[:, None, :], 0.0)
    diag = torch.diagonal(H, dim1=-2, dim2=-1)                             # (a view)
    diag.add_(dead.float())               # a column no input reached: quantized alone
    diag.add_(damp * diag.mean(-1, keepdim=True))
    U = _inverse_cholesky_upper(H)
    Q = torch.empty(B, N, K, dtype=torch.int8, device=W.device)
    scales = torch.empty(B, N, K // group, dtype=quant_decode.SCALE_DTYPE, device=W.device)
    block = group * max(1, 128 // group)  # column blocks hold whole groups
    scale = None
    for b0 in range(0, K, block):
        b1 = min(b0 + block, K)
        W1, U1 = W[:, :, b0:b1].clone(), U[:, b0:b1, b0:b1]
        E1 = torch.zeros_like(W1)
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:            # the group's scale, from its columns as they are now
                scale = _group_scale(W1[:, :, i:i + group], bits, search)
                scales[:, :, c // group] = scale
            s = scale.float()
            col = W1[:, :, i]
            q = torch.round(col / s).clamp(-qmax - (bits == 4), qmax)
            Q[:, :, c] = q.to(torch.int8)
            err = (col - q * s) / U1[:, i, i][:, None]
            W1[:, :, i:] -= err[:, :, None] * U1[:, i, i:][:, None, :]
            E1[:, :, i] = err
        W[:, :, b1:] -= E1 @ U[:, b0:b1, b1:]
    if bits == 4:
        u = (Q + 8).to(torch.uint8)
        Q = u[..., 0::2] | (u[..., 1::2] << 4)
    if one:
        Q, scales = Q[0], scales[0]
    return Q.contiguous(), scales.contiguous()


def _group_scale(g: torch.Tensor, bits: int, search: bool) -> torch.Tensor:
    """One group's scale per row (float16) of ``g [..., rows, group]``: amax / qmax, or with
    ``search`` the candidate of least squared error over amax / d, d in qmax - 1 ... qmax + 2
    in quarters, either sign (int4's codes run -8 ... 7: a negative scale puts the largest
    weight on -8's side)."""
    qmax = _QMAX[bits]
    big = g.gather(-1, g.abs().argmax(-1, keepdim=True))[..., 0]
    if not search:
        return (big.abs() / qmax).clamp_min(1e-7).to(quant_decode.SCALE_DTYPE)
    best = scale = None
    for d in [qmax - 1 + k / 4 for k in range(13)]:
        for sign in ((1.0, -1.0) if bits == 4 else (1.0,)):
            s = (sign * (big.abs() / d).clamp_min(1e-7)).to(quant_decode.SCALE_DTYPE)
            sf = s.float()[..., None]
            err = ((torch.round(g / sf).clamp(-qmax - (bits == 4), qmax) * sf - g) ** 2).sum(-1)
            if best is None:
                best, scale = err, s
            else:
                better = err < best
                best, scale = torch.where(better, err, best), torch.where(better, s, scale)
    return scale


def _inverse_cholesky_upper(H: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factors of ``H^-1`` ([B, K, K]; the paper's form of the column
    updates), adding damping to a matrix that does not factor until it does (float32 rounding
    on a nearly singular ``H``)."""
    eye = torch.eye(H.shape[-1], device=H.device)
    extra = torch.zeros(H.shape[0], device=H.device)
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(H + extra[:, None, None] * eye)
        bad = info > 0
        if not bad.any():
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        floor = 1e-6 * torch.diagonal(H, dim1=-2, dim2=-1).mean(-1)
        extra = torch.where(bad, torch.maximum(extra * 10, floor), extra)
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
    layers: int = 0                       # projections fitted (a MoE layer's experts: two)
    experts_fitted: int = 0               # MoE experts with at least as many tokens as inputs
    experts_rounded: int = 0              # the others: rounded to nearest (``_fit_experts``)
    tokens: int = 0
    seconds: float = 0.0
    # the mean over fitted matrices (each expert's one) of ||(W - Wq) X||^2 / ||W X||^2 on
    # the calibration inputs, round to nearest's and GPTQ's
    relative_error_rtn: float = 0.0
    relative_error_gptq: float = 0.0
    _sums: list = field(default_factory=lambda: [0.0, 0.0, 0])

    def add(self, rtn: torch.Tensor, fitted: torch.Tensor) -> None:
        self._sums[0] += float(rtn.sum())
        self._sums[1] += float(fitted.sum())
        self._sums[2] += rtn.numel()

    def as_dict(self) -> dict:
        n = max(self._sums[2], 1)
        self.relative_error_rtn, self.relative_error_gptq = self._sums[0] / n, self._sums[1] / n
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in vars(self).items()
                if not k.startswith("_")}


def _targets(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every ``nn.Linear`` ``quantize_model`` quantizes in ``block``."""
    out = []
    for module in block.modules():
        for name, child in module.named_children():
            if type(child) is nn.Linear and not (isinstance(module, MoE) and name == "gate"):
                out.append((module, name))
    return out


def target_widths(model: nn.Module) -> list[tuple[str, int]]:
    """(qualified name, input width) of every weight ``calibrate`` fits, in block order: each
    block's projections (``_targets``) and a MoE layer's ``w_gate_up`` / ``w_down``. The one
    list the callers check group sizes (and the packed format's widths) against."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for block in model.layers:
        out += [(f"{names[id(parent)]}.{name}", getattr(parent, name).in_features)
                for parent, name in _targets(block)]
        out += [(f"{names[id(m)]}.{part}", getattr(m, part).shape[-1])
                for m in block.modules() if isinstance(m, MoE)
                for part in ("w_gate_up", "w_down")]
    return out


def _relative_error(w: torch.Tensor, wq: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``||(W - Wq) X||^2 / ||W X||^2`` per matrix of a batch ``[B, N, K]``, from ``H = X^T X``."""
    w = w.float()
    d = w - wq.float()
    return ((d @ H) * d).sum((1, 2)) / ((w @ H) * w).sum((1, 2)).clamp_min(1e-30)


@torch.no_grad()
def _fit(weight: torch.Tensor, H: torch.Tensor, bits: int, group: int, report) -> tuple:
    """GPTQ ``weight`` ([N, K], or a batch [B, N, K] with ``H`` [B, K, K]) in place (its
    dequantized value) -> its ``(codes, scales)``."""
    codes, scales = gptq_quantize(weight, H, bits, group)
    wq = quant_decode.dequantize(codes, scales, bits)
    w3, wq3, H3 = (t if weight.dim() == 3 else t[None] for t in (weight, wq, H))
    fitted = H3.flatten(1).any(1)
    if fitted.any():
        rtn = quant_decode.dequantize(*quant_decode.quantize(w3[fitted], bits, group), bits)
        report.add(_relative_error(w3[fitted], rtn, H3[fitted]),
                   _relative_error(w3[fitted], wq3[fitted], H3[fitted]))
    weight.copy_(wq.to(weight.dtype))
    return codes, scales


def _fit_experts(stats: "_ExpertStats", bits: int, group: int, report) -> dict:
    """A MoE layer's experts, ``EXPERT_CHUNK`` at a time: an expert routed fewer tokens than a
    weight has inputs gets ``H`` = 0 for it (round to nearest: its ``H`` would be rank-deficient,
    and a fit to it does worse than rounding on other inputs). -> ``ckpt_codes``."""
    moe, codes = stats.moe, {}
    for part, H in (("w_gate_up", stats.H_gate_up), ("w_down", stats.H_down)):
        w = getattr(moe, part).data
        few = stats.tokens.to(H.device) < w.shape[-1]
        H.masked_fill_(few[:, None, None], 0.0)
        fits = [_fit(w[e:e + EXPERT_CHUNK], H[e:e + EXPERT_CHUNK], bits, group, report)
                for e in range(0, len(w), EXPERT_CHUNK)]
        codes[part] = (torch.cat([f[0] for f in fits]), torch.cat([f[1] for f in fits]), group)
        if part == "w_gate_up":
            report.experts_rounded += int(few.sum())
            report.experts_fitted += int((~few).sum())
    return codes


@torch.no_grad()
def _collect(model: nn.Module, li: int, samples, device) -> tuple[list, list]:
    """Block ``li``'s input statistics: ``(recorders, expert stats)`` after a forward of every
    sample stopped past that block; the model is left as it was, whatever happens."""
    blocks = model.layers
    recs, hooks = [], []
    try:
        for parent, name in _targets(blocks[li]):
            rec = _Recorder(getattr(parent, name))
            setattr(parent, name, rec)
            recs.append((parent, name, rec))
        stats = [_ExpertStats(m) for m in blocks[li].modules() if isinstance(m, MoE)]
        hooks = [s.moe.register_forward_pre_hook(s) for s in stats]
        if li + 1 < len(blocks):         # (``hidden`` calls each block's attention, not it)
            hooks.append(blocks[li + 1].attn.register_forward_pre_hook(_stop))
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
    return recs, stats


@torch.no_grad()
def calibrate(model: nn.Module, samples: list[torch.Tensor], bits: int, group: int,
              progress=None) -> dict:
    """GPTQ every projection of ``model`` (a ``DiffusionTransformer``) over ``samples`` (1-D
    token-id tensors), block by block, in place (the module's docstring); returns a report.
    ``progress(i, n)`` is called after each block."""
    import time
    if bits not in _QMAX:
        raise ValueError(f"gptq: bits must be one of {sorted(_QMAX)}, got {bits}")
    if any(isinstance(m, MoE) and m.ep is not None for m in model.modules()):
        raise ValueError("gptq: calibration with expert parallelism is not supported (each "
                         "rank holds a share of the experts): calibrate on one device")
    t0 = time.time()
    report = CalibrationReport(tokens=sum(len(s) for s in samples))
    device = next(model.parameters()).device
    for li in range(len(model.layers)):
        recs, stats = _collect(model, li, samples, device)
        for _, _, rec in recs:
            rec.linear.ckpt_codes = {"weight": (*_fit(rec.linear.weight, rec.H, bits, group,
                                                      report), group)}
            report.layers += 1
        for st in stats:
            st.moe.ckpt_codes = _fit_experts(st, bits, group, report)
            report.layers += 2
        del recs, stats
        if progress is not None:
            progress(li + 1, len(model.layers))
    report.seconds = time.time() - t0
    model.calibrated = {"bits": bits, "group": group, **report.as_dict()}
    return report.as_dict()


__all__ = ["gptq_quantize", "calibrate", "target_widths", "DAMP"]
