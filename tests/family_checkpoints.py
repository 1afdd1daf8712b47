"""Tiny random checkpoints of LLaDA-MoE and SDAR (dense and MoE) in their real Hugging Face
layouts, made from named random tensors without any flash-dllm code: config.json with the real
keys, sharded safetensors with the real tensor names, generation_config.json and the char-level
tokenizer of ``conftest``.

- ``tiny_llada_moe_config(**overrides)``: LLaDA-MoE keys (OLMoE style: ``expert_intermediate_size``,
  ``moe_layer_freq``, ``qk_layernorm``); 3 layers, the middle one dense.
- ``tiny_sdar_config(**overrides)`` / ``tiny_sdar_moe_config(**overrides)``: Qwen3 / Qwen3-MoE keys
  plus SDAR's ``block_size`` and ``mask_token_id``.
- ``qwen_style_tensors(cfg, seed)``: the tensors of any of them (``model.embed_tokens``,
  ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``, ``mlp.gate`` + ``mlp.experts.{e}.*`` or
  ``mlp.{gate,up,down}_proj``, ``model.norm``, ``lm_head``).
- ``write_family_checkpoint(folder, cfg, seed, ...)``: the folder.
- ``one_torch_thread``: an autouse fixture for the importing test module (the tiny models' GEMMs
  run 10-100x slower on two threads of a shared, loaded CPU than on one).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import (BOS_ID, EOS_ID, EOT_ID, MASK_ID, TINY_VOCAB_SIZE, write_sharded,
                      write_tiny_tokenizer)


def tiny_llada_moe_config(**overrides) -> dict:
    """LLaDA-MoE config.json (its real keys, no mask id): 3 layers (layer 1 dense), d=64, 4 heads
    of 16 and 4 KV heads, 8 experts of 32, 3 per token, q/k norm, full RoPE."""
    cfg = {
        "architectures": ["LLaDAMoEModelLM"], "model_type": "llada",
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "dense_intermediate_size": 96,
        "expert_intermediate_size": 32, "shared_expert_intermediate_size": None,
        "moe_layer_freq": [1, 0, 1], "num_experts": 8, "num_experts_per_tok": 3,
        "norm_topk_prob": False, "moe_router_enable_expert_bias": False,
        "moe_router_score_function": "softmax", "routed_scaling_factor": 1,
        "router_num_group": None, "router_topk_group": None, "qk_layernorm": True,
        "attention_bias": False, "clip_qkv": None, "partial_rotary_factor": 1,
        "rope_theta": 50000.0, "rope_scaling": None, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
    }
    cfg.update(overrides)
    return cfg


def tiny_sdar_config(**overrides) -> dict:
    """SDAR (Qwen3) config.json: 2 layers, d=64, 4 heads of 16 and 2 KV heads, block 4."""
    cfg = {
        "architectures": ["SDARForCausalLM"], "model_type": "sdar",
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "sliding_window": None,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
        "vocab_size": TINY_VOCAB_SIZE, "block_size": 4, "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "bos_token_id": BOS_ID,
    }
    cfg.update(overrides)
    return cfg


def tiny_sdar_moe_config(**overrides) -> dict:
    """SDAR-MoE (Qwen3-MoE) config.json: 3 layers (layer 1 dense through ``mlp_only_layers``),
    8 experts of 32, 3 per token, renormalised."""
    cfg = tiny_sdar_config(
        architectures=["SDARMoeForCausalLM"], model_type="sdar_moe", num_hidden_layers=3,
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], output_router_logits=False,
        router_aux_loss_coef=0.001)
    cfg.update(overrides)
    return cfg


def qwen_style_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under the real names for ``cfg`` (a LLaDA-MoE or SDAR config);
    nothing zero or one, so a wrong mapping of any tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    d, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // H
    moe_layers = _moe_layers(cfg)
    dense_inter = cfg.get("intermediate_size") or cfg.get("dense_intermediate_size")
    inter = cfg.get("moe_intermediate_size") or cfg.get("expert_intermediate_size")

    def mat(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * scale / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], d, generator=gen)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = mat(H * hd, d, 2.0)
        t[p + "self_attn.k_proj.weight"] = mat(Hkv * hd, d, 2.0)
        t[p + "self_attn.v_proj.weight"] = mat(Hkv * hd, d)
        t[p + "self_attn.o_proj.weight"] = mat(d, H * hd)
        if cfg.get("qk_layernorm", True):
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if i not in moe_layers:
            t[p + "mlp.gate_proj.weight"] = mat(dense_inter, d)
            t[p + "mlp.up_proj.weight"] = mat(dense_inter, d)
            t[p + "mlp.down_proj.weight"] = mat(d, dense_inter)
            continue
        t[p + "mlp.gate.weight"] = mat(cfg["num_experts"], d, 3.0)
        for e in range(cfg["num_experts"]):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(inter, d)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = mat(inter, d)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = mat(d, inter)
    t["model.norm.weight"] = norm(d)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = mat(cfg["vocab_size"], d)
    return t


def _moe_layers(cfg: dict) -> set[int]:
    L = cfg["num_hidden_layers"]
    if "moe_layer_freq" in cfg:                                    # LLaDA-MoE
        return {i for i, f in enumerate(cfg["moe_layer_freq"]) if f}
    if cfg.get("num_experts"):                                     # Qwen3-MoE's rule
        step = cfg.get("decoder_sparse_step", 1)
        return {i for i in range(L) if i not in cfg.get("mlp_only_layers", [])
                and (i + 1) % step == 0}
    return set()


def write_family_checkpoint(folder: str | Path, cfg: dict, seed: int = 0, shards: int = 3,
                            tokenizer: bool = True,
                            tensors: dict[str, torch.Tensor] | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    write_sharded(folder, tensors if tensors is not None else qwen_style_tensors(cfg, seed),
                  shards)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": EOS_ID}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    if tokenizer:
        write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
