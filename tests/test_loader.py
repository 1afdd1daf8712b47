"""Strict checkpoint loading: round trips (single file, sharded, bf16) and clear errors."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import (BOS_ID, EOS_ID, EOT_ID, MASK_ID, TINY_VOCAB, TINY_VOCAB_SIZE, tiny_config,
                      tiny_model, write_tiny_checkpoint)
from safetensors.torch import load_file, save_file

from flash_dllm.models.loader import CheckpointError, load_model, read_config, save_checkpoint


def _ids(length=12, seed=0) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB_SIZE, (2, length),
                         generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model, ids=None) -> torch.Tensor:
    return model(_ids() if ids is None else ids)


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("sharded", [False, True])
def test_roundtrip_identical_logits(family, sharded, make_tiny_checkpoint):
    folder = make_tiny_checkpoint(family, sharded=sharded, seed=1)
    if sharded:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) > 1 and not (folder / "model.safetensors").exists()
        assert all((folder / s).is_file() for s in shards)
    else:
        assert (folder / "model.safetensors").is_file()
        assert not (folder / "model.safetensors.index.json").exists()
    original = tiny_model(family, seed=1)
    model, cfg = load_model(folder, dtype="float32")
    assert cfg.arch == family and cfg.mask_token_id == MASK_ID
    for (n1, p1), (n2, p2) in zip(original.named_parameters(), model.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert torch.equal(_logits(model), _logits(original))


def test_sharded_and_single_file_agree(make_tiny_checkpoint):
    a, _ = load_model(make_tiny_checkpoint("dream", sharded=False, seed=2))
    b, _ = load_model(make_tiny_checkpoint("dream", sharded=True, seed=2))
    assert torch.equal(_logits(a), _logits(b))


def test_tied_embeddings_roundtrip(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llada", weight_tying=True)
    names = load_file(str(folder / "model.safetensors")).keys()
    assert "model.transformer.ff_out.weight" not in names
    model, cfg = load_model(folder)
    assert cfg.tie_word_embeddings and model.lm_head is None
    assert torch.equal(_logits(model), _logits(tiny_model("llada", weight_tying=True)))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bf16_load(family, make_tiny_checkpoint):
    folder = make_tiny_checkpoint(family, seed=3)
    ref, _ = load_model(folder, dtype="float32")
    model, _ = load_model(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = _logits(model)
    assert out.dtype == torch.bfloat16
    want = _logits(ref)
    err = (out.float() - want).abs().max().item()
    assert err <= 0.05 * want.abs().max().item(), f"bf16 max err {err:.3g}"
    # argmax mostly agrees
    assert (out.float().argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_bf16_checkpoint_loads_in_float32(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llada", dtype=torch.bfloat16, sharded=True)
    model, _ = load_model(folder, dtype="float32")
    original = tiny_model("llada")
    for p, q in zip(model.parameters(), original.parameters()):
        assert p.dtype == torch.float32
        assert torch.equal(p, q.to(torch.bfloat16).float())


def test_generation_config_adds_end_of_turn(make_tiny_checkpoint):
    _, cfg, raw = read_config(make_tiny_checkpoint("llada"))
    assert raw["eos_token_id"] == EOS_ID
    assert cfg.eos_token_ids == (EOS_ID, EOT_ID)


def test_save_default_config_roundtrip(tmp_path):
    """save_checkpoint without an hf config writes the family's own config.json, which loads back."""
    for family in ("llada", "dream"):
        model = tiny_model(family, seed=4)
        save_checkpoint(model, tmp_path / family, dtype=torch.float32)
        loaded, cfg = load_model(tmp_path / family)
        assert cfg == model.cfg
        assert torch.equal(_logits(loaded), _logits(model))


# ---- the tiny tokenizer the other tests rely on ------------------------------------------------
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tiny_tokenizer(family, make_tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    folder = make_tiny_checkpoint(family)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    _, cfg, _ = read_config(folder)
    assert tok.convert_tokens_to_ids("<|mdm_mask|>") == tok.mask_token_id == cfg.mask_token_id
    assert tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id == cfg.eos_token_ids[0]
    assert tok.convert_tokens_to_ids("<|eot_id|>") == EOT_ID and tok.bos_token_id == BOS_ID
    assert len(tok) == len(TINY_VOCAB) <= cfg.vocab_size
    text = "Hello,  world!\n\tx = (1 + 2) * 3; ok? ~`|"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == len(text) + 1          # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids[1:]) == text
    masked = tok("a<|mdm_mask|>b", add_special_tokens=False)["input_ids"]
    assert masked == [TINY_VOCAB["a"], MASK_ID, TINY_VOCAB["b"]]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == ("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                      "<|start_header_id|>assistant<|end_header_id|>\n\n")
    enc = tok(prompt)["input_ids"]                  # the engine's path: BOS from the post-processor
    assert enc[0] == BOS_ID and enc.count(BOS_ID) == 1 and enc.count(EOT_ID) == 1
    assert tok.decode(enc, skip_special_tokens=True) == "user\n\nhiassistant\n\n"


# ---- failures name the problem ----------------------------------------------------------------
def _rewrite_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_config(folder, raw) -> None:
    (folder / "config.json").write_text(json.dumps(raw), encoding="utf-8")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint folder not found.*nope"):
        load_model(tmp_path / "nope")


def test_missing_config(tiny_llada_ckpt):
    (tiny_llada_ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tiny_llada_ckpt)


def test_invalid_json_config(tiny_llada_ckpt):
    (tiny_llada_ckpt / "config.json").write_text('{"d_model": 64,', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        load_model(tiny_llada_ckpt)


def test_unknown_architecture(tiny_llada_ckpt):
    _write_config(tiny_llada_ckpt, tiny_config("llada", architectures=["GPT2LMHeadModel"],
                                               model_type="gpt2"))
    with pytest.raises(ValueError, match="unknown architecture") as e:
        load_model(tiny_llada_ckpt)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg and "LLaDAModelLM" in msg and "DreamModel" in msg


def test_model_type_alone_resolves(tiny_dream_ckpt):
    raw = tiny_config("dream")
    del raw["architectures"]
    _write_config(tiny_dream_ckpt, raw)
    _, cfg = load_model(tiny_dream_ckpt)
    assert cfg.arch == "dream"


def test_missing_required_key(tiny_llada_ckpt):
    raw = tiny_config("llada")
    del raw["d_model"]
    _write_config(tiny_llada_ckpt, raw)
    with pytest.raises(ValueError, match="missing required key 'd_model'"):
        load_model(tiny_llada_ckpt)


@pytest.mark.parametrize("family,name", [
    ("llada", "model.transformer.blocks.1.up_proj.weight"),
    ("llada", "model.transformer.ff_out.weight"),
    ("dream", "model.layers.0.self_attn.k_proj.bias"),
])
def test_missing_tensor(family, name, make_tiny_checkpoint):
    folder = make_tiny_checkpoint(family)
    _rewrite_weights(folder, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensors.*" + re.escape(name)):
        load_model(folder)


@pytest.mark.parametrize("name", ["model.transformer.blocks.0.extra.weight",
                                  "model.transformer.blocks.7.q_proj.weight",   # layer 7 of 2
                                  "lm_head.weight"])                            # Dream's name
def test_unexpected_tensor(name, tiny_llada_ckpt):
    _rewrite_weights(tiny_llada_ckpt, lambda t: t.__setitem__(name, torch.zeros(64, 64)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*" + re.escape(name)):
        load_model(tiny_llada_ckpt)


def test_unexpected_tied_head(make_tiny_checkpoint):
    """A config that says weight_tying but a checkpoint with an LM head is refused, not ignored."""
    folder = make_tiny_checkpoint("llada")
    _write_config(folder, tiny_config("llada", weight_tying=True))
    with pytest.raises(CheckpointError, match=r"unexpected tensors.*model\.transformer\.ff_out"):
        load_model(folder)


@pytest.mark.parametrize("family,change", [
    ("llada", {"mlp_hidden_size": 128}),
    ("llada", {"d_model": 128}),
    ("dream", {"num_key_value_heads": 4}),
    ("dream", {"vocab_size": 256}),
])
def test_shape_mismatch(family, change, make_tiny_checkpoint):
    folder = make_tiny_checkpoint(family)
    _write_config(folder, tiny_config(family, **change))
    with pytest.raises(CheckpointError, match=r"shape mismatch for \S+.*checkpoint \(.*model "
                                              r"expects \(.*config\.json"):
        load_model(folder)


def test_fewer_layers_in_checkpoint(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("dream")
    _write_config(folder, tiny_config("dream", num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=r"missing tensors.*model\.layers\.2\."):
        load_model(folder)


def test_missing_shard(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llada", sharded=True)
    shard = sorted(folder.glob("model-*-of-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(shard.name) + ".*missing"):
        load_model(folder)


def test_index_without_weight_map(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llada", sharded=True)
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}', encoding="utf-8")
    with pytest.raises(CheckpointError, match="weight_map"):
        load_model(folder)


def test_no_weights(tiny_llada_ckpt):
    (tiny_llada_ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tiny_llada_ckpt)


def test_bin_only_weights(tiny_llada_ckpt):
    (tiny_llada_ckpt / "model.safetensors").unlink()
    (tiny_llada_ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tiny_llada_ckpt)


def test_bad_dtype(tiny_llada_ckpt):
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(tiny_llada_ckpt, dtype="int8")


@pytest.mark.parametrize("family,change,pattern", [
    ("llada", {"include_bias": True}, "include_bias"),
    ("llada", {"block_type": "sequential"}, "block_type"),
    ("dream", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ("dream", {"hidden_act": "gelu"}, "hidden_act"),
    ("llada", {"mask_token_id": 999}, "mask_token_id 999 outside the vocabulary"),
])
def test_unsupported_config(family, change, pattern, make_tiny_checkpoint):
    folder = make_tiny_checkpoint(family, tokenizer=False)
    _write_config(folder, tiny_config(family, **change))
    with pytest.raises(ValueError, match=pattern):
        load_model(folder)


def test_helper_is_deterministic(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", "dream", seed=5, tokenizer=False)
    b = write_tiny_checkpoint(tmp_path / "b", "dream", seed=5, tokenizer=False)
    c = write_tiny_checkpoint(tmp_path / "c", "dream", seed=6, tokenizer=False)
    ta, tb, tc = (load_file(str(f / "model.safetensors")) for f in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])


def test_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_the_cpu():
    import torch

    from flash_dllm.entrypoints.args import EngineArgs
    from flash_dllm.models.loader import parse_dtype
    assert EngineArgs().dtype == "auto"
    assert parse_dtype("auto", "cpu") is torch.float32
    assert parse_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert parse_dtype("auto") is torch.float32
    assert parse_dtype("bfloat16", "cpu") is torch.bfloat16     # an explicit dtype wins
    with pytest.raises(ValueError, match="auto"):
        parse_dtype("fp8")


def test_llm_default_dtype_on_the_cpu_is_float32():
    import torch

    from flash_dllm.entrypoints.llm import LLM
    llm = LLM()
    assert next(llm.engine.model.parameters()).dtype is torch.float32


def test_serve_sizes_the_kv_pool_from_gpu_memory_unless_told():
    """serve / bench serve leave --kv-cache-gb unset: on a GPU the pool then takes 0.8 of its
    memory minus the weights (split between engines sharing it), elsewhere 1 GiB; any explicit
    pool size wins (issue 21: 1 GiB held ~13 requests of the LLaDA-8B shape)."""
    import argparse

    from flash_dllm.entrypoints.args import AUTO_GPU_MEMORY_UTILIZATION as U
    from flash_dllm.entrypoints.args import EngineArgs
    from flash_dllm.entrypoints.serve import SERVE_DEFAULTS

    auto = EngineArgs(device="cuda", kv_cache_gb=None)
    assert auto.kv_sizing() == {"kv_cache_gb": 1.0, "gpu_memory_utilization": U}
    assert auto.kv_sizing(share=2)["gpu_memory_utilization"] == U / 2
    assert EngineArgs(device="cpu", kv_cache_gb=None).kv_sizing() == {"kv_cache_gb": 1.0}
    assert EngineArgs(device="cuda:1", kv_cache_gb=None, num_kv_pages=64).kv_sizing() == \
        {"kv_cache_gb": 1.0}
    assert EngineArgs(device="cuda", kv_cache_gb=None,
                      gpu_memory_utilization=0.5).engine_config().gpu_memory_utilization == 0.5
    assert EngineArgs(device="cuda", kv_cache_gb=2.0).kv_sizing() == {}
    assert EngineArgs(device="cuda").engine_config().gpu_memory_utilization is None   # library
    # the serve flags: unset by default, and the CPU engine config is the library's
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p, defaults=SERVE_DEFAULTS)
    args = EngineArgs.from_cli_args(p.parse_args([]))
    assert args.kv_cache_gb is None
    cfg = args.engine_config()
    assert (cfg.kv_cache_gb, cfg.gpu_memory_utilization) == (1.0, None)
    args = EngineArgs.from_cli_args(p.parse_args(["--kv-cache-gb", "3", "--device", "cuda"]))
    assert (args.engine_config().kv_cache_gb, args.engine_config().gpu_memory_utilization) \
        == (3.0, None)


def test_a_kv_pool_larger_than_the_free_gpu_memory_is_a_named_error(monkeypatch):
    """``gpu_memory_utilization`` sizes the pool from the device's total memory; when another
    process holds part of it the engine says so instead of failing with an OOM. Memory this
    process's allocator keeps cached (an engine freed before) counts as free."""
    from types import SimpleNamespace

    import torch

    from flash_dllm.config import EngineConfig
    from flash_dllm.worker.runner import ModelRunner

    G = 2**30
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: SimpleNamespace(
        total_memory=100 * G))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: 10 * G)      # the weights
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 10 * G)
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (90 * G, 100 * G))
    fake = SimpleNamespace(config=EngineConfig(gpu_memory_utilization=0.8),
                           device=torch.device("cuda", 0))
    assert ModelRunner._kv_budget(fake) == 70 * G
    monkeypatch.setattr(cuda, "mem_get_info", lambda d: (40 * G, 100 * G))  # someone else
    with pytest.raises(ValueError, match=r"70\.0 GiB KV pool, but only 40\.0 GiB .*another "
                                         r"process"):
        ModelRunner._kv_budget(fake)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 40 * G)  # 30 GiB cached by us
    assert ModelRunner._kv_budget(fake) == 70 * G
