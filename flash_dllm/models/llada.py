"""LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): OLMo-style config and tensor names."""
from __future__ import annotations

from flash_dllm.layers.attention import BIDIRECTIONAL
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, as_id_tuple, require
from flash_dllm.models.transformer import DiffusionTransformer

# Config switches of the OLMo code that change the math: the values LLaDA uses (absent or null is
# fine). Anything else is refused rather than silently computed differently.
_SUPPORTED_VALUES = {"clip_qkv": (None,), "attention_layer_norm": (False,), "scale_logits": (False,),
                     "include_bias": (False,), "multi_query_attention": (None, False),
                     "alibi": (False,), "input_emb_norm": (False,),
                     "layer_norm_with_affine": (True,), "bias_for_layer_norm": (False, None)}


def parse_config(raw: dict) -> ModelConfig:
    for key, ok in _SUPPORTED_VALUES.items():
        if raw.get(key) is not None and raw[key] not in ok:
            raise ValueError(f"LLaDA config.json sets {key}={raw[key]!r}, which flash-dllm does not "
                             f"support (supported: {' or '.join(map(repr, ok))})")
    if not raw.get("rope", True):
        raise ValueError("LLaDA config.json sets rope=false; only rotary embeddings are supported")
    if str(raw.get("layer_norm_type", "rms")).lower() not in ("rms", "rmsnorm"):
        raise ValueError(f"LLaDA layer_norm_type {raw['layer_norm_type']!r} unsupported (need 'rms')")
    if str(raw.get("block_type", "llama")).lower() != "llama":
        raise ValueError(f"LLaDA block_type {raw['block_type']!r} unsupported (need 'llama')")
    # NOTE: LLaDA's llama block applies `activation_type` to ff_proj alone; "swiglu" there would
    # halve the hidden size (OLMo's chunking activation), which LLaDA checkpoints never use.
    if str(raw.get("activation_type", "silu")).lower() != "silu":
        raise ValueError(f"LLaDA activation_type {raw['activation_type']!r} unsupported (need 'silu')")
    d = int(require(raw, "d_model", "LLaDA"))
    n_heads = int(require(raw, "n_heads", "LLaDA"))
    mlp = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4) * d)
    mask = raw.get("mask_token_id")
    return ModelConfig(
        arch="llada",
        vocab_size=int(raw.get("embedding_size") or require(raw, "vocab_size", "LLaDA")),
        hidden_size=d,
        num_layers=int(require(raw, "n_layers", "LLaDA")),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("n_kv_heads") or n_heads),
        head_dim=d // n_heads,
        intermediate_size=int(mlp),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position=int(raw.get("max_sequence_length", 4096)),
        mask_token_id=int(mask) if mask is not None else None,
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=bool(raw.get("include_qkv_bias", False)),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        logit_shift=0,
        rope_fp32=bool(raw.get("rope_full_precision", True)),
        attention=BIDIRECTIONAL,
        mlp_kind="dense",
    )


def to_hf_config(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": cfg.hidden_size, "n_layers": cfg.num_layers, "n_heads": cfg.num_heads,
        "n_kv_heads": cfg.num_kv_heads, "mlp_hidden_size": cfg.intermediate_size,
        "mlp_ratio": cfg.intermediate_size / cfg.hidden_size,
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size,
        "rope": True, "rope_theta": cfg.rope_theta, "rope_full_precision": cfg.rope_fp32,
        "layer_norm_type": "rms", "rms_norm_eps": cfg.rms_norm_eps, "activation_type": "silu",
        "block_type": "llama", "include_bias": False, "include_qkv_bias": cfg.qkv_bias,
        "weight_tying": cfg.tie_word_embeddings, "max_sequence_length": cfg.max_position,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else eos,
        "bos_token_id": cfg.bos_token_id,
    }


FAMILY = Family(
    name="llada",
    architectures=("LLaDAModelLM",),
    model_types=("llada",),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=BIDIRECTIONAL,
    mlp="dense",
    default_cache="dual",           # approximate (bidirectional attention), Fast-dLLM's
    weight_map=(
        ("model.transformer.wte", "embed"),
        ("model.transformer.blocks.{i}.attn_norm", "layers.{i}.attn_norm"),
        ("model.transformer.blocks.{i}.q_proj", "layers.{i}.attn.q_proj"),
        ("model.transformer.blocks.{i}.k_proj", "layers.{i}.attn.k_proj"),
        ("model.transformer.blocks.{i}.v_proj", "layers.{i}.attn.v_proj"),
        ("model.transformer.blocks.{i}.attn_out", "layers.{i}.attn.o_proj"),
        ("model.transformer.blocks.{i}.ff_norm", "layers.{i}.mlp_norm"),
        ("model.transformer.blocks.{i}.ff_proj", "layers.{i}.mlp.gate_proj"),
        ("model.transformer.blocks.{i}.up_proj", "layers.{i}.mlp.up_proj"),
        ("model.transformer.blocks.{i}.ff_out", "layers.{i}.mlp.down_proj"),
        ("model.transformer.ln_f", "norm"),
        ("model.transformer.ff_out", "lm_head"),
    ),
)
