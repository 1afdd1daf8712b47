"""Shared test helpers: tiny LLaDA / Dream configs and tiny random checkpoint folders.

Import the plain functions with ``from conftest import ...`` or use the fixtures below.

- ``tiny_llada_config(**overrides)`` / ``tiny_dream_config(**overrides)``: hf ``config.json`` dicts.
- ``tiny_model(family, seed, dtype, **overrides)``: a ``DiffusionTransformer`` whose every
  parameter (norm weights and q/k/v biases included) is random and non-trivial.
- ``write_tiny_checkpoint(folder, family, sharded, seed, tokenizer, ...)``: a Hugging Face layout
  folder (config.json, weights, generation_config.json, char-level tokenizer) -> the folder.
- ``write_tiny_tokenizer(folder, family)``: tokenizer.json + tokenizer_config.json +
  special_tokens_map.json, loadable by ``transformers.PreTrainedTokenizerFast.from_pretrained``.
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
