"""Shared test helpers: tiny LLaDA / Dream configs and tiny random checkpoint folders.

Import the plain functions with ``from conftest import ...`` or use the fixtures below.

- ``tiny_llada_config(**overrides)`` / ``tiny_dream_config(**overrides)``: hf ``config.json`` dicts.
- ``tiny_model(family, seed, dtype, **overrides)``: a ``DiffusionTransformer`` whose every
  parameter (norm weights and q/k/v biases included) is random and non-trivial.
- ``write_tiny_checkpoint(folder, family, sharded, seed, tokenizer, ...)``: a Hugging Face layout
  folder (config.json, weights, generation_config.json, char-level tokenizer) -> the folder.
- ``write_tiny_tokenizer(folder, family)``: tokenizer.json + tokenizer_config.json +
  special_tokens_map.json, loadable by ``transformers.PreTrainedTokenizerFast.from_pretrained``.
- ``tiny_llada2_config(**overrides)`` / ``llada2_tensors(cfg, seed)`` /
  ``write_tiny_llada2_checkpoint(folder, ...)``: a tiny LLaDA2 (MoE, block-causal) checkpoint in
  the real layout (fused ``query_key_value``, one tensor per expert, float32 ``expert_bias``),
  made from named random tensors without any flash-dllm code, sharded with an index.
"""
from __future__ import annotations

import json
import math
import os
import string
from pathlib import Path

# NOTE: the engine imports the Triton kernel modules, and a kernel module fixes whether it runs
# interpreted when it is imported. On a machine with no NVIDIA GPU, choose the interpreter before
# anything imports triton, so tests/test_kernels.py runs in this process (the CPU engine path
# never calls a kernel: it dispatches CPU tensors to the PyTorch references).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# ---- tokenizer: one token per character, special tokens first --------------------------------
SPECIAL_TOKENS = ("<|endoftext|>", "<|startoftext|>", "<|mdm_mask|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|unk|>")
CHARS = tuple("\n\t" + string.printable[:95])   # digits, letters, punctuation, space
TINY_VOCAB: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
EOS_ID = TINY_VOCAB["<|endoftext|>"]      # 0: eos and pad
BOS_ID = TINY_VOCAB["<|startoftext|>"]    # 1
MASK_ID = TINY_VOCAB["<|mdm_mask|>"]      # 2
EOT_ID = TINY_VOCAB["<|eot_id|>"]         # 3: end of turn (generation_config eos)
# the exact reference sampler (one token per forward over the whole canvas): what a test about
# the sampler's exactness names, since SamplingParams defaults to threshold decoding with the
# family's fast cache (issue 42)
EXACT = {"decode": "vanilla", "cache": "none"}
UNK_ID = TINY_VOCAB["<|unk|>"]
TINY_VOCAB_SIZE = 128                     # model rows; > len(TINY_VOCAB) like real checkpoints
assert len(TINY_VOCAB) <= TINY_VOCAB_SIZE

# LLaDA-Instruct's layout minus the BOS, as in tools/demo_tokenizer.py: the post-processor adds the
# BOS when the rendered prompt is encoded (``tok(text)``), so it appears exactly once.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def tiny_llada_config(**overrides) -> dict:
    """LLaDA-style config.json (OLMo keys) of a 2-layer, d=64, 4-head model over TINY_VOCAB."""
    cfg = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 96,
        "mlp_ratio": 1.5, "vocab_size": TINY_VOCAB_SIZE, "embedding_size": TINY_VOCAB_SIZE,
        "rope": True, "rope_theta": 10000.0, "rope_full_precision": True,
        "layer_norm_type": "rms", "rms_norm_eps": 1e-5, "activation_type": "silu",
        "block_type": "llama", "include_bias": False, "include_qkv_bias": False,
        "weight_tying": False, "max_sequence_length": 256,
        "mask_token_id": MASK_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
    }
    cfg.update(overrides)
    return cfg


def tiny_dream_config(**overrides) -> dict:
    """Dream-style config.json (Qwen2 keys): 2 layers, d=64, 4 heads, 2 KV heads (GQA)."""
    cfg = {
        "architectures": ["DreamModel"], "model_type": "Dream",
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": TINY_VOCAB_SIZE,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": 256, "tie_word_embeddings": False, "rope_scaling": None,
        "mask_token_id": MASK_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
    }
    cfg.update(overrides)
    return cfg


def tiny_config(family: str = "llada", **overrides) -> dict:
    if family == "llada":
        return tiny_llada_config(**overrides)
    if family == "dream":
        return tiny_dream_config(**overrides)
    raise ValueError(f"unknown family {family!r} (llada|dream)")


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter with seeded noise of a scale that makes attention peaked.

    Matrices ~ N(0, 1/fan_in) (embeddings N(0, 1)), norm weights 1 + N(0, 0.1^2), biases
    N(0, 0.1^2): unlike ``init_weights`` nothing is zero or one, so a wrong mapping of any tensor
    (a norm, a bias, gate vs up, RoPE) changes the logits well above float32 noise.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                t = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                t = 0.1 * torch.randn(p.shape, generator=gen)
            elif name.startswith("embed"):
                t = torch.randn(p.shape, generator=gen)
            else:
                t = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
                if ".q_proj." in name or ".k_proj." in name:
                    t = t * 2.0       # sharper attention: RoPE / masking errors show up clearly
            p.copy_(t.to(p.dtype))
    return model


def tiny_model(family: str = "llada", seed: int = 0, dtype=torch.float32, config: dict | None = None,
               **overrides):
    """A tiny ``DiffusionTransformer`` with every parameter random (deterministic in ``seed``)."""
    from flash_dllm.models.loader import build_model
    cfg = config if config is not None else tiny_config(family, **overrides)
    return randomize_(build_model(cfg, device="cpu", dtype=dtype, init=False), seed).eval()


def write_tiny_tokenizer(folder: str | Path, family: str = "llada") -> Path:
    """Char-level tokenizer files; ``PreTrainedTokenizerFast.from_pretrained(folder)`` round-trips
    text exactly (``decode(encode(s), skip_special_tokens=True) == s`` for printable ASCII)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab=dict(TINY_VOCAB), unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", pair="<|startoftext|> $A $B:1",
        special_tokens=[("<|startoftext|>", BOS_ID)])
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>", "unk_token": "<|unk|>", "mask_token": "<|mdm_mask|>",
               "additional_special_tokens": ["<|eot_id|>", "<|start_header_id|>",
                                             "<|end_header_id|>"]}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
               "clean_up_tokenization_spaces": False, "model_max_length": 256,
               "add_bos_token": True, **special}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2),
                                                    encoding="utf-8")
    return folder


def write_tiny_checkpoint(folder: str | Path, family: str = "llada", sharded: bool = False,
                          seed: int = 0, tokenizer: bool = True, dtype=torch.float32,
                          config: dict | None = None, **overrides) -> Path:
    """Write a tiny random checkpoint in the Hugging Face layout and return ``folder``.

    ``sharded`` writes ~3 shards + ``model.safetensors.index.json``; otherwise ``model.safetensors``.
    ``generation_config.json`` lists ``<|endoftext|>`` and ``<|eot_id|>`` as eos (as LLaDA-Instruct).
    The weights equal ``tiny_model(family, seed, config=config, **overrides)``'s (cast to ``dtype``).
    """
    from flash_dllm.models.loader import save_checkpoint

    folder = Path(folder)
    hf = config if config is not None else tiny_config(family, **overrides)
    model = tiny_model(family, seed=seed, config=hf)
    max_shard = None
    if sharded:
        total = sum(p.numel() for p in model.parameters()) * torch.tensor([], dtype=dtype).element_size()
        max_shard = total // 3 + 1
    save_checkpoint(model, folder, hf, dtype=dtype, max_shard_bytes=max_shard)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": EOS_ID}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    if tokenizer:
        write_tiny_tokenizer(folder, family)
    return folder


# ---- LLaDA2: the real layout, written without the engine's code ------------------------------
def tiny_llada2_config(**overrides) -> dict:
    """LLaDA2 config.json (its real keys): 3 layers (the first dense), d=64, 4 heads of 16, 2 KV
    heads, 8 experts in 4 groups (2 groups kept), 2 per token, one shared expert, q/k norm, half
    of each head rotated. No mask_token_id, as the real configs: the tokenizer names it."""
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "num_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True, "router_dtype": "fp32", "first_k_dense_replace": 1,
        "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "use_rmsnorm": True,
        "norm_head": False, "partial_rotary_factor": 0.5, "rope_theta": 600000.0,
        "rope_scaling": None, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "vocab_size": TINY_VOCAB_SIZE, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "bos_token_id": BOS_ID,
    }
    cfg.update(overrides)
    return cfg


def llada2_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under LLaDA2's checkpoint names for ``cfg`` (``randomize_``'s
    scales: nothing zero or one, so a wrong mapping of any tensor shows in the logits)."""
    gen = torch.Generator().manual_seed(seed)
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    shared = inter * (cfg.get("num_shared_experts") or 0)

    def mat(rows: int, cols: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * scale / math.sqrt(cols)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    t = {"model.word_embeddings.weight": torch.randn(cfg["vocab_size"], d, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "attention.query_key_value.weight"] = mat((H + 2 * Hkv) * hd, d, 2.0)
        if cfg.get("use_qkv_bias"):
            t[p + "attention.query_key_value.bias"] = 0.1 * torch.randn((H + 2 * Hkv) * hd,
                                                                         generator=gen)
        if cfg.get("use_qk_norm"):
            t[p + "attention.query_layernorm.weight"] = norm(hd)
            t[p + "attention.key_layernorm.weight"] = norm(hd)
        t[p + "attention.dense.weight"] = mat(d, H * hd)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if i < cfg.get("first_k_dense_replace", 0):
            t[p + "mlp.gate_proj.weight"] = mat(cfg["intermediate_size"], d)
            t[p + "mlp.up_proj.weight"] = mat(cfg["intermediate_size"], d)
            t[p + "mlp.down_proj.weight"] = mat(d, cfg["intermediate_size"])
            continue
        t[p + "mlp.gate.weight"] = mat(E, d)
        t[p + "mlp.gate.expert_bias"] = 0.1 * torch.randn(E, generator=gen)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(inter, d)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = mat(inter, d)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = mat(d, inter)
        if shared:
            t[p + "mlp.shared_experts.gate_proj.weight"] = mat(shared, d)
            t[p + "mlp.shared_experts.up_proj.weight"] = mat(shared, d)
            t[p + "mlp.shared_experts.down_proj.weight"] = mat(d, shared)
    t["model.norm.weight"] = norm(d)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = mat(cfg["vocab_size"], d)
    return t


def write_sharded(folder: str | Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> Path:
    """``tensors`` as ``shards`` safetensors files + ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        part = names[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(folder / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2),
                                                         encoding="utf-8")
    return folder


def write_tiny_llada2_checkpoint(folder: str | Path, seed: int = 0, shards: int = 3,
                                 tokenizer: bool = True, config: dict | None = None,
                                 tensors: dict[str, torch.Tensor] | None = None,
                                 **overrides) -> Path:
    """A tiny LLaDA2 folder in the real layout: config.json, ``shards`` weight files + index
    (``tensors``, default ``llada2_tensors(config, seed)``), generation_config.json and the
    char-level tokenizer with its chat template."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = config if config is not None else tiny_llada2_config(**overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    write_sharded(folder, tensors if tensors is not None else llada2_tensors(cfg, seed), shards)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": EOS_ID}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    if tokenizer:
        write_tiny_tokenizer(folder)
    return folder


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def make_tiny_checkpoint(tmp_path):
    """Factory: ``make_tiny_checkpoint(family="llada", sharded=False, seed=0, ...) -> folder``
    under ``tmp_path`` (a fresh sub-folder per call)."""
    count = [0]

    def make(family: str = "llada", **kwargs) -> Path:
        count[0] += 1
        return write_tiny_checkpoint(tmp_path / f"{family}-{count[0]}", family, **kwargs)

    return make


@pytest.fixture
def tiny_llada_ckpt(make_tiny_checkpoint) -> Path:
    return make_tiny_checkpoint("llada")


@pytest.fixture
def tiny_dream_ckpt(make_tiny_checkpoint) -> Path:
    return make_tiny_checkpoint("dream")


@pytest.fixture(params=["llada", "dream"])
def tiny_ckpt(request, make_tiny_checkpoint) -> Path:
    """A tiny checkpoint of each family (parametrised)."""
    return make_tiny_checkpoint(request.param)
