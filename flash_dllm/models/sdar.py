"""SDAR (JetLM, ``SDARForCausalLM``, ``model_type: sdar``: SDAR-1.7B / 4B / 8B-Chat): Qwen3
trained as block diffusion. ``models/sdar_moe.py`` is its mixture-of-experts sibling
(SDAR-30B-A3B, Qwen3-MoE).

What the checkpoint's own modeling code (``modeling_sdar.py``, generated from transformers'
Qwen3) computes at inference, and this family reproduces: Qwen3's layer (pre-norm residual, GQA,
per-head q/k RMSNorm before RoPE, RoPE with cos/sin cast to the activation dtype, SwiGLU) and
Qwen3's tensor names, under block-causal attention: a position sees its own block and every
earlier block, blocks of ``block_size`` counted from position 0 (SDAR's ``generate`` builds
``tril(ones(n_blocks, n_blocks))`` repeated ``block_length`` times over the whole canvas, prompt
included, with position ids ``arange(total)``), no logit shift.

config.json carries ``block_size`` (the trained block, 4 by default; 8 to 64 in the variants)
and ``mask_token_id`` (151669, ``<|MASK|>``, added to Qwen3's vocabulary); where they are
absent, block 4 and the tokenizer's ``<|MASK|>`` (``models/tokenizer.py``) stand in.
"""
from __future__ import annotations

from flash_dllm.layers.attention import block_causal
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, as_id_tuple, refuse_unsupported, require
from flash_dllm.models.transformer import DiffusionTransformer

# SDAR's released block (its ``generate`` and JetEngine default to 4)
DEFAULT_BLOCK = 4

_SUPPORTED_VALUES = {
    "hidden_act": ("silu",),
    "rope_scaling": (None,),
    "attention_bias": (False,),          # true: biases on q/k/v and o
    "use_sliding_window": (False,),
}

# Qwen3's names (the MoE keys: ``models/sdar_moe.py``)
WEIGHT_MAP = (
    ("model.embed_tokens", "embed"),
    ("model.layers.{i}.input_layernorm", "layers.{i}.attn_norm"),
    ("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.q_proj"),
    ("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.k_proj"),
    ("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.v_proj"),
    ("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.o_proj"),
    ("model.layers.{i}.self_attn.q_norm", "layers.{i}.attn.q_norm"),
    ("model.layers.{i}.self_attn.k_norm", "layers.{i}.attn.k_norm"),
    ("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
    ("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.gate_proj"),
    ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.up_proj"),
    ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.down_proj"),
    ("model.norm", "norm"),
    ("lm_head", "lm_head"),
)


def parse_qwen3(raw: dict, arch: str, label: str, moe: MoEConfig | None = None,
                dense_layers: tuple[int, ...] = ()) -> ModelConfig:
    """The ``ModelConfig`` of a Qwen3-layout SDAR config.json (``moe``: the MoE sibling's
    router, with its ``dense_layers``)."""
    refuse_unsupported(raw, _SUPPORTED_VALUES, label)
    d = int(require(raw, "hidden_size", label))
    n_heads = int(require(raw, "num_attention_heads", label))
    block = int(raw.get("block_size") or DEFAULT_BLOCK)
    if block < 1:
        raise ValueError(f"{label} config.json block_size={raw.get('block_size')!r} must be >= 1")
    inter = raw.get("intermediate_size")
    if moe is None or dense_layers:
        inter = require(raw, "intermediate_size", label)
    mask = raw.get("mask_token_id")
    return ModelConfig(
        arch=arch,
        vocab_size=int(require(raw, "vocab_size", label)),
        hidden_size=d,
        num_layers=int(require(raw, "num_hidden_layers", label)),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        # NOTE: absent, 128 as SDAR's (and Qwen3's) config class defaults it, not d / heads
        head_dim=int(raw.get("head_dim") or 128),
        intermediate_size=int(inter) if inter else moe.intermediate_size,
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 32768)),
        mask_token_id=int(mask) if mask is not None else None,
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        logit_shift=0,
        rope_fp32=False,            # cos/sin cast to the activation dtype, then applied
        attention=block_causal(block),
        mlp_kind="dense" if moe is None else "moe",
        dense_layers=dense_layers,
        moe=moe,
        qk_norm=True,               # Qwen3 always norms q and k per head
    )


def parse_config(raw: dict) -> ModelConfig:
    return parse_qwen3(raw, "sdar", "SDAR")


def qwen3_hf_config(cfg: ModelConfig) -> dict:
    """The config.json keys SDAR and SDAR-MoE share."""
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "block_size": cfg.attention.block_size, "mask_token_id": cfg.mask_token_id,
        "eos_token_id": eos, "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None
        else eos, "bos_token_id": cfg.bos_token_id,
    }


def to_hf_config(cfg: ModelConfig) -> dict:
    return {"architectures": ["SDARForCausalLM"], "model_type": "sdar", **qwen3_hf_config(cfg)}


FAMILY = Family(
    name="sdar",
    architectures=("SDARForCausalLM",),
    model_types=("sdar",),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=block_causal(DEFAULT_BLOCK),
    mlp="dense",
    default_cache="block",          # exact for block-causal attention, and the cheapest
    weight_map=WEIGHT_MAP,
)
