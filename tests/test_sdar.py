"""SDAR and SDAR-MoE (issue 41): tiny random checkpoints in the real layouts (Qwen3 / Qwen3-MoE
names, one tensor per expert, SDAR's ``block_size`` and ``mask_token_id`` keys, sharded) load
strictly, and ``LLM.logits`` equals ``transformers``' own Qwen3 / Qwen3-MoE modules fed the same
tensors and SDAR's block-causal mask (blocks from position 0); the pattern has teeth; the load
errors; the save round trip."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_checkpoints import (one_torch_thread, qwen_style_tensors,  # noqa: F401
                                tiny_sdar_config, tiny_sdar_moe_config,
                                write_family_checkpoint)
from test_llada2 import read_checkpoint

from conftest import EOS_ID, EOT_ID, MASK_ID, TINY_VOCAB_SIZE
from flash_dllm import LLM
from flash_dllm.layers.attention import block_causal
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.loader import CheckpointError, load_model, save_checkpoint
from flash_dllm.models.registry import resolve

TOL = 1e-4
_SDAR_ONLY = ("architectures", "model_type", "block_size", "mask_token_id")


def hf_reference(folder: Path):
    """transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM of the folder's config, its
    parameters filled from the checkpoint's tensors (the experts stacked into transformers'
    packed ``gate_up_proj`` / ``down_proj``)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    raw = json.loads((folder / "config.json").read_text())
    keys = {k: v for k, v in raw.items() if k not in _SDAR_ONLY}
    moe = "num_experts" in raw
    cfg = (Qwen3MoeConfig if moe else Qwen3Config)(**keys, attn_implementation="eager")
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(cfg).float().eval()
    t = read_checkpoint(folder)
    state = {}
    for name, tensor in t.items():
        if ".mlp.experts." not in name:
            state[name] = tensor
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp"
        if f"{p}.experts.0.gate_proj.weight" not in t:
            continue
        E = raw["num_experts"]
        state[f"{p}.experts.gate_up_proj"] = torch.stack([torch.cat(
            [t[f"{p}.experts.{e}.gate_proj.weight"], t[f"{p}.experts.{e}.up_proj.weight"]])
            for e in range(E)])
        state[f"{p}.experts.down_proj"] = torch.stack(
            [t[f"{p}.experts.{e}.down_proj.weight"] for e in range(E)])
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if raw.get("tie_word_embeddings"):
        model.tie_weights()
    return model


@torch.no_grad()
def hf_logits(model, ids: torch.Tensor, block: int) -> torch.Tensor:
    """SDAR's inference forward: position i sees j iff j // block <= i // block."""
    L = ids.shape[1]
    pos = torch.arange(L)
    allow = pos[None] // block <= pos[:, None] // block
    mask = torch.zeros(L, L).masked_fill(~allow, torch.finfo(torch.float32).min)
    return model(input_ids=ids, attention_mask=mask[None, None].expand(ids.shape[0], 1, L, L),
                 position_ids=pos[None].expand(ids.shape[0], L)).logits


def _ids(B: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB_SIZE, (B, L), generator=torch.Generator().manual_seed(seed))


CONFIGS = {"sdar": tiny_sdar_config, "sdar_moe": tiny_sdar_moe_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    folder = write_family_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt",
                                     CONFIGS[request.param](), seed=6)
    with LLM(str(folder), dtype="float32") as llm:
        yield request.param, folder, llm


@pytest.mark.parametrize("block_length,oracle_block", [(None, 4), (8, 8), (22, 22)])
def test_logits_equal_transformers_qwen3(case, block_length, oracle_block):
    """None: the model's own pattern (block 4 from config.json); 8: another block size; 22 (the
    whole canvas): full attention."""
    _, folder, llm = case
    ids = _ids(2, 22, seed=1)
    ids[0, 9:15] = MASK_ID
    got = llm.logits(ids.tolist(), block_length=block_length)
    want = hf_logits(hf_reference(folder), ids, oracle_block)
    assert got.shape == want.shape == (2, 22, TINY_VOCAB_SIZE)
    assert (got - want).abs().max() <= TOL, (got - want).abs().max()
    assert want.std() > 0.5


def test_the_pattern_has_teeth(case):
    _, _, llm = case
    a = _ids(1, 12, seed=2)
    b = a.clone()
    b[0, 9] = (a[0, 9] + 1) % TINY_VOCAB_SIZE
    la, lb = llm.logits(a), llm.logits(b)
    assert (la[0, :8] - lb[0, :8]).abs().max() <= 1e-5            # blocks 0 and 1 never see it
    assert (la[0, 8:] - lb[0, 8:]).abs().max() > 1e-3


def test_config_and_tokenizer(case):
    name, _, llm = case
    cfg = llm.cfg
    assert cfg.arch == name and cfg.attention == block_causal(4) and cfg.logit_shift == 0
    assert cfg.qk_norm and cfg.rotary_dim is None and not cfg.rope_fp32
    assert cfg.mask_token_id == MASK_ID and set(cfg.eos_token_ids) == {EOS_ID, EOT_ID}
    assert cfg.num_params() == sum(p.numel() for p in llm._model.parameters())
    if name == "sdar_moe":
        assert cfg.dense_layers == (1,)
        assert cfg.moe == MoEConfig(num_experts=8, top_k=3, intermediate_size=32,
                                    score_function="softmax", norm_topk_prob=True)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("changes", [
    {"block_size": 8}, {"norm_topk_prob": False}, {"tie_word_embeddings": True},
    {"decoder_sparse_step": 2, "mlp_only_layers": []},
])
def test_config_variants_equal_transformers(tmp_path, changes):
    """A block-8 variant, Qwen3-MoE's default un-normalised top-k, a tied head (SDAR-1.7B /
    4B), dense layers by decoder_sparse_step."""
    raw = tiny_sdar_moe_config(**changes)
    folder = write_family_checkpoint(tmp_path / "v", raw, seed=7, tokenizer=False)
    model, cfg = load_model(folder)
    block = raw["block_size"]
    assert cfg.attention == block_causal(block)
    ids = _ids(2, 20, seed=3)
    with torch.no_grad():
        got = model(ids)
    want = hf_logits(hf_reference(folder), ids, block)
    assert (got - want).abs().max() <= TOL


def test_mask_id_from_the_tokenizer_when_config_has_none(tmp_path):
    raw = tiny_sdar_config()
    del raw["mask_token_id"], raw["block_size"]
    folder = write_family_checkpoint(tmp_path / "nomask", raw, seed=1)
    with LLM(str(folder), dtype="float32") as llm:
        assert llm.cfg.mask_token_id == MASK_ID and llm.cfg.attention == block_causal(4)


@pytest.mark.parametrize("key,value", [
    ("attention_bias", True), ("use_sliding_window", True), ("hidden_act", "gelu"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_unsupported_switches_are_refused(key, value):
    for make, label in ((tiny_sdar_config, "SDAR"), (tiny_sdar_moe_config, "SDAR-MoE")):
        raw = make(**{key: value})
        with pytest.raises(ValueError, match=f"{label} config.json sets {key}="):
            resolve(raw).parse_config(raw)


def test_strict_loading_names_the_problem(tmp_path):
    tensors = qwen_style_tensors(tiny_sdar_moe_config(), seed=0)
    bad = write_family_checkpoint(tmp_path / "e", tiny_sdar_moe_config(num_experts=4),
                                  tensors=tensors, tokenizer=False)
    with pytest.raises(CheckpointError, match="num_experts=4, but layer 0 of the checkpoint"):
        load_model(bad)
    tensors.pop("model.layers.0.self_attn.k_norm.weight")
    missing = write_family_checkpoint(tmp_path / "m", tiny_sdar_moe_config(), tensors=tensors,
                                      tokenizer=False)
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_norm.weight"):
        load_model(missing)


def test_save_writes_the_real_layout_back(case, tmp_path):
    name, folder, _ = case
    model, _ = load_model(folder)
    out = save_checkpoint(model, tmp_path / "saved", dtype=torch.float32)
    from safetensors.torch import load_file
    original, saved = read_checkpoint(folder), load_file(str(out / "model.safetensors"))
    assert set(saved) == set(original)
    assert all(torch.equal(saved[n], t) for n, t in original.items())
    again = json.loads((out / "config.json").read_text())
    assert again["model_type"] == name and again["block_size"] == 4


def test_absent_head_dim_is_128_as_sdar_config_class_says():
    raw = tiny_sdar_config()
    del raw["head_dim"]
    assert resolve(raw).parse_config(raw).head_dim == 128          # not 64 / 4
