"""Mixture-of-experts MLP: a router picks ``top_k`` SwiGLU experts per token, the experts run
through ``kernels/fused_moe.op`` on packed weights, and an optional shared expert runs beside.

Routing, as LLaDA2 (inclusionAI's ``modeling_llada2_moe.py``) and DeepSeek-V3 define it, and as
SDAR / LLaDA-MoE need it without groups or bias:

1. router logits in float32 (``gate`` weight cast up), scores ``s = sigmoid(logits)`` or
   ``softmax(logits)`` over the experts;
2. choice scores ``c = s + expert_bias`` (a per-expert bias that balances the load; sigmoid only);
3. with ``n_group`` > 1: experts form ``n_group`` consecutive groups, a group scores the sum of its
   two best ``c``, the ``topk_group`` best groups stay, the rest are out;
4. the ``top_k`` best ``c`` among the experts left are chosen;
5. weights are the chosen **unbiased** ``s`` (the bias decides who, never how much), divided by
   their sum when ``norm_topk_prob``, times ``routed_scaling_factor``.

NOTE: ties (equal scores, e.g. duplicated router rows) go to the lower group / expert index:
both selections are stable sorts, so routing is a function of the scores alone, on every device
and at every batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.kernels import fused_moe
from flash_dllm.layers.mlp import SwiGLU

SCORE_FUNCTIONS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape and router options (every MoE layer of a model shares them)."""

    num_experts: int
    top_k: int                        # experts per token
    intermediate_size: int            # each expert's SwiGLU width
    num_shared_experts: int = 0       # a shared SwiGLU of num_shared_experts x intermediate_size
    score_function: str = "softmax"   # "sigmoid" (LLaDA2) or "softmax" (SDAR, LLaDA-MoE)
    expert_bias: bool = False         # a float32 per-expert bias added to the scores to choose
    n_group: int = 1                  # expert groups (1: no group-limited routing)
    topk_group: int = 1               # groups kept per token
    norm_topk_prob: bool = True       # chosen weights divided by their sum
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEConfig.{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"MoEConfig.num_shared_experts must be an integer >= 0, got "
                             f"{self.num_shared_experts!r}")
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"MoEConfig.score_function must be one of {SCORE_FUNCTIONS}, got "
                             f"{self.score_function!r}")
        if not self.routed_scaling_factor > 0:
            raise ValueError(f"MoEConfig.routed_scaling_factor must be > 0, got "
                             f"{self.routed_scaling_factor!r}")
        E, G = self.num_experts, self.n_group
        if E % G:
            raise ValueError(f"MoEConfig.n_group ({G}) must divide num_experts ({E})")
        if G > 1 and E // G < 2:
            raise ValueError(f"MoEConfig.n_group ({G}) leaves fewer than 2 experts per group "
                             f"(num_experts {E}); a group scores its two best experts")
        if not self.topk_group <= G:
            raise ValueError(f"MoEConfig.topk_group must be in [1, n_group={G}], got "
                             f"{self.topk_group}")
        if not self.top_k <= self.topk_group * (E // G):
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds the experts left after "
                             f"group selection ({self.topk_group} of {G} groups x {E // G})")
        # NOTE: the references disagree on what these combinations mean (vLLM scores softmax
        # groups by their max, not their top-2 sum), so they are refused rather than guessed.
        if self.score_function == "softmax" and self.expert_bias:
            raise ValueError("MoEConfig.expert_bias is supported with score_function 'sigmoid' "
                             "only, got 'softmax'")
        if self.score_function == "softmax" and G > 1:
            raise ValueError(f"MoEConfig.n_group: group-limited routing is supported with "
                             f"score_function 'sigmoid' only, got n_group={G} with 'softmax'")

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.intermediate_size

    def num_params(self, hidden: int) -> int:
        """Parameters of one MoE layer (router, bias, experts, shared expert)."""
        return (self.num_experts * hidden + self.num_experts * self.expert_bias
                + self.num_experts * 3 * hidden * self.intermediate_size
                + 3 * hidden * self.shared_intermediate_size)

    def active_params(self, hidden: int) -> int:
        """Parameters one token reads in one MoE layer: the whole router, ``top_k`` experts and
        the shared expert."""
        return (self.num_experts * hidden + self.num_experts * self.expert_bias
                + self.top_k * 3 * hidden * self.intermediate_size
                + 3 * hidden * self.shared_intermediate_size)


class MoE(nn.Module):
    """Router + packed experts (+ shared expert) of one layer.

    Parameters: ``gate.weight`` [E, d] (router, no bias), ``gate.expert_bias`` [E] (float32, only
    with ``cfg.expert_bias``), ``w_gate_up`` [E, 2I, d] (each expert's gate rows, then its up
    rows), ``w_down`` [E, d, I], and ``shared`` (a ``SwiGLU``, only with shared experts)."""

    # parameters kept (and saved) in float32 whatever the model's dtype: rounding the bias to
    # bf16 would change which experts are chosen
    KEEP_FLOAT32 = ("gate.expert_bias",)

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        E, I = cfg.num_experts, cfg.intermediate_size
        self.gate = nn.Linear(hidden, E, bias=False)
        if cfg.expert_bias:
            # NOTE: a parameter, not a buffer, so the strict loader demands it; explicitly
            # float32 (build() makes parameters in the model's dtype otherwise)
            self.gate.expert_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32),
                                                 requires_grad=False)
        self.w_gate_up = nn.Parameter(torch.empty(E, 2 * I, hidden))
        self.w_down = nn.Parameter(torch.empty(E, hidden, I))
        self.shared = (SwiGLU(hidden, cfg.shared_intermediate_size)
                       if cfg.num_shared_experts else None)
        # expert parallelism (``distributed/tp.ExpertShard``, set by ``shard_model``): this
        # rank's experts [ep.start, ep.end) are the packed weights above, and ``ep.combine``
        # sums the ranks' partial outputs; None on one device
        self.ep = None
        # quantized weights (``layers/quant.quantize_model``): the experts, called as
        # ``(x, ids, weights)``, replace ``w_gate_up`` / ``w_down``; None: unquantized
        self.quant_experts = None

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference: the shared expert's gate/up in one GEMM (the experts are packed already)."""
        if self.shared is not None:
            self.shared.fuse()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (topk_ids [T, top_k] int64, topk_weights [T, top_k] float32), in order of
        choice (best first)."""
        cfg = self.cfg
        T, E, G = x.shape[0], cfg.num_experts, cfg.n_group
        logits = F.linear(x.float(), self.gate.weight.float())           # [T, E]
        s = logits.sigmoid() if cfg.score_function == "sigmoid" else logits.softmax(-1)
        choice = s + self.gate.expert_bias.float() if cfg.expert_bias else s
        if G > 1:
            per = E // G
            group = choice.view(T, G, per).topk(2, dim=-1).values.sum(-1)   # [T, G]
            keep = _stable_top(group, cfg.topk_group)                      # [T, topk_group]
            allowed = torch.zeros(T, G, dtype=torch.bool, device=x.device)
            allowed.scatter_(1, keep, True)
            allowed = allowed.repeat_interleave(per, dim=1)                 # [T, E]
            choice = choice.masked_fill(~allowed, float("-inf"))
        ids = _stable_top(choice, cfg.top_k)                                # [T, top_k]
        w = s.gather(1, ids)
        if cfg.norm_topk_prob:
            # NOTE: + 1e-20 as inclusionAI's gate: below float32's resolution of any real sum
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, d = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, d)                                           # [T, d]
        ids, w = self.route(flat)
        if self.ep is not None:
            # NOTE (expert parallelism): every rank routes every token alike (same input, same
            # replicated router); shifted by this rank's first expert, the ids of the experts
            # another rank holds fall outside [0, E / N), which ``fused_moe`` skips, so this
            # rank computes exactly its experts' share of each token's weighted sum
            ids = ids - self.ep.start
        if self.quant_experts is not None:
            out = self.quant_experts(flat, ids, w)
        else:
            out = fused_moe.op(flat, self.w_gate_up, self.w_down, ids, w)
        if self.shared is not None:
            out = out + self.shared(flat)      # (under EP: this rank's slice of its width)
        if self.ep is not None:
            out = self.ep.combine(out)         # one all-reduce: routed + shared partials
        return out.view(*lead, d)


def _stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest values of each row, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
