"""ModelConfig: the one normalised description of a checkpoint that every layer reads."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flash_dllm.layers.attention import BIDIRECTIONAL, AttentionPattern
from flash_dllm.layers.moe import MoEConfig

# the MLP kinds a layer can have (``models/transformer.build_mlp`` builds each): a dense SwiGLU
# of ``intermediate_size``, or a mixture of experts (``layers/moe.py``) as ``ModelConfig.moe`` says
MLP_KINDS = ("dense", "moe")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts of a diffusion transformer.

    Each family's parser (``models/<family>.py``) builds this from the folder's ``config.json``;
    nothing downstream reads the raw JSON, and nothing below ``models/`` needs the family: what
    layers and kernels must know (attention pattern, MLP kind, q/k norm, partial rotary) is here.
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
    # which keys a query sees: bidirectional (LLaDA, Dream, LLaDA-MoE) or block-causal with its
    # block size (LLaDA2.x: 32, SDAR: 4); the dense path masks by it, the paged engine refuses
    # block-causal models until its kernels have the mode (``paged_unsupported``)
    attention: AttentionPattern = BIDIRECTIONAL
    # the MLP of every layer except ``dense_layers``, which keep a dense SwiGLU of
    # ``intermediate_size`` (LLaDA2: MoE everywhere but its first layer)
    mlp_kind: str = "dense"
    dense_layers: tuple[int, ...] = ()
    # the experts and router options of every "moe" layer (set exactly when mlp_kind is "moe")
    moe: MoEConfig | None = None
    # per-head RMSNorm of q and k (epsilon ``rms_norm_eps``) before RoPE: LLaDA2, Qwen3 / SDAR
    qk_norm: bool = False
    # how many values of each head RoPE rotates (None: all ``head_dim``); LLaDA2 rotates half
    rotary_dim: int | None = None
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
        if not isinstance(self.attention, AttentionPattern):
            raise ValueError(f"ModelConfig.attention must be an AttentionPattern "
                             f"(layers.attention), got {self.attention!r}")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"ModelConfig.mlp_kind must be one of {MLP_KINDS}, "
                             f"got {self.mlp_kind!r}")
        if self.mlp_kind == "moe" and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"ModelConfig.moe must be a MoEConfig (layers.moe) when mlp_kind is "
                             f"'moe', got {self.moe!r}")
        if self.mlp_kind != "moe" and self.moe is not None:
            raise ValueError(f"ModelConfig.moe is set but mlp_kind is {self.mlp_kind!r}: set "
                             "mlp_kind='moe' or leave moe None")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"ModelConfig.dense_layers must be layer indices in "
                             f"[0, {self.num_layers}), got {bad}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in (0, head_dim="
                             f"{self.head_dim}], got {self.rotary_dim}")

    def layer_mlp_kind(self, layer: int) -> str:
        """The MLP kind of layer ``layer``."""
        return "dense" if layer in self.dense_layers else self.mlp_kind

    def paged_unsupported(self) -> str | None:
        """Why the paged engine cannot run this model (None: it can). Block-causal attention
        (split at block bounds), per-head q/k norm and partial rotary run since issue 39
        (``layers/attention_backend.py``); a future option the kernels cannot compute is
        refused here, not computed wrong."""
        return None

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of K and V one cached token needs across all layers, in ``dtype``."""
        elem = torch.finfo(dtype).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def num_params(self) -> int:
        """Every parameter of the model (all experts of every MoE layer)."""
        return self._params(active=False)

    def active_params(self) -> int:
        """Parameters one token's forward reads: equal to ``num_params`` for a dense model; a MoE
        layer counts its router, ``top_k`` experts and the shared expert. Embedding and LM head
        count whole, as the published figures do (LLaDA2.0-mini: 16 B total, 1.4 B active)."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = 0
        for i in range(self.num_layers):
            if self.layer_mlp_kind(i) == "dense":
                mlp += 3 * d * self.intermediate_size
            else:
                mlp += self.moe.active_params(d) if active else self.moe.num_params(d)
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return (self.vocab_size * d + self.num_layers * (attn + 2 * d) + mlp + d + head)
