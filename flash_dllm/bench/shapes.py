"""The model shapes ``flash-dllm bench`` builds random weights of (``--model-shape``): each a real
checkpoint's ``config.json`` values, so a step times what that model's step would read.
"""
from __future__ import annotations

from flash_dllm.models.loader import read_json

# what LLaDA2.0-mini and -flash share (inclusionAI's config.json keys and values)
_LLADA2 = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
           "num_key_value_heads": 4, "head_dim": 128, "first_k_dense_replace": 1,
           "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8,
           "topk_group": 4, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
           "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "use_qk_norm": True,
           "use_qkv_bias": False, "use_bias": False, "partial_rotary_factor": 0.5,
           "rope_theta": 600000.0, "rms_norm_eps": 1e-6, "vocab_size": 157184,
           "max_position_embeddings": 32768, "tie_word_embeddings": False,
           "mask_token_id": 156895, "eos_token_id": 156892}

# Qwen3's keys and values that SDAR-4B and SDAR-30B-A3B share (their base models' config.json;
# SDAR adds block_size and mask_token_id, 151669 = <|MASK|>)
_SDAR = {"head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
         "block_size": 4, "mask_token_id": 151669, "eos_token_id": 151645}

SHAPES: dict[str, dict] = {
    "llada-8b": {"architectures": ["LLaDAModelLM"], "d_model": 4096, "n_layers": 32, "n_heads": 32,
                 "n_kv_heads": 32, "mlp_hidden_size": 12288, "vocab_size": 126464,
                 "embedding_size": 126464, "rope_theta": 500000.0, "max_sequence_length": 4096,
                 "mask_token_id": 126336, "eos_token_id": 126081},
    "dream-7b": {"architectures": ["DreamModel"], "hidden_size": 3584, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                 "vocab_size": 152064, "rope_theta": 1e6, "max_position_embeddings": 32768,
                 "mask_token_id": 151666, "eos_token_id": 151643},
    # LLaDA2.0-mini: 16 B parameters, 1.4 B active (config.json keys of the real checkpoint)
    "llada2-mini": {**_LLADA2, "hidden_size": 2048, "num_hidden_layers": 20,
                    "num_attention_heads": 16, "intermediate_size": 5120,
                    "moe_intermediate_size": 512},
    # LLaDA2.0-flash (100 B, 6.1 B active, 32 layers) cut to its first 10 layers (the dense one
    # and 9 MoE: 30 B parameters, 61 GB in bf16) so it fits one 80 GB GPU with room for KV;
    # per-layer costs are the real model's
    "llada2-flash": {**_LLADA2, "hidden_size": 4096, "num_hidden_layers": 10,
                     "num_attention_heads": 32, "intermediate_size": 9216,
                     "moe_intermediate_size": 1024},
    # SDAR-4B-Chat (Qwen3-4B: 4.0 B parameters, the LM head tied to the embedding), block 4
    "sdar-4b": {**_SDAR, "architectures": ["SDARForCausalLM"], "model_type": "sdar",
                "hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 9728,
                "tie_word_embeddings": True},
    # SDAR-30B-A3B-Chat (Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active), block 4
    "sdar-30b-a3b": {**_SDAR, "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
                     "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                     "num_key_value_heads": 4, "intermediate_size": 6144,
                     "moe_intermediate_size": 768, "num_experts": 128,
                     "num_experts_per_tok": 8, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": [],
                     "tie_word_embeddings": False},
    # LLaDA-MoE-7B-A1B (inclusionAI's config.json: 7 B parameters, 1.4 B active; no mask id in
    # it, the model card's 156895 here)
    "llada-moe-7b": {"architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
                     "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                     "num_key_value_heads": 16, "dense_intermediate_size": 8192,
                     "expert_intermediate_size": 1024, "shared_expert_intermediate_size": None,
                     "moe_layer_freq": [1] * 16, "num_experts": 64, "num_experts_per_tok": 8,
                     "qk_layernorm": True, "partial_rotary_factor": 1, "rope_theta": 50000.0,
                     "rms_norm_eps": 1e-5, "vocab_size": 157184,
                     "max_position_embeddings": 8192, "tie_word_embeddings": False,
                     "mask_token_id": 156895, "eos_token_id": 156892},
}


def shape_config(name: str) -> dict:
    if name == "demo":
        from flash_dllm.models.loader import default_model_path
        return read_json(default_model_path() / "config.json")
    if name not in SHAPES:
        raise ValueError(f"--model-shape must be one of {sorted(SHAPES) + ['demo']}, got {name!r}")
    return SHAPES[name]


def with_max_len(raw: dict, n: int | None) -> dict:
    """A shape's config with a maximum length of at least ``n`` positions (None: as it is):
    random-weight timing runs longer than the checkpoint's own limit (RoPE has no table)."""
    if n is None:
        return raw
    raw = dict(raw)
    key = ("max_position_embeddings" if "max_position_embeddings" in raw
           or raw.get("architectures", [""])[0].startswith("Dream") else "max_sequence_length")
    raw[key] = max(int(raw.get(key, 0)), n)
    return raw
