"""The pre-norm decoder stack every family shares (LLaDA, Dream, LLaDA2, LLaDA-MoE, SDAR: they
differ in names and options, not math); its attention pattern, q/k norm, partial rotary and
per-layer MLP kind (dense SwiGLU or mixture of experts) come from ``ModelConfig``, so the next
families can build it too."""
from __future__ import annotations

import torch
from torch import nn

from flash_dllm.kernels import argmax_confidence
from flash_dllm.layers.attention import Attention, AttentionPattern, DenseContext
from flash_dllm.layers.mlp import SwiGLU
from flash_dllm.layers.moe import MoE
from flash_dllm.layers.norm import RMSNorm, add_rmsnorm
from flash_dllm.layers.rotary import Rotary
from flash_dllm.models.config import MLP_KINDS, ModelConfig


def build_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP, of its kind (``ModelConfig.layer_mlp_kind``)."""
    kind = cfg.layer_mlp_kind(layer)
    if kind == "dense":
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    if kind == "moe":
        return MoE(cfg.hidden_size, cfg.moe)
    raise ValueError(f"no MLP of kind {kind!r} (layer {layer}); known: {MLP_KINDS}")


class Block(nn.Module):
    """One layer's modules: ``h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h))``, run by
    ``DiffusionTransformer.hidden`` with each residual add fused into the following norm."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.qkv_bias, rotary, pattern=cfg.attention,
                              qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_mlp(cfg, layer)


class DiffusionTransformer(nn.Module):
    """Token ids -> hidden states -> logits, attending as ``cfg.attention`` says (no causal mask:
    bidirectional, or block-causal for the block-diffusion families).

    ``forward(ids)`` on a ``[B, L]`` batch returns logits ``[B, L, V]`` *as the checkpoint defines
    them* (Dream's are not yet shifted). The engine instead calls ``hidden`` on packed tokens with
    the step's attention metadata (``layers/attention_backend.py``) and ``logits`` only on the rows
    it needs.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_fp32, cfg.rotary_dim)
        self.layers = nn.ModuleList(Block(cfg, rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        # tensor parallelism (``distributed/tp.shard_model``): the group and the LM head's
        # vocabulary shard; None on one device
        self.tp = None

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """ids/positions: [B, L] (``DenseContext``) or [T] packed (the engine's attention
        metadata) -> pre-norm hidden. ``ctx.attention(module, layer, x, positions)`` runs each
        layer's attention."""
        # NOTE: each layer is ``Block``'s two residual sums, but each residual add is fused with
        # the norm that follows it (``add_rmsnorm``): one kernel per add+norm on the GPU.
        layers = self.layers
        # NOTE: no local name for the embeddings: it would keep them alive through every layer
        # (268 MB at batch 32 x 1024 rows of LLaDA-8B, on top of the residual stream)
        normed, res = add_rmsnorm(self.embed(ids), layers[0].attn_norm)
        for i, layer in enumerate(layers):
            a = layer.attn(normed, positions, i, ctx)
            normed, res = add_rmsnorm(a, layer.mlp_norm, res)
            m = layer.mlp(normed)
            if i + 1 < len(layers):
                normed, res = add_rmsnorm(m, layers[i + 1].attn_norm, res)
            else:
                res = m + res
        return res

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (this rank's vocabulary shard under tensor parallelism)."""
        h, _ = add_rmsnorm(h, self.norm)
        if type(self.lm_head) is not nn.Linear and self.lm_head is not None:
            return self.lm_head(h)                     # quantized (layers/quant.py)
        if self.lm_head is not None:
            return h @ self.lm_head.weight.t()
        w = self.embed.weight
        if self.tp is not None:                  # tied: the embedding's rows of this shard
            w = w[self.tp.vocab.start:self.tp.vocab.end]
        return h @ w.t()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on just the rows given (the engine passes masked slots only):
        full-vocabulary logits [rows, V]."""
        local = self._local_logits(h)
        return local if self.tp is None else self.tp.vocab.gather(local)

    def greedy(self, h: torch.Tensor, forbid: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy proposal at rows ``h``: (argmax token skipping ``forbid``, its softmax
        probability), one pass over the logits; under tensor parallelism a reduction of each
        rank's vocabulary slice (the logits are never gathered)."""
        local = self._local_logits(h)
        if self.tp is None:
            return argmax_confidence.op(local, forbid)
        return self.tp.vocab.greedy(local, forbid)

    def forward(self, ids: torch.Tensor, key_mask: torch.Tensor | None = None,
                pattern: AttentionPattern | None = None) -> torch.Tensor:
        """Dense forward: ids [B, L] -> logits [B, L, V] (training, tests, ``LLM.logits``), each
        row attending as ``cfg.attention`` says, or as ``pattern`` says instead (research: a
        block-causal model run with another block size) (``DenseContext``)."""
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.logits(self.hidden(ids, positions, DenseContext(key_mask, pattern)))

    def fuse_projections(self) -> "DiffusionTransformer":
        """Inference only: q/k/v and gate/up projections each become one GEMM (in place; the
        parameter names change, so fuse after loading and never save a fused model)."""
        for layer in self.layers:
            layer.attn.fuse()
            layer.mlp.fuse()
        if next(self.parameters()).is_cuda:
            torch.cuda.empty_cache()
        return self

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "DiffusionTransformer":
        """Random init (normal(0, std), unit norms, zero biases) for tests and training."""
        device = next(self.parameters()).device
        # NOTE: drawn on the parameters' device (an 8B model is not drawn on the host first);
        # on the CPU the values are those of a seeded float32 torch.randn, whatever the dtype.
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, device=device) * std)
        return self
