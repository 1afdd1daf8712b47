"""LLaDA2.0 / LLaDA2.1 (inclusionAI, ``LLaDA2MoeModelLM``): block diffusion with mixture-of-experts
MLPs, in the Bailing-MoE-V2 layout (fused ``query_key_value``, per-expert tensors).

What the checkpoint's own modeling code (``modeling_llada2_moe.py``) computes, and this family
reproduces: pre-norm residual blocks; per-head q/k RMSNorm before RoPE (``use_qk_norm``); RoPE in
the activation dtype on the first ``head_dim * partial_rotary_factor`` values of each head; a
dense SwiGLU in the first ``first_k_dense_replace`` layers and a MoE elsewhere (sigmoid router
with an expert bias for choosing and group-limited top-k, ``layers/moe.py``, plus the shared
expert); block-causal attention over blocks of 32 counted from position 0; no logit shift.
Config switches whose meaning the references disagree on, or that we do not implement, are
refused with an error naming the key.
"""
from __future__ import annotations

import re

from flash_dllm.layers.attention import block_causal
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import (Family, Piece, as_id_tuple, check_expert_count,
                                      expert_pieces, require)
from flash_dllm.models.transformer import DiffusionTransformer

# NOTE: config.json has no block size: the reference ``generate`` takes ``block_length=32``, and
# the models were trained with it. ``LLM.logits(block_length=...)`` runs other sizes.
BLOCK_LENGTH = 32

# config switches with the values this family implements; absent or null is fine (the
# checkpoint's own modeling code then does what the supported value says)
_SUPPORTED_VALUES = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "use_rmsnorm": (True,),              # false: LayerNorm q/k norms (vLLM's Bailing code)
    "norm_head": (False,),               # true: the LM head's rows are normalised
    "use_sliding_window": (False,),
    "num_nextn_predict_layers": (0,),    # multi-token-prediction layers
    "score_function": ("sigmoid",),      # the modeling code scores experts with a sigmoid only
    # the modeling code always chooses on sigmoid + bias; vLLM scores groups by their max
    # without a bias: only the bias form is unambiguous
    "moe_router_enable_expert_bias": (True,),
    "norm_topk_prob": (True,),           # the modeling code always normalises chosen weights
    "router_dtype": ("fp32",),           # the modeling code routes in float32 only
}


def parse_config(raw: dict) -> ModelConfig:
    for key, ok in _SUPPORTED_VALUES.items():
        value = raw.get(key)
        if value is not None and value not in ok:
            raise ValueError(f"LLaDA2 config.json sets {key}={value!r}, which flash-dllm does "
                             f"not support (supported: {' or '.join(map(repr, ok))})")
    # NOTE: LLaDA2MoeConfig defaults use_bias to true: absent means biases on the attention
    # output and MLP projections, which no released checkpoint has and we do not implement
    if raw.get("use_bias", True):
        raise ValueError(f"LLaDA2 config.json sets use_bias={raw.get('use_bias', True)!r} "
                         "(true when absent), which flash-dllm does not support (supported: "
                         "false)")
    d = int(require(raw, "hidden_size", "LLaDA2"))
    n_layers = int(require(raw, "num_hidden_layers", "LLaDA2"))
    n_heads = int(require(raw, "num_attention_heads", "LLaDA2"))
    head_dim = int(raw.get("head_dim") or d // n_heads)
    factor = float(raw.get("partial_rotary_factor", 0.5))
    rotary = int(head_dim * factor)
    if not (0 < rotary <= head_dim and rotary % 2 == 0):
        raise ValueError(f"LLaDA2 config.json partial_rotary_factor={factor!r} rotates {rotary} "
                         f"of head_dim {head_dim} values: need an even count in (0, {head_dim}]")
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense <= n_layers:
        raise ValueError(f"LLaDA2 config.json first_k_dense_replace={first_dense} outside "
                         f"[0, num_hidden_layers={n_layers}]")
    moe_inter = int(require(raw, "moe_intermediate_size", "LLaDA2"))
    shared_inter = raw.get("moe_shared_expert_intermediate_size")
    if shared_inter is not None and int(shared_inter) != moe_inter:
        raise ValueError(f"LLaDA2 config.json sets moe_shared_expert_intermediate_size="
                         f"{shared_inter!r}, which flash-dllm does not support (the modeling "
                         f"code sizes the shared expert by moe_intermediate_size={moe_inter})")
    # NOTE: with no dense layer, intermediate_size (the dense width) is unused and may be null
    inter = raw.get("intermediate_size")
    if inter is None and first_dense:
        require(raw, "intermediate_size", "LLaDA2")
    moe = _moe_config(raw, moe_inter)
    mask = raw.get("mask_token_id")
    return ModelConfig(
        arch="llada2",
        vocab_size=int(require(raw, "vocab_size", "LLaDA2")),
        hidden_size=d,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        intermediate_size=int(inter) if inter is not None else moe_inter,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position=int(raw.get("max_position_embeddings", 16384)),
        mask_token_id=int(mask) if mask is not None else None,
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=bool(raw.get("use_qkv_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        logit_shift=0,
        rope_fp32=False,            # cos/sin cast to the activation dtype, then applied
        attention=block_causal(BLOCK_LENGTH),
        mlp_kind="moe",
        dense_layers=tuple(range(first_dense)),
        moe=moe,
        qk_norm=bool(raw.get("use_qk_norm", False)),
        rotary_dim=None if rotary == head_dim else rotary,
    )


def _moe_config(raw: dict, moe_inter: int) -> MoEConfig:
    n_group, topk_group = raw.get("n_group", 8), raw.get("topk_group", 4)
    if n_group is None or topk_group is None:       # no group-limited routing
        n_group = topk_group = 1
    top_k = int(require(raw, "num_experts_per_tok", "LLaDA2"))
    try:
        return MoEConfig(
            num_experts=int(require(raw, "num_experts", "LLaDA2")),
            top_k=top_k,
            intermediate_size=moe_inter,
            num_shared_experts=int(raw.get("num_shared_experts") or 0),
            score_function="sigmoid",
            expert_bias=True,
            n_group=int(n_group),
            topk_group=int(topk_group),
            # NOTE: the modeling code normalises the chosen weights only when it chooses more
            # than one expert (a single expert keeps its raw sigmoid score)
            norm_topk_prob=top_k > 1,
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
        )
    except ValueError as e:
        raise ValueError(f"LLaDA2 config.json: {e}") from None


def to_hf_config(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "rope_scaling": None, "tie_word_embeddings": cfg.tie_word_embeddings,
        "partial_rotary_factor": (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim,
        "use_qk_norm": cfg.qk_norm, "use_rmsnorm": True, "use_qkv_bias": cfg.qkv_bias,
        "use_bias": False, "norm_head": False, "num_nextn_predict_layers": 0,
        "first_k_dense_replace": len(cfg.dense_layers),
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "num_shared_experts": moe.num_shared_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "n_group": moe.n_group, "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "router_dtype": "fp32",
        "mask_token_id": cfg.mask_token_id, "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else eos,
        "bos_token_id": cfg.bos_token_id,
    }


_QKV = re.compile(r"layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)")


def split(name: str, shape: tuple[int, ...], cfg: ModelConfig) -> tuple[Piece, ...] | None:
    """q/k/v: row slices of the fused ``query_key_value`` (q | k | v, by heads); the packed
    experts: one checkpoint tensor per expert and projection (``family.expert_pieces``)."""
    m = _QKV.fullmatch(name)
    if m is None:
        return expert_pieces(name, shape)
    i, which, leaf = m.groups()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    start = {"q": 0, "k": q, "v": q + kv}[which]
    fused = (q + 2 * kv,) + tuple(shape[1:])
    return (Piece(f"model.layers.{i}.attention.query_key_value.{leaf}", fused,
                  src=(slice(start, start + shape[0]),)),)


FAMILY = Family(
    name="llada2",
    architectures=("LLaDA2MoeModelLM",),
    model_types=("llada2_moe",),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=block_causal(BLOCK_LENGTH),
    mlp="moe",
    default_cache="block",          # exact for block-causal attention, and the cheapest
    weight_map=(
        ("model.word_embeddings", "embed"),
        ("model.layers.{i}.input_layernorm", "layers.{i}.attn_norm"),
        ("model.layers.{i}.attention.query_layernorm", "layers.{i}.attn.q_norm"),
        ("model.layers.{i}.attention.key_layernorm", "layers.{i}.attn.k_norm"),
        ("model.layers.{i}.attention.dense", "layers.{i}.attn.o_proj"),
        ("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
        # dense layers (< first_k_dense_replace)
        ("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.gate_proj"),
        ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.up_proj"),
        ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.down_proj"),
        # MoE layers: the router (weight and expert_bias) and the shared expert; the experts
        # and the fused query_key_value go through ``split``
        ("model.layers.{i}.mlp.gate", "layers.{i}.mlp.gate"),
        ("model.layers.{i}.mlp.shared_experts.gate_proj", "layers.{i}.mlp.shared.gate_proj"),
        ("model.layers.{i}.mlp.shared_experts.up_proj", "layers.{i}.mlp.shared.up_proj"),
        ("model.layers.{i}.mlp.shared_experts.down_proj", "layers.{i}.mlp.shared.down_proj"),
        ("model.norm", "norm"),
        ("lm_head", "lm_head"),
    ),
    split=split,
    check_tensors=check_expert_count,
)
