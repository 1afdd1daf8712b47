"""Tensor parallelism (Megatron style) over a ``torch.distributed`` process group.

Each of ``world`` ranks holds a shard of every large weight:

| weights | split | after it |
|---|---|---|
| q / k / v projections (and biases) | by attention head (k / v by KV head) | nothing |
| attention output projection | by input column (the heads') | one all-reduce |
| gate / up projections | by intermediate row | nothing |
| down projection | by input column | one all-reduce |
| MoE router (and its expert bias) | replicated: every rank routes alike | nothing |
| routed experts (``w_gate_up``, ``w_down``) | by expert: [r E/N, (r+1) E/N) on rank r | |
| shared expert | gate / up by row, down by column | |
| (a MoE layer's output) | routed partial + shared partial | one all-reduce |
| LM head | by vocabulary row | a reduction of (max, argmax, logsumexp) per row |

Embeddings and norms (q/k norms included) are replicated. A rank's KV pool holds its KV heads
only; the page ledger, the scheduler and every decision are replicated (every rank runs the same
plan), so decisions that depend on attention (``flash``'s top-k, the KV sentinel) use reductions
of the per-head statistics (``reduce_heads``) and all ranks agree.

More ranks than KV heads (LLaDA2-flash's 4 on 8 GPUs): the query heads and the output projection
still split N ways, and each KV head (its k / v rows and its KV pages) is held by the N / KV
heads consecutive ranks whose query heads read it (rank r: KV head r // (N / KV heads)). Only the
k / v projections and the KV pool are duplicated; the collectives stay one group of N.

Mixture of experts (``ExpertShard``): the experts are split by expert (expert parallelism) over
the same ranks as the heads. After the attention's all-reduce every rank holds the same hidden
states, so every rank computes the same routing (replicated router, float32) for every token,
runs its own experts on the pairs routed to them (the ids of other ranks' experts fall outside
[0, E/N) once shifted by the rank's first expert, and ``fused_moe`` skips such ids), adds its
slice of the shared expert, and one all-reduce sums the ranks' partial outputs: the same
collective, and the same bytes, as a dense layer's down projection. The all-to-all alternative
(send each token only to the ranks of its experts) and when it would pay: ``docs/scaling.md``.

The greedy proposal never gathers the logits: each rank reduces its vocabulary slice to (best
logit, its index, logsumexp) per row and one all-gather of those three numbers per row combines
them (``VocabParallel.greedy``: the argmax is the first index of the largest logit, the
confidence its softmax probability over the whole vocabulary, as ``kernels/argmax_confidence``).
Only sampled rows, Flash-Verify's mask views and the logit sentinels gather full rows.

NOTE: weights are sharded while the model is still on the ``meta`` device (``shard_model``), so a
rank allocates and loads only its shard (``models/loader.load_model(..., tp=...)`` reads the slices
from the safetensors files).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# torch 2.13 renamed ``all_gather_into_tensor`` (deprecated there) to ``all_gather_single``
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TPGroup:
    """This rank's place in a tensor-parallel group (``group=None``: the default group)."""

    rank: int
    world: int
    group: object = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's ``t`` (same shape on all ranks)."""
        out = torch.empty((self.world * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)      # concatenated along dim 0 (NCCL and gloo)
        _all_gather_single(out, t.contiguous(), group=self.group)
        return out.view(self.world, *t.shape)

    def min_int(self, v: int, device) -> int:
        """The smallest ``v`` over the ranks."""
        t = torch.tensor([v], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of ``n`` units split evenly (``what`` names them in errors)."""
        if n % self.world:
            raise ValueError(f"tensor_parallel_size {self.world} must divide {what} ({n})")
        k = n // self.world
        return self.rank * k, (self.rank + 1) * k


def check_divisible(cfg, world: int) -> None:
    """Raise before anything starts when ``world`` cannot split this model."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world > cfg.num_kv_heads and world % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world} must divide the model's num_kv_heads "
                         f"({cfg.num_kv_heads}) or be a multiple of it")
    sizes = [("num_heads", cfg.num_heads)]
    if world <= cfg.num_kv_heads:
        sizes.append(("num_kv_heads", cfg.num_kv_heads))
    if cfg.mlp_kind == "dense" or cfg.dense_layers:        # (a MoE model may have no dense MLP)
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.moe is not None:
        sizes.append(("num_experts", cfg.moe.num_experts))
        if cfg.moe.num_shared_experts:
            sizes.append(("shared expert width (num_shared_experts x moe_intermediate_size)",
                          cfg.moe.shared_intermediate_size))
    sizes.append(("vocab_size", cfg.vocab_size))
    for what, n in sizes:
        if n % world:
            raise ValueError(f"tensor_parallel_size {world} must divide the model's {what} ({n})")


# --------------------------------------------------------------------------------- the shards
def shard_slices(name: str, shape: tuple, cfg, tp: TPGroup) -> tuple[slice, ...] | None:
    """Which part of the full engine parameter ``name`` (of full ``shape``) this rank holds, as
    a tuple of slices; None when it is replicated. ``name``: the unfused engine parameter name."""
    D = cfg.head_dim
    parts = name.split(".")
    leaf, module = parts[-1], ".".join(parts[-3:-1]) if len(parts) >= 3 else ""
    full = [slice(None)] * len(shape)
    if len(parts) >= 2 and parts[-2] == "mlp" and leaf in ("w_gate_up", "w_down"):
        a, b = tp.span(cfg.moe.num_experts, "num_experts")      # [E, ...]: by expert
        full[0] = slice(a, b)
    elif module in ("shared.gate_proj", "shared.up_proj"):
        a, b = tp.span(cfg.moe.shared_intermediate_size, "shared expert width")
        full[0] = slice(a, b)
    elif module == "shared.down_proj" and leaf == "weight":
        a, b = tp.span(cfg.moe.shared_intermediate_size, "shared expert width")
        full[1] = slice(a, b)
    elif module in ("attn.q_proj",):
        a, b = tp.span(cfg.num_heads, "num_heads")
        full[0] = slice(a * D, b * D)
    elif module in ("attn.k_proj", "attn.v_proj"):
        a, b = kv_head_span(cfg.num_kv_heads, tp)
        full[0] = slice(a * D, b * D)
    elif module == "attn.o_proj" and leaf == "weight":
        a, b = tp.span(cfg.num_heads, "num_heads")
        full[1] = slice(a * D, b * D)
    elif module in ("mlp.gate_proj", "mlp.up_proj"):
        a, b = tp.span(cfg.intermediate_size, "intermediate_size")
        full[0] = slice(a, b)
    elif module == "mlp.down_proj" and leaf == "weight":
        a, b = tp.span(cfg.intermediate_size, "intermediate_size")
        full[1] = slice(a, b)
    elif name == "lm_head.weight":
        a, b = tp.span(cfg.vocab_size, "vocab_size")
        full[0] = slice(a, b)
    else:
        return None
    return tuple(full)


def kv_head_span(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """This rank's KV heads [start, end): its 1/N share, or, with more ranks than KV heads, the
    one KV head its query heads read (query heads [r H/N, (r+1) H/N) lie in one group of
    H / num_kv_heads when N is a multiple of num_kv_heads)."""
    if tp.world <= num_kv_heads:
        return tp.span(num_kv_heads, "num_kv_heads")
    if tp.world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.world} must divide the model's "
                         f"num_kv_heads ({num_kv_heads}) or be a multiple of it")
    head = tp.rank // (tp.world // num_kv_heads)
    return head, head + 1


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x @ W_shard^T)``: the partial sums of every rank's input columns."""

    def __init__(self, weight: nn.Parameter, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight
        self.bias = None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabParallel:
    """The LM head's vocabulary shard [start, end) and the reductions over the ranks."""

    def __init__(self, tp: TPGroup, vocab: int) -> None:
        self.tp = tp
        self.start, self.end = tp.span(vocab, "vocab_size")

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[..., V / world] -> [..., V]: the full logits (sampling, verify, sentinels; the dense
        forward's [B, L, V] for ``LLM.logits``)."""
        parts = self.tp.all_gather(local)                   # [world, ..., V / world]
        return parts.movedim(0, -2).reshape(*local.shape[:-1], -1)

    def greedy(self, local: torch.Tensor, forbid: int | None) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """``argmax_confidence`` over the whole vocabulary from this rank's slice: per row the
        first index of the largest logit (``forbid`` excluded) and its softmax probability
        (``forbid`` kept in the normaliser, as ``decoding.sampling.propose``)."""
        x = local.float()
        lse = torch.logsumexp(x, dim=-1)                            # [rows]
        if forbid is not None and self.start <= forbid < self.end:
            if x.data_ptr() == local.data_ptr():                    # fp32: .float() copied nothing
                x = x.clone()
            x[:, forbid - self.start] = float("-inf")
        best, idx = x.max(dim=-1)                                   # first max, local index
        stats = torch.stack([best, (idx + self.start).to(torch.float32), lse])   # [3, rows]
        # NOTE: vocabulary indices are exact in float32 below 2^24 (LLaDA 126464, Dream 152064)
        allr = self.tp.all_gather(stats)                            # [world, 3, rows]
        bests, idxs, lses = allr[:, 0], allr[:, 1], allr[:, 2]
        top = bests.max(dim=0).values                               # [rows]
        # ties across ranks: the lowest rank holds the lowest index (argmax's first occurrence)
        owner = (bests == top[None]).to(torch.int8).argmax(dim=0)
        token = idxs.gather(0, owner[None]).squeeze(0).to(torch.int64)
        total = torch.logsumexp(lses, dim=0)
        return token, torch.exp(top - total)


def shard_model(model, tp: TPGroup) -> None:
    """Turn a full-shape model into this rank's shard, in place: every sharded parameter is
    replaced by its slice (on the model's device: a ``meta`` model stays weightless until the
    loader fills it), row-parallel layers all-reduce, the attention modules know their local
    heads, and the model's LM head reduces over the vocabulary (``model.tp``)."""
    cfg = model.cfg
    check_divisible(cfg, tp.world)
    full_shapes: dict[str, tuple[int, ...]] = {}
    for name, p in list(model.named_parameters()):
        sl = shard_slices(name, tuple(p.shape), cfg, tp)
        if sl is None:
            continue
        full_shapes[name] = tuple(p.shape)
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        leaf = name.rsplit(".", 1)[1]
        with torch.no_grad():
            local = nn.Parameter(p[sl].clone() if p.device.type != "meta" else
                                 torch.empty_like(p[sl]), requires_grad=False)
        setattr(owner, leaf, local)
    kv0, kv1 = kv_head_span(cfg.num_kv_heads, tp)
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        a.num_heads //= tp.world
        a.num_kv_heads = kv1 - kv0
        a.o_proj = RowParallelLinear(a.o_proj.weight, tp)
        if hasattr(m, "w_gate_up"):              # a MoE layer: its forward all-reduces once
            m.ep = ExpertShard(*tp.span(cfg.moe.num_experts, "num_experts"), tp)
        else:
            m.down_proj = RowParallelLinear(m.down_proj.weight, tp)
    model.tp = TPState(tp, VocabParallel(tp, cfg.vocab_size), kv1 - kv0, full_shapes)


@dataclass
class ExpertShard:
    """A MoE layer's experts on this rank, [start, end) of the model's, and the sum of the
    ranks' partial outputs (``layers/moe.MoE.forward``)."""

    start: int
    end: int
    group: TPGroup

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """[T, d] this rank's experts' and shared-expert slice's output -> the layer's output.

        NOTE: one all-reduce per MoE layer, not one for the experts and one for the shared
        expert: both are partial sums of the same output, so their sum is reduced once."""
        return self.group.all_reduce(partial)


@dataclass
class TPState:
    """What a sharded model carries: its group, the LM head's vocabulary shard, its KV heads
    (what its KV pool holds), and the full shape of every sharded parameter (the loader maps
    checkpoint tensors by full shapes)."""

    group: TPGroup
    vocab: VocabParallel
    kv_heads: int
    full_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.group.world

    def reduce_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a per-head statistic (attention mass) over the ranks' heads, in place."""
        return self.group.all_reduce(t)
