"""SDAR-MoE (JetLM, ``SDARMoeForCausalLM``, ``model_type: sdar_moe``: SDAR-30B-A3B-Chat):
Qwen3-MoE trained as block diffusion; everything but the MLP is ``models/sdar.py``'s.

The MLP, as Qwen3-MoE's: layer i is a mixture of experts unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step`` is not 0 (those keep a dense SwiGLU of
``intermediate_size``); the router scores experts with a softmax over its logits (float32), takes
the top ``num_experts_per_tok`` and divides their probabilities by their sum when
``norm_topk_prob`` (Qwen3-MoE's default is false; SDAR-30B-A3B, as Qwen3-30B-A3B, sets it true);
no shared expert, no scaling factor. Experts are stored one tensor per expert and projection
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``), the router as
``model.layers.{i}.mlp.gate.weight``.
"""
from __future__ import annotations

from flash_dllm.layers.attention import block_causal
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, check_expert_count, expert_pieces, require
from flash_dllm.models.sdar import DEFAULT_BLOCK, WEIGHT_MAP, parse_qwen3, qwen3_hf_config
from flash_dllm.models.transformer import DiffusionTransformer


def parse_config(raw: dict) -> ModelConfig:
    n_layers = int(require(raw, "num_hidden_layers", "SDAR-MoE"))
    step = int(raw.get("decoder_sparse_step") or 1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
        raise ValueError(f"SDAR-MoE config.json mlp_only_layers={only!r} must be a list of layer "
                         "indices")
    dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    try:
        moe = MoEConfig(num_experts=int(require(raw, "num_experts", "SDAR-MoE")),
                        top_k=int(require(raw, "num_experts_per_tok", "SDAR-MoE")),
                        intermediate_size=int(require(raw, "moe_intermediate_size", "SDAR-MoE")),
                        score_function="softmax",
                        norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
    except ValueError as e:
        raise ValueError(f"SDAR-MoE config.json: {e}") from None
    return parse_qwen3(raw, "sdar_moe", "SDAR-MoE", moe=moe, dense_layers=dense)


def to_hf_config(cfg: ModelConfig) -> dict:
    moe = cfg.moe
    return {"architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
            **qwen3_hf_config(cfg), "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.intermediate_size,
            "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": list(cfg.dense_layers)}


FAMILY = Family(
    name="sdar_moe",
    architectures=("SDARMoeForCausalLM",),
    model_types=("sdar_moe",),
    parse_config=parse_config,
    to_hf_config=to_hf_config,
    model=DiffusionTransformer,
    attention=block_causal(DEFAULT_BLOCK),
    mlp="moe",
    default_cache="block",          # exact for block-causal attention, and the cheapest
    # the router; the experts go through ``split``
    weight_map=WEIGHT_MAP + (("model.layers.{i}.mlp.gate", "layers.{i}.mlp.gate"),),
    split=lambda name, shape, cfg: expert_pieces(name, shape),
    check_tensors=check_expert_count,
)
