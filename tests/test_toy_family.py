"""A model family is one definition plus one registration: a toy family with its own config.json
keys and tensor names (Meta's original Llama layout: ``tok_embeddings``, ``attention.wq``,
``feed_forward.w1`` ...) over the same transformer is written, loaded and generated with, and
answers exactly as the same weights in LLaDA's layout do. Nothing outside this file changes."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import (EXACT, BOS_ID, EOS_ID, EOT_ID, MASK_ID, TINY_VOCAB_SIZE, randomize_,
                      tiny_llada_config, write_tiny_tokenizer)
from flash_dllm import LLM, SamplingParams
from flash_dllm.layers.attention import BIDIRECTIONAL, block_causal
from flash_dllm.models import registry
from flash_dllm.models.config import ModelConfig
from flash_dllm.models.family import Family, as_id_tuple, require
from flash_dllm.models.loader import build_model, load_model, save_checkpoint
from flash_dllm.models.transformer import DiffusionTransformer


# ------------------------------------------------------------------------- the toy family
def parse_toy(raw: dict) -> ModelConfig:
    n_heads = int(require(raw, "n_heads", "Toy"))
    block = raw.get("block_size")
    return ModelConfig(
        arch=raw.get("model_type", "toy"),        # "toy" or "toy-block" (the family's name)
        vocab_size=int(require(raw, "vocab", "Toy")),
        hidden_size=int(require(raw, "dim", "Toy")),
        num_layers=int(require(raw, "n_layers", "Toy")),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("n_kv_heads") or n_heads),
        head_dim=int(raw["dim"]) // n_heads,
        intermediate_size=int(require(raw, "ffn_dim", "Toy")),
        rope_theta=float(raw.get("rope_base", 10000.0)),
        rms_norm_eps=float(raw.get("norm_eps", 1e-5)),
        max_position=int(raw.get("max_len", 256)),
        mask_token_id=raw.get("mask_id"),
        eos_token_ids=as_id_tuple(raw.get("eos_id")),
        pad_token_id=raw.get("eos_id"),
        bos_token_id=raw.get("bos_id"),
        attention=block_causal(int(block)) if block else BIDIRECTIONAL,
        mlp_kind="dense",
    )


def toy_hf(cfg: ModelConfig) -> dict:
    out = {"architectures": ["ToyDiffusionLM"], "model_type": "toy", "dim": cfg.hidden_size,
           "n_layers": cfg.num_layers, "n_heads": cfg.num_heads, "n_kv_heads": cfg.num_kv_heads,
           "ffn_dim": cfg.intermediate_size, "vocab": cfg.vocab_size,
           "rope_base": cfg.rope_theta, "norm_eps": cfg.rms_norm_eps,
           "max_len": cfg.max_position, "mask_id": cfg.mask_token_id,
           "eos_id": cfg.eos_token_ids[0], "bos_id": cfg.bos_token_id}
    if cfg.attention.block_causal:
        out.update(architectures=["ToyBlockDiffusionLM"], model_type="toy-block",
                   block_size=cfg.attention.block_size)
    return out


TOY_WEIGHTS = (
    ("tok_embeddings", "embed"),
    ("layers.{i}.attention_norm", "layers.{i}.attn_norm"),
    ("layers.{i}.attention.wq", "layers.{i}.attn.q_proj"),
    ("layers.{i}.attention.wk", "layers.{i}.attn.k_proj"),
    ("layers.{i}.attention.wv", "layers.{i}.attn.v_proj"),
    ("layers.{i}.attention.wo", "layers.{i}.attn.o_proj"),
    ("layers.{i}.ffn_norm", "layers.{i}.mlp_norm"),
    ("layers.{i}.feed_forward.w1", "layers.{i}.mlp.gate_proj"),
    ("layers.{i}.feed_forward.w3", "layers.{i}.mlp.up_proj"),
    ("layers.{i}.feed_forward.w2", "layers.{i}.mlp.down_proj"),
    ("norm", "norm"),
    ("output", "lm_head"),
)

FAMILY = Family(name="toy", architectures=("ToyDiffusionLM",), model_types=("toy",),
                parse_config=parse_toy, to_hf_config=toy_hf, weight_map=TOY_WEIGHTS,
                model=DiffusionTransformer, attention=BIDIRECTIONAL, mlp="dense")
# the same layout, attending block-causally (block size from config.json)
BLOCK_FAMILY = Family(name="toy-block", architectures=("ToyBlockDiffusionLM",),
                      model_types=("toy-block",), parse_config=parse_toy, to_hf_config=toy_hf,
                      weight_map=TOY_WEIGHTS, model=DiffusionTransformer,
                      attention=block_causal(4), mlp="dense")


@pytest.fixture(autouse=True)
def toy_registered():
    with registry.registered(FAMILY), registry.registered(BLOCK_FAMILY):
        yield


# ------------------------------------------------------------------------------- helpers
def toy_config(**overrides) -> dict:
    cfg = {"architectures": ["ToyDiffusionLM"], "model_type": "toy", "dim": 64, "n_layers": 2,
           "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 96, "vocab": TINY_VOCAB_SIZE,
           "rope_base": 10000.0, "norm_eps": 1e-5, "max_len": 256, "mask_id": MASK_ID,
           "eos_id": EOS_ID, "bos_id": BOS_ID}
    cfg.update(overrides)
    return cfg


def write_folder(folder, model, hf: dict | None):
    save_checkpoint(model, folder, hf, dtype=torch.float32)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": EOS_ID}
    (folder / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    write_tiny_tokenizer(folder)
    return folder


def toy_checkpoint(folder, seed: int = 0, **overrides):
    hf = toy_config(**overrides)
    model = randomize_(build_model(hf, init=False), seed).eval()
    return write_folder(folder, model, hf), model


# --------------------------------------------------------------------------------- tests
def test_registration_resolves_the_toy_layout(tmp_path):
    folder, model = toy_checkpoint(tmp_path / "toy")
    assert isinstance(model, DiffusionTransformer) and model.cfg.arch == "toy"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"tok_embeddings.weight", "layers.1.attention.wq.weight",
            "layers.0.feed_forward.w2.weight", "norm.weight", "output.weight"} <= names
    assert not any(n.startswith(("embed", "model.", "lm_head")) for n in names)
    loaded, cfg = load_model(folder)
    assert cfg.arch == "toy" and cfg.eos_token_ids == (EOS_ID, EOT_ID)
    ids = torch.randint(0, TINY_VOCAB_SIZE, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_unregistered_toy_is_unknown(tmp_path):
    folder, _ = toy_checkpoint(tmp_path / "toy")
    registry.unregister(FAMILY)
    try:
        with pytest.raises(ValueError, match="unknown architecture"):
            load_model(folder)
    finally:
        registry.register(FAMILY)


def test_register_refuses_a_clash():
    with pytest.raises(ValueError, match="clashes with the registered family 'toy'"):
        registry.register(Family(name="toy2", architectures=("ToyDiffusionLM",),
                                 model_types=(), parse_config=parse_toy, to_hf_config=toy_hf,
                                 weight_map=TOY_WEIGHTS, model=DiffusionTransformer))
    with pytest.raises(ValueError, match="clashes"):
        registry.register(FAMILY)
    assert [f.name for f in registry.FAMILIES].count("toy") == 1


def test_toy_generates_exactly_as_the_same_weights_in_llada_layout(tmp_path):
    """The family changes names and keys only: LLM over the toy folder and over a LLaDA folder
    holding the same weights answer token for token alike."""
    folder, model = toy_checkpoint(tmp_path / "toy", seed=3)
    llada_hf = tiny_llada_config(n_kv_heads=2, rms_norm_eps=1e-5)
    twin = build_model(llada_hf, init=False)
    twin.load_state_dict(model.state_dict())
    llada_folder = write_folder(tmp_path / "llada", twin, llada_hf)
    prompts = ["The quick brown fox", "2 + 2 ="]
    params = SamplingParams(max_tokens=16, block_length=8, temperature=0.0, **EXACT)
    outs = {}
    for name, path in (("toy", folder), ("llada", llada_folder)):
        with LLM(str(path), dtype="float32") as llm:
            assert llm.cfg.arch == name
            outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["toy"] == outs["llada"]
    assert all(len(t) > 0 for t in outs["toy"])


def test_block_causal_family_runs_dense_and_in_the_engine(tmp_path):
    folder, model = toy_checkpoint(tmp_path / "toy-block", seed=5,
                                   architectures=["ToyBlockDiffusionLM"], model_type="toy-block",
                                   block_size=4)
    loaded, cfg = load_model(folder)
    assert cfg.attention == block_causal(4) and loaded.layers[0].attn.pattern == cfg.attention
    a = torch.randint(3, TINY_VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(2))
    b = a.clone()
    b[0, 9] = (a[0, 9] + 1) % TINY_VOCAB_SIZE        # a token of block 2 (positions 8-11)
    with torch.no_grad():
        la, lb = loaded(a), loaded(b)
    assert torch.equal(la[0, :8], lb[0, :8])         # blocks 0 and 1 never see block 2
    assert (la[0, 8:] - lb[0, 8:]).abs().max() > 1e-3
    # the paged engine runs it on its grid of blocks (tests/test_block_causal.py: exactness)
    out = LLM(str(folder), dtype="float32").generate(
        [[3, 4, 5, 6, 7]], SamplingParams(max_tokens=8, block_length=4, cache="block",
                                          decode="vanilla"))[0]
    assert 0 < len(out.token_ids) <= 8


def test_a_config_that_contradicts_its_family_is_refused():
    raw = toy_config(block_size=4)                  # a toy (bidirectional) config, block-causal
    with pytest.raises(ValueError, match="declares bidirectional attention, but its config "
                                         r"says block_causal\(4\)"):
        build_model(raw)
