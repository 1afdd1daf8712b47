"""Parity of our LLaDA / Dream forward with `transformers`' Llama / Qwen2 run bidirectionally.

The reference weights are taken from the *checkpoint* our model writes (LLaDA's OLMo names, Dream's
Qwen2 names) through a name map written out here by hand from MODELS.md, so a wrong entry in a
family's weight map (e.g. gate vs up) fails these tests instead of cancelling out.
"""
from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import tiny_dream_config, tiny_llada_config, tiny_model
from flash_dllm.models.loader import load_model, save_checkpoint

TOL = 1e-4

# LLaDA checkpoint name -> transformers Llama name (MODELS.md: ff_proj = gate, up_proj = up,
# block ff_out = down, top-level ff_out = LM head).
_LLADA_TO_LLAMA = (
    (r"model\.transformer\.wte\.weight", "model.embed_tokens.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.q_proj\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.k_proj\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.v_proj\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.attn_out\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_norm\.weight",
     r"model.layers.\1.post_attention_layernorm.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_proj\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.up_proj\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"model\.transformer\.blocks\.(\d+)\.ff_out\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"model\.transformer\.ln_f\.weight", "model.norm.weight"),
    (r"model\.transformer\.ff_out\.weight", "lm_head.weight"),
)


def _llada_state_to_llama(state: dict) -> dict:
    out = {}
    for name, t in state.items():
        for pat, repl in _LLADA_TO_LLAMA:
            if re.fullmatch(pat, name):
                out[re.sub(pat, repl, name)] = t
                break
        else:
            raise AssertionError(f"unmapped LLaDA checkpoint tensor {name}")
    return out


def _checkpoint_state(model, hf_cfg, tmp_path) -> dict:
    folder = save_checkpoint(model, tmp_path / "ckpt", hf_cfg, dtype=torch.float32)
    return load_file(str(folder / "model.safetensors"))


def _reference_llama(hf: dict, state: dict, rope_theta: float | None = None) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["d_model"],
        intermediate_size=hf["mlp_hidden_size"], num_hidden_layers=hf["n_layers"],
        num_attention_heads=hf["n_heads"], num_key_value_heads=hf["n_kv_heads"],
        hidden_act="silu", max_position_embeddings=hf["max_sequence_length"],
        rms_norm_eps=hf["rms_norm_eps"], attention_bias=False, mlp_bias=False,
        tie_word_embeddings=bool(hf.get("weight_tying", False)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": rope_theta if rope_theta is not None else hf["rope_theta"]},
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    cfg._attn_implementation = "eager"    # independent of our SDPA path
    ref = LlamaForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(_llada_state_to_llama(state), strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert not unexpected and set(missing) <= allowed_missing, (missing, unexpected)
    if cfg.tie_word_embeddings:
        ref.tie_weights()
        assert ref.lm_head.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    return ref


def _reference_qwen2(hf: dict, state: dict) -> Qwen2ForCausalLM:
    cfg = Qwen2Config(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"], hidden_act="silu",
        max_position_embeddings=hf["max_position_embeddings"], rms_norm_eps=hf["rms_norm_eps"],
        tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": hf["rope_theta"]},
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    ref = Qwen2ForCausalLM(cfg).eval()
    # Dream's checkpoint names *are* Qwen2's: load strictly, unchanged.
    ref.load_state_dict(state, strict=True)
    return ref


def _full_mask(ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Additive 4-D mask [B, 1, L, L]: 0 everywhere (bidirectional), -inf on hidden keys."""
    b, n = ids.shape
    mask = torch.zeros(b, 1, n, n)
    if keep is not None:
        mask = mask.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    return mask


@torch.no_grad()
def _ref_logits(ref, ids, keep=None) -> torch.Tensor:
    return ref(input_ids=ids, attention_mask=_full_mask(ids, keep), use_cache=False).logits


def _ids(batch=2, length=13, vocab=128, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


CASES = {
    "llada": (tiny_llada_config, _reference_llama),
    "llada-tied": (lambda: tiny_llada_config(weight_tying=True), _reference_llama),
    "dream": (tiny_dream_config, _reference_qwen2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(case, tmp_path):
    make_cfg, make_ref = CASES[case]
    hf = make_cfg()
    family = "dream" if case.startswith("dream") else "llada"
    model = tiny_model(family, seed=3, config=hf)
    state = _checkpoint_state(model, hf, tmp_path)
    if case == "llada-tied":
        assert model.lm_head is None
        assert not any("ff_out" in n and "blocks" not in n for n in state)
    if family == "dream":
        assert model.cfg.num_kv_heads < model.cfg.num_heads            # GQA really exercised
        for n, t in state.items():
            if n.endswith("_proj.bias"):
                assert t.abs().min() > 0, f"{n} has zero entries; biases would go untested"
    ref = make_ref(hf, state)
    loaded, _ = load_model(tmp_path / "ckpt", dtype="float32")

    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
        ours_loaded = loaded(ids)
    theirs = _ref_logits(ref, ids)
    assert ours.shape == theirs.shape == (*ids.shape, hf["vocab_size"])
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"{case}: max |ours - transformers| = {err:.3g} (logit std {theirs.std():.3g})"
    assert torch.equal(ours, ours_loaded)
    assert theirs.std() > 0.5, "logits too flat for the comparison to mean much"


@pytest.mark.parametrize("case", ["llada", "dream"])
def test_attention_is_bidirectional(case, tmp_path):
    """Changing only the last token must change the first position's logits in both models
    (and a causal reference must not see it: the check has teeth)."""
    make_cfg, make_ref = CASES[case]
    hf = make_cfg()
    model = tiny_model(case, seed=4, config=hf)
    ref = make_ref(hf, _checkpoint_state(model, hf, tmp_path))
    a = _ids(batch=1, length=9, seed=5)
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % hf["vocab_size"]
    with torch.no_grad():
        ours_a, ours_b = model(a), model(b)
        causal_a = ref(input_ids=a, use_cache=False).logits    # default mask: causal
        causal_b = ref(input_ids=b, use_cache=False).logits
    ref_a, ref_b = _ref_logits(ref, a), _ref_logits(ref, b)
    assert (ours_a[0, 0] - ours_b[0, 0]).abs().max() > 1e-3
    assert (ref_a[0, 0] - ref_b[0, 0]).abs().max() > 1e-3
    assert torch.allclose(causal_a[0, :-1], causal_b[0, :-1], atol=1e-6)
    assert (ours_a - ref_a).abs().max() <= TOL and (ours_b - ref_b).abs().max() <= TOL


@pytest.mark.parametrize("case", ["llada", "dream"])
def test_key_mask_matches_padded_reference(case, tmp_path):
    """DenseContext's key_mask hides padding keys exactly like an additive mask in transformers,
    and a padded row equals the same row unpadded."""
    make_cfg, make_ref = CASES[case]
    hf = make_cfg()
    model = tiny_model(case, seed=6, config=hf)
    ref = make_ref(hf, _checkpoint_state(model, hf, tmp_path))
    ids = _ids(batch=2, length=11, seed=7)
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[1, 7:] = False                                    # row 1: 7 real tokens, 4 pad on the right
    with torch.no_grad():
        ours = model(ids, key_mask=keep)
        alone = model(ids[1:, :7])
    theirs = _ref_logits(ref, ids, keep)
    assert (ours - theirs).abs().max() <= TOL
    assert (ours[1, :7] - alone[0]).abs().max() <= TOL


def test_parity_check_is_sensitive(tmp_path):
    """Negative control: a reference with another RoPE theta or a swapped gate/up is far off,
    so the 1e-4 tolerance above really constrains RoPE and the MLP mapping."""
    hf = tiny_llada_config()
    model = tiny_model("llada", seed=8, config=hf)
    state = _checkpoint_state(model, hf, tmp_path)
    ids = _ids()
    with torch.no_grad():
        ours = model(ids)
    wrong_theta = _ref_logits(_reference_llama(hf, state, rope_theta=hf["rope_theta"] * 2), ids)
    assert (ours - wrong_theta).abs().max() > 100 * TOL
    swapped = dict(state)
    for n in list(state):
        if n.endswith(".ff_proj.weight"):
            up = n.replace(".ff_proj.", ".up_proj.")
            swapped[n], swapped[up] = state[up], state[n]
    assert (ours - _ref_logits(_reference_llama(hf, swapped), ids)).abs().max() > 100 * TOL


@pytest.mark.parametrize("case", ["llada", "dream"])
def test_positions_follow_token_order(case):
    """RoPE sees positions: permuting the input does not just permute the logits."""
    model = tiny_model(case, seed=9)
    ids = _ids(batch=1, length=8, seed=10)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids)[0, perm]
        b = model(ids[:, perm])[0]
    assert (a - b).abs().max() > 1e-3
