"""LLaDA-MoE (issue 41): a tiny random checkpoint in the real layout (OLMoE-style names, one
tensor per expert, ``moe_layer_freq`` with a dense layer, sharded) loads strictly, and
``LLM.logits`` equals an independent plain-PyTorch forward written here from the checkpoint's
own modeling code (softmax router, top-k, no renormalisation, per-head q/k norm, full
attention); ``model_type: llada`` resolves by its architectures; the engine's samplers equal
LLaDA's plain reference loops token for token and every cache mode x decode policy of LLaDA-8B
runs on it."""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import (one_torch_thread, qwen_style_tensors,  # noqa: F401
                                tiny_llada_moe_config, write_family_checkpoint)
from test_llada2 import read_checkpoint
from test_sampler import EOS, MASK, PROMPTS, reference_threshold, reference_vanilla, run_engine

from conftest import EOS_ID, EOT_ID, MASK_ID, TINY_VOCAB_SIZE
from flash_dllm import LLM, SamplingParams
from flash_dllm.layers.attention import BIDIRECTIONAL
from flash_dllm.layers.moe import MoEConfig
from flash_dllm.models.loader import CheckpointError, build_model, load_model, save_checkpoint
from flash_dllm.models.registry import resolve

TOL = 1e-4


def reference_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """LLaDA-MoE's forward from its config.json and tensors alone: ids [B, L] -> logits
    [B, L, V]; every position attends to every position; each token's experts one at a time."""
    cfg, t = json.loads((folder / "config.json").read_text()), read_checkpoint(folder)
    eps, H = cfg["rms_norm_eps"], cfg["num_attention_heads"]
    hd = cfg["hidden_size"] // H
    B, L = ids.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def swiglu(x, prefix):
        g, u, dn = (t[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        return (F.silu(x @ g.T) * (x @ u.T)) @ dn.T

    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(L).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(x):                                              # [B, L, heads, hd]
        return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin

    x = t["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms(x, t[f"{p}.input_layernorm.weight"])
        q = (h @ t[f"{p}.self_attn.q_proj.weight"].T).view(B, L, H, hd)
        k = (h @ t[f"{p}.self_attn.k_proj.weight"].T).view(B, L, -1, hd)
        v = (h @ t[f"{p}.self_attn.v_proj.weight"].T).view(B, L, -1, hd)
        q = rope(rms(q, t[f"{p}.self_attn.q_norm.weight"]))
        k = rope(rms(k, t[f"{p}.self_attn.k_norm.weight"]))
        k, v = k.repeat_interleave(H // k.shape[2], 2), v.repeat_interleave(H // v.shape[2], 2)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(hd)
        a = torch.einsum("bhlm,bmhd->blhd", s.softmax(-1), v)
        x = x + a.reshape(B, L, H * hd) @ t[f"{p}.self_attn.o_proj.weight"].T
        h = rms(x, t[f"{p}.post_attention_layernorm.weight"])
        if not cfg["moe_layer_freq"][i]:
            x = x + swiglu(h, f"{p}.mlp")
            continue
        y = torch.zeros_like(h)
        for b, j in itertools.product(range(B), range(L)):
            probs = (t[f"{p}.mlp.gate.weight"] @ h[b, j]).softmax(-1)
            chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())
            for e in chosen[:cfg["num_experts_per_tok"]]:   # weighted by the raw probability
                y[b, j] += probs[e] * swiglu(h[b, j], f"{p}.mlp.experts.{e}")
        x = x + y
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_family_checkpoint(tmp_path_factory.mktemp("lmoe") / "ckpt",
                                   tiny_llada_moe_config(), seed=4)


@pytest.fixture(scope="module")
def llm(folder):
    with LLM(str(folder), dtype="float32") as llm:
        yield llm


def test_logits_equal_an_independent_forward(folder, llm):
    ids = torch.randint(3, TINY_VOCAB_SIZE, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[0, 6:14] = MASK_ID
    got = llm.logits(ids.tolist())
    want = reference_logits(folder, ids)
    assert got.shape == (2, 24, TINY_VOCAB_SIZE)
    assert (got - want).abs().max() <= TOL, (got - want).abs().max()
    assert want.std() > 0.5


def test_config_resolution_and_tokenizer(folder, llm):
    cfg = llm.cfg
    assert cfg.arch == "llada_moe" and cfg.attention == BIDIRECTIONAL and cfg.logit_shift == 0
    assert cfg.qk_norm and cfg.rotary_dim is None and not cfg.rope_fp32
    assert cfg.dense_layers == (1,) and cfg.intermediate_size == 96
    assert cfg.moe == MoEConfig(num_experts=8, top_k=3, intermediate_size=32,
                                score_function="softmax", norm_topk_prob=False)
    # no mask id in config.json: the tokenizer names it; eos from config, generation_config
    assert cfg.mask_token_id == MASK_ID and set(cfg.eos_token_ids) == {EOS_ID, EOT_ID}
    assert cfg.num_params() == sum(p.numel() for p in llm._model.parameters())
    # model_type "llada" is LLaDA-8B's too: the architectures decide
    assert resolve({"architectures": ["LLaDAMoEModelLM"], "model_type": "llada"}).name == \
        "llada_moe"
    assert resolve({"architectures": ["LLaDAModelLM"], "model_type": "llada"}).name == "llada"
    assert resolve({"model_type": "llada"}).name == "llada"


def test_norm_topk_prob_and_scaling_keys_are_ignored_as_the_code_does(folder, tmp_path):
    """The modeling code hard-codes norm_topk_prob False and never reads routed_scaling_factor
    nor the group keys: the same tensors give the same logits whatever those keys say."""
    cfg = tiny_llada_moe_config(norm_topk_prob=True, routed_scaling_factor=2.5,
                                router_num_group=2, router_topk_group=1)
    other = write_family_checkpoint(tmp_path / "o", cfg, seed=4, tokenizer=False)
    a, _ = load_model(folder)
    b, _ = load_model(other)
    ids = torch.randint(3, TINY_VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


@pytest.mark.parametrize("key,value", [
    ("attention_bias", True), ("clip_qkv", 8.0), ("moe_router_enable_expert_bias", True),
    ("moe_router_score_function", "sigmoid"), ("shared_expert_intermediate_size", 64),
    ("rope_scaling", {"type": "linear", "factor": 2.0}), ("hidden_act", "gelu"),
])
def test_unsupported_switches_are_refused(key, value):
    raw = tiny_llada_moe_config(**{key: value})
    with pytest.raises(ValueError, match=f"LLaDA-MoE config.json sets {key}="):
        resolve(raw).parse_config(raw)


def test_bad_layer_list_and_expert_count(tmp_path):
    raw = tiny_llada_moe_config(moe_layer_freq=[1, 1])
    with pytest.raises(ValueError, match="moe_layer_freq=\\[1, 1\\] must list 0"):
        resolve(raw).parse_config(raw)
    tensors = qwen_style_tensors(tiny_llada_moe_config(), seed=0)
    bad = write_family_checkpoint(tmp_path / "b", tiny_llada_moe_config(num_experts=16),
                                  tensors=tensors, tokenizer=False)
    with pytest.raises(CheckpointError, match="num_experts=16, but layer 0 of the checkpoint "
                                              "holds experts 0..7"):
        load_model(bad)
    tensors.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    missing = write_family_checkpoint(tmp_path / "m", tiny_llada_moe_config(), tensors=tensors,
                                      tokenizer=False)
    with pytest.raises(CheckpointError, match="model.layers.2.mlp.experts.5.up_proj.weight"):
        load_model(missing)


def test_save_writes_the_real_layout_back(folder, tmp_path):
    model, _ = load_model(folder)
    out = save_checkpoint(model, tmp_path / "saved", dtype=torch.float32)
    original, saved = read_checkpoint(folder), _read_single(out)
    assert set(saved) == set(original)
    assert all(torch.equal(saved[n], t) for n, t in original.items())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LLaDAMoEModelLM"]


def _read_single(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


# ------------------------------------------------------------------ the engine's samplers
def _tiny_moe(seed: int = 0):
    """A LLaDA-MoE of test_sampler's vocabulary (MASK 99, EOS 98), peaked distributions."""
    raw = tiny_llada_moe_config(vocab_size=100, mask_token_id=MASK, eos_token_id=EOS,
                                pad_token_id=EOS, bos_token_id=None, num_hidden_layers=2,
                                moe_layer_freq=[1, 1])
    model = build_model(raw, seed=seed)
    model.init_weights(std=0.3, seed=seed)
    return model


@pytest.mark.parametrize("gen,block,steps", [(16, 8, 16), (24, 8, 6)])
def test_vanilla_equals_llada_reference_loop(gen, block, steps):
    model = _tiny_moe()
    params = SamplingParams(max_tokens=gen, block_length=block, steps=steps, early_stop=False,
                            decode="vanilla", cache="none")
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref, nfe = reference_vanilla(model, prompt, gen, block, steps)
        assert req.canvas[len(prompt):].tolist() == ref and out.num_forwards == nfe


@pytest.mark.parametrize("tau", [0.5, 0.9])
def test_threshold_equals_fast_dllm_reference_loop(tau):
    model = _tiny_moe()
    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=tau,
                            early_stop=False, cache="none")
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref, nfe = reference_threshold(model, prompt, 16, 8, tau)
        assert req.canvas[len(prompt):].tolist() == ref and out.num_forwards == nfe


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_modes_first_step_is_exact(cache):
    model = _tiny_moe(seed=1)
    exact = SamplingParams(max_tokens=24, block_length=8, steps=3, early_stop=False,
                           decode="vanilla", cache="none")
    cached = SamplingParams(max_tokens=24, block_length=8, steps=3, cache=cache,
                            early_stop=False, decode="vanilla")
    r1, _ = run_engine(model, PROMPTS, exact)
    r2, _ = run_engine(model, PROMPTS, cached)
    assert all(torch.equal(a.canvas, b.canvas) for a, b in zip(r1, r2))


@pytest.mark.parametrize("cache,decode", list(itertools.product(
    ["none", "prefix", "dual", "flash"], ["vanilla", "threshold", "verify"])))
def test_every_cache_mode_and_policy_runs(cache, decode):
    model = _tiny_moe(seed=2)
    params = SamplingParams(max_tokens=16, block_length=8, cache=cache, decode=decode,
                            threshold=0.7, early_stop=False)
    reqs, outs = run_engine(model, PROMPTS, params)
    for req, out in zip(reqs, outs):
        assert out.finished and out.finish_reason in ("stop", "length")
        assert not (req.canvas == MASK).any()


def test_generate_and_chat_through_llm(llm):
    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.5)
    out = llm.generate(["hello"], params)[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 16
    assert llm.chat([{"role": "user", "content": "hi"}], params)[0].finished


@pytest.mark.parametrize("cache,decode", [("prefix", "threshold"), ("dual", "vanilla"),
                                          ("dual", "verify")])
def test_fused_step_equals_general_path(cache, decode):
    from test_fused_step import _compare
    params = SamplingParams(max_tokens=24, block_length=8, cache=cache, decode=decode,
                            threshold=0.3, early_stop=False)
    _compare(_tiny_moe(seed=3), PROMPTS, params)


def test_mask_token_text_of_the_released_tokenizer(folder, tmp_path):
    """No mask id in config.json and no declared mask token: the tokenizer's ``<|mask|>`` (the
    released LLaDA-MoE / LLaDA2 vocabulary's text for 156895) is MASK."""
    import shutil

    other = tmp_path / "m"
    shutil.copytree(folder, other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        text = (other / name).read_text().replace("<|mdm_mask|>", "<|mask|>")
        if name != "tokenizer.json":
            data = json.loads(text)
            data.pop("mask_token")
            text = json.dumps(data)
        (other / name).write_text(text)
    with LLM(str(other), dtype="float32") as llm:
        assert llm.tokenizer.hf.special_tokens_map.get("mask_token") is None
        assert llm.cfg.mask_token_id == MASK_ID
