"""ModelConfig: the one normalised description of a checkpoint that every layer reads."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a bidirectional (diffusion) transformer.

    Checkpoint-specific parsers (``llada.parse_config``, ``dream.parse_config``) build this from the
    folder's ``config.json``; nothing downstream reads the raw JSON.
    """

    arch: str                      # registry key, e.g. "llada", "dream"
    vocab_size: int                # rows of the embedding / LM head
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int              # longest canvas (prompt + generated) the model accepts
    mask_token_id: int | None      # None until resolved from the tokenizer's <|mdm_mask|>
    eos_token_ids: tuple[int, ...]  # every id that ends an answer (EOS, end-of-turn)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    # NOTE: Dream inherits next-token prediction from its autoregressive init: the logits for
    # position i are read from output i-1. LLaDA reads position i from output i.
    logit_shift: int = 0
    # LLaDA (OLMo code) applies RoPE in float32 and casts back; Qwen2/Dream applies it in the
    # activation dtype. Identical in float32, different rounding in bf16.
    rope_fp32: bool = True
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if self.logit_shift not in (0, 1):
            raise ValueError(f"logit_shift must be 0 or 1, got {self.logit_shift}")

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of K and V one cached token needs across all layers, in ``dtype``."""
        elem = torch.finfo(dtype).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def num_params(self) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head
