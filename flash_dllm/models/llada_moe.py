"""LLaDA-MoE (inclusionAI, LLaDA-MoE-7B-A1B-Base / -Instruct, ``LLaDAMoEModelLM``): LLaDA's
bidirectional masked diffusion with an OLMoE-style mixture-of-experts MLP.

What the checkpoint's own modeling code (``modeling_lladamoe.py``, OLMoE-derived) computes, and
this family reproduces: pre-norm residual blocks; q/k/v/o projections without bias; per-head q/k
RMSNorm (weights ``[head_dim]``) before RoPE when ``qk_layernorm``; RoPE (cos/sin in float32, then
cast to the activation dtype) on the first ``head_dim * partial_rotary_factor`` values; attention
over every position (no mask, no causality); per layer a MoE (``moe_layer_freq[i]`` 1) or a
dense SwiGLU of ``dense_intermediate_size`` (0); no logit shift.

NOTE (router): the modeling code scores experts with a softmax over the router logits in float32,
takes the top ``num_experts_per_tok`` and weights them by their softmax probability **without**
renormalising: its ``norm_topk_prob`` is hard-coded False whatever config.json says, and it never
reads ``routed_scaling_factor`` nor the group keys. We do as the code does and ignore those keys;
switches the code would act on and we do not implement (an expert bias, a shared expert, qkv
clipping, attention biases) are refused with an error naming the key.

config.json names no mask id: the tokenizer's ``<|mask|>`` (156895 in the released vocabulary,
as the model card's ``generate`` takes it) resolves it (``models/tokenizer.py``); end of text is
156892 (``<|endoftext|>``, the tokenizer's eos).
"""
from __future__ import annotations

from flash_dllm.layers.attention import BIDIRECTIONAL
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import (Family, as_id_tuple, check_expert_count, expert_pieces,
                                      refuse_unsupported, require)
from flash_dllm.models.transformer import DiffusionTransformer

_SUPPORTED_VALUES = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "attention_bias": (False,),          # true: biases on q/k/v and o
    "clip_qkv": (None,),                 # a clamp of q/k/v after projection
    "moe_router_enable_expert_bias": (False,),   # the code adds it to the weights too
    "moe_router_score_function": ("softmax",),   # the code uses a softmax whatever it says
    "shared_expert_intermediate_size": (None,),  # a shared expert beside the routed ones
}


def parse_config(raw: dict) -> ModelConfig:
    refuse_unsupported(raw, _SUPPORTED_VALUES, "LLaDA-MoE")
    d = int(require(raw, "hidden_size", "LLaDA-MoE"))
    n_layers = int(require(raw, "num_hidden_layers", "LLaDA-MoE"))
    n_heads = int(require(raw, "num_attention_heads", "LLaDA-MoE"))
    head_dim = d // n_heads                   # the modeling code's, whatever head_dim says
    factor = float(raw.get("partial_rotary_factor") or 1.0)
    rotary = int(head_dim * factor)
    if not (0 < rotary <= head_dim and rotary % 2 == 0):
        raise ValueError(f"LLaDA-MoE config.json partial_rotary_factor={factor!r} rotates "
                         f"{rotary} of head_dim {head_dim} values: need an even count in "
                         f"(0, {head_dim}]")
    freq = raw.get("moe_layer_freq")
    freq = [1] * n_layers if freq in (None, []) else list(freq)
    if len(freq) != n_layers or any(f not in (0, 1) for f in freq):
        raise ValueError(f"LLaDA-MoE config.json moe_layer_freq={raw.get('moe_layer_freq')!r} "
                         f"must list 0 (dense) or 1 (MoE) for each of the {n_layers} layers")
    dense = tuple(i for i, f in enumerate(freq) if f == 0)
    expert_inter = int(require(raw, "expert_intermediate_size", "LLaDA-MoE"))
    inter = raw.get("dense_intermediate_size")
    if dense and (inter is None or int(inter) <= 0):
        require(raw, "dense_intermediate_size", "LLaDA-MoE")
    try:
        moe = MoEConfig(num_experts=int(require(raw, "num_experts", "LLaDA-MoE")),
                        top_k=int(require(raw, "num_experts_per_tok", "LLaDA-MoE")),
                        intermediate_size=expert_inter, score_function="softmax",
                        norm_topk_prob=False)
    except ValueError as e:
        raise ValueError(f"LLaDA-MoE config.json: {e}") from None
    mask = raw.get("mask_token_id")
    return ModelConfig(
        arch="llada_moe",
        vocab_size=int(require(raw, "vocab_size", "LLaDA-MoE")),
        hidden_size=d,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        intermediate_size=int(inter) if dense else expert_inter,
        rope_theta=float(require(raw, "rope_theta", "LLaDA-MoE")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position=int(raw.get("max_position_embeddings", 4096)),
        mask_token_id=int(mask) if mask is not None else None,
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        logit_shift=0,
        rope_fp32=False,            # cos/sin cast to the activation dtype, then applied
        attention=BIDIRECTIONAL,
        mlp_kind="moe",
        dense_layers=dense,
        moe=moe,
        qk_norm=bool(raw.get("qk_layernorm", False)),
        rotary_dim=None if rotary == head_dim else rotary,
    )


def to_hf_config(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "rms_norm_eps": cfg.rms_norm_eps,
        "partial_rotary_factor": (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim,
        "hidden_act": "silu", "attention_bias": False, "clip_qkv": None,
        "qk_layernorm": cfg.qk_norm, "tie_word_embeddings": cfg.tie_word_embeddings,
        "dense_intermediate_size": cfg.intermediate_size if cfg.dense_layers else -1,
        "expert_intermediate_size": cfg.moe.intermediate_size,
        "shared_expert_intermediate_size": None,
        "moe_layer_freq": [0 if i in cfg.dense_layers else 1 for i in range(cfg.num_layers)],
        "num_experts": cfg.moe.num_experts, "num_experts_per_tok": cfg.moe.top_k,
        "norm_topk_prob": False, "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax", "routed_scaling_factor": 1,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else eos,
        "bos_token_id": cfg.bos_token_id,
    }


FAMILY = Family(
    name="llada_moe",
    architectures=("LLaDAMoEModelLM", "LLaDAMoEModel"),
    # NOTE: its config.json says model_type "llada", which is LLaDA-8B's: this family resolves
    # by its architectures alone (``models/registry.py``)
    model_types=(),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=BIDIRECTIONAL,
    mlp="moe",
    default_cache="dual",           # approximate (bidirectional attention), Fast-dLLM's
    weight_map=(
        ("model.embed_tokens", "embed"),
        ("model.layers.{i}.input_layernorm", "layers.{i}.attn_norm"),
        ("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.q_proj"),
        ("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.k_proj"),
        ("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.v_proj"),
        ("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.o_proj"),
        ("model.layers.{i}.self_attn.q_norm", "layers.{i}.attn.q_norm"),
        ("model.layers.{i}.self_attn.k_norm", "layers.{i}.attn.k_norm"),
        ("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
        # dense layers (moe_layer_freq 0)
        ("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.gate_proj"),
        ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.up_proj"),
        ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.down_proj"),
        # MoE layers: the router; the experts go through ``split``
        ("model.layers.{i}.mlp.gate", "layers.{i}.mlp.gate"),
        ("model.norm", "norm"),
        ("lm_head", "lm_head"),
    ),
    split=lambda name, shape, cfg: expert_pieces(name, shape),
    check_tensors=check_expert_count,
)
