"""Dream (Dream-v0-Base/Instruct-7B): Qwen2 names and config keys, GQA, q/k/v biases, shifted logits."""
from __future__ import annotations

from flash_dllm.layers.attention import BIDIRECTIONAL
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, as_id_tuple, require
from flash_dllm.models.transformer import DiffusionTransformer


def parse_config(raw: dict) -> ModelConfig:
    if raw.get("rope_scaling"):
        raise ValueError(f"Dream config.json sets rope_scaling={raw['rope_scaling']!r}, which "
                         "flash-dllm does not support (supported: null)")
    act = str(raw.get("hidden_act", "silu")).lower()
    if act != "silu":
        raise ValueError(f"Dream hidden_act {act!r} unsupported (need 'silu')")
    d = int(require(raw, "hidden_size", "Dream"))
    n_heads = int(require(raw, "num_attention_heads", "Dream"))
    mask = raw.get("mask_token_id")
    return ModelConfig(
        arch="dream",
        vocab_size=int(require(raw, "vocab_size", "Dream")),
        hidden_size=d,
        num_layers=int(require(raw, "num_hidden_layers", "Dream")),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d // n_heads),
        intermediate_size=int(require(raw, "intermediate_size", "Dream")),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position=int(raw.get("max_position_embeddings", 32768)),
        mask_token_id=int(mask) if mask is not None else None,
        eos_token_ids=as_id_tuple(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
        bos_token_id=raw.get("bos_token_id"),
        qkv_bias=True,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        logit_shift=1,
        rope_fp32=False,
        attention=BIDIRECTIONAL,
        mlp_kind="dense",
    )


def to_hf_config(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return {
        "architectures": ["DreamModel"], "model_type": "Dream",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position, "tie_word_embeddings": cfg.tie_word_embeddings,
        "mask_token_id": cfg.mask_token_id, "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id if cfg.pad_token_id is not None else eos,
        "bos_token_id": cfg.bos_token_id, "rope_scaling": None,
    }


FAMILY = Family(
    name="dream",
    architectures=("DreamModel",),
    model_types=("dream",),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=BIDIRECTIONAL,
    mlp="dense",
    default_cache="dual",           # approximate (bidirectional attention), Fast-dLLM's
    weight_map=(
        ("model.embed_tokens", "embed"),
        ("model.layers.{i}.input_layernorm", "layers.{i}.attn_norm"),
        ("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.q_proj"),
        ("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.k_proj"),
        ("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.v_proj"),
        ("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.o_proj"),
        ("model.layers.{i}.post_attention_layernorm", "layers.{i}.mlp_norm"),
        ("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.gate_proj"),
        ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.up_proj"),
        ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.down_proj"),
        ("model.norm", "norm"),
        ("lm_head", "lm_head"),
    ),
)
