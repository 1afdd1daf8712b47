"""The layer options the next families need, each against a naive reference: the block-causal
mask and dense attention (LLaDA2.x, SDAR), per-head q/k RMSNorm before RoPE (LLaDA2, Qwen3),
partial rotary (LLaDA2 rotates half of each head); an SDAR-like model (Qwen3 with block-causal
attention) against transformers' Qwen3; and the paged engine refusing what it cannot compute."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transformers import Qwen3Config, Qwen3ForCausalLM

from conftest import EXACT, randomize_, tiny_dream_config, tiny_llada_config, tiny_model
from flash_dllm.config import SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.layers.attention import (BIDIRECTIONAL, Attention, AttentionPattern,
                                         DenseContext, block_causal)
from flash_dllm.layers.rotary import Rotary
from flash_dllm.models import dream, registry
from flash_dllm.models.transformer import DiffusionTransformer

TOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------ attention pattern
@pytest.mark.parametrize("block,lq,lk", [(1, 7, 7), (4, 11, 11), (4, 5, 13), (32, 40, 40)])
def test_block_causal_mask_matches_a_naive_loop(block, lq, lk):
    q_pos = torch.randperm(max(lq, lk), generator=_gen(block))[:lq]     # any positions, any order
    k_pos = torch.arange(lk)
    allow = block_causal(block).allow(q_pos, k_pos)
    naive = torch.tensor([[k_pos[j] // block <= q_pos[i] // block for j in range(lk)]
                          for i in range(lq)])
    assert allow.shape == (lq, lk) and torch.equal(allow, naive)
    assert BIDIRECTIONAL.allow(q_pos, k_pos) is None


def test_pattern_fields_are_validated():
    with pytest.raises(ValueError, match="AttentionPattern.kind must be one of"):
        AttentionPattern("causal")
    with pytest.raises(ValueError, match="AttentionPattern.block_size must be >= 1"):
        block_causal(0)
    with pytest.raises(ValueError, match="AttentionPattern.block_size must be 0"):
        AttentionPattern("bidirectional", 4)
    assert str(block_causal(32)) == "block_causal(32)" and str(BIDIRECTIONAL) == "bidirectional"


def _attention(pattern=BIDIRECTIONAL, qk_norm_eps=None, rotary_dim=None, seed=0) -> Attention:
    attn = Attention(32, 4, 2, 8, True, Rotary(8, 10000.0, True, rotary_dim), pattern=pattern,
                     qk_norm_eps=qk_norm_eps)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=_gen(seed)) * 0.5 + (p.dim() == 1))
    return attn.eval()


def _naive_attention(attn: Attention, x: torch.Tensor, key_ok) -> torch.Tensor:
    """One query at a time, plain softmax over the keys ``key_ok(b, i, j)`` allows."""
    B, L, _ = x.shape
    pos = torch.arange(L)
    q, k, v = attn.project(x)
    q, k = attn.rotary(q, pos), attn.rotary(k, pos)
    H, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    out = torch.zeros(B, L, H, D)
    for b in range(B):
        for i in range(L):
            keys = [j for j in range(L) if key_ok(b, i, j)]
            for h in range(H):
                kh = h // (H // Hkv)
                s = torch.stack([q[b, i, h] @ k[b, j, kh] for j in keys]) / math.sqrt(D)
                out[b, i, h] = (s.softmax(0)[:, None] * v[b, keys, kh]).sum(0)
    return out.flatten(2)


@pytest.mark.parametrize("block", [1, 3, 4])
def test_dense_block_causal_attention_matches_a_naive_loop(block):
    attn = _attention(block_causal(block))
    x = torch.randn(2, 10, 32, generator=_gen(1))
    with torch.no_grad():
        ours = DenseContext().attention(attn, 0, x, torch.arange(10))
        naive = _naive_attention(attn, x, lambda b, i, j: j // block <= i // block)
    assert (ours - naive).abs().max() <= TOL


def test_dense_block_causal_with_padding_keys():
    attn = _attention(block_causal(4))
    x = torch.randn(2, 10, 32, generator=_gen(2))
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[1, 7:] = False                                    # row 1: 7 real tokens, 3 pad
    with torch.no_grad():
        ours = DenseContext(keep).attention(attn, 0, x, torch.arange(10))
        naive = _naive_attention(attn, x, lambda b, i, j: j // 4 <= i // 4 and bool(keep[b, j]))
    assert (ours[keep] - naive[keep]).abs().max() <= TOL
    # a left-padded row whose first block is all padding: its padding rows see themselves, so
    # nothing is NaN and the real rows are those of the row without its padding
    keep = torch.ones(1, 10, dtype=torch.bool)
    keep[0, :4] = False
    with torch.no_grad():
        out = DenseContext(keep).attention(attn, 0, x[:1], torch.arange(10))
    assert torch.isfinite(out).all()


def test_block_causal_model_never_looks_ahead_and_a_whole_block_is_bidirectional():
    cfg = tiny_model("llada").cfg
    bd = randomize_(DiffusionTransformer(replace(cfg, attention=block_causal(4))), 3).eval()
    full = DiffusionTransformer(cfg).eval()
    full.load_state_dict(bd.state_dict())
    ids = torch.randint(3, 128, (1, 12), generator=_gen(4))
    with torch.no_grad():
        base = bd(ids)
        for pos in range(12):
            other = ids.clone()
            other[0, pos] = (ids[0, pos] + 1) % 128
            changed = (bd(other)[0] - base[0]).abs().amax(-1) > 1e-4     # [12]
            blk = pos // 4
            assert not changed[:blk * 4].any() and changed[blk * 4:].all(), pos
        # a block as long as the canvas is bidirectional attention
        one = DiffusionTransformer(replace(cfg, attention=block_causal(12))).eval()
        one.load_state_dict(bd.state_dict())
        assert (one(ids) - full(ids)).abs().max() <= TOL


# ------------------------------------------------------------------------------ q/k norm
def test_qk_norm_matches_a_naive_per_head_rmsnorm():
    attn = _attention(qk_norm_eps=1e-6)
    x = torch.randn(3, 5, 32, generator=_gen(5))
    with torch.no_grad():
        q, k, v = attn.project(x)
        raw_q = (x @ attn.q_proj.weight.t() + attn.q_proj.bias).view(3, 5, 4, 8)
        raw_k = (x @ attn.k_proj.weight.t() + attn.k_proj.bias).view(3, 5, 2, 8)
        for raw, got, w in ((raw_q, q, attn.q_norm.weight), (raw_k, k, attn.k_norm.weight)):
            for idx in [(0, 0, 0), (2, 4, 1), (1, 2, 1)]:
                h = raw[idx]
                want = h / torch.sqrt((h * h).mean() + 1e-6) * w
                assert (got[idx] - want).abs().max() <= TOL
        assert torch.equal(v, (x @ attn.v_proj.weight.t() + attn.v_proj.bias).view(3, 5, 2, 8))
        attn.fuse()                                        # the engine's fused q/k/v GEMM
        fq, fk, fv = attn.project(x)
    assert (fq - q).abs().max() <= TOL and (fk - k).abs().max() <= TOL
    assert [n for n, _ in attn.named_parameters() if "norm" in n] == ["q_norm.weight",
                                                                      "k_norm.weight"]


def test_default_families_have_no_new_parameters():
    for family in ("llada", "dream"):
        names = [n for n, _ in tiny_model(family).named_parameters()]
        assert not any("q_norm" in n or "k_norm" in n for n in names), family


# -------------------------------------------------------------------------- partial rotary
@pytest.mark.parametrize("fp32", [True, False])
def test_partial_rotary_matches_a_naive_rotation(fp32):
    D, R, theta = 16, 8, 500.0
    rot = Rotary(D, theta, fp32, rotary_dim=R)
    x = torch.randn(6, 3, D, generator=_gen(6))           # [tokens, heads, head_dim]
    pos = torch.tensor([0, 1, 5, 17, 100, 3])
    out = rot(x, pos)
    for t in range(6):
        for h in range(3):
            want = x[t, h].clone()
            for i in range(R // 2):                        # pairs (i, i + R/2) of the slice
                a = pos[t].item() * theta ** (-2 * i / R)
                x1, x2 = x[t, h, i].item(), x[t, h, i + R // 2].item()
                want[i] = x1 * math.cos(a) - x2 * math.sin(a)
                want[i + R // 2] = x2 * math.cos(a) + x1 * math.sin(a)
            assert (out[t, h] - want).abs().max() <= 1e-4, (t, h)
    assert torch.equal(out[..., R:], x[..., R:])           # the rest passes through


def test_full_rotary_dim_is_the_old_rotary():
    x = torch.randn(4, 2, 8, generator=_gen(7))
    pos = torch.arange(4) * 3
    assert torch.equal(Rotary(8, 1e4, True, rotary_dim=8)(x, pos), Rotary(8, 1e4, True)(x, pos))
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        Rotary(8, 1e4, True, rotary_dim=5)


# ------------------------------------ an SDAR-like model (Qwen3, block-causal) vs transformers
def test_qwen3_block_causal_parity_with_transformers():
    """q/k norm + GQA + block-causal attention against transformers' Qwen3 given the block-causal
    mask as an additive 4-D mask: SDAR's exact oracle (MODELS.md)."""
    block, L = 4, 13
    base = dream.parse_config(tiny_dream_config())
    cfg = replace(base, qkv_bias=False, qk_norm=True, attention=block_causal(block),
                  logit_shift=0)
    ours = randomize_(DiffusionTransformer(cfg), 11).eval()
    hf = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                     num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
                     max_position_embeddings=cfg.max_position, tie_word_embeddings=False,
                     attention_bias=False, use_sliding_window=False,
                     rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                     pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf._attn_implementation = "eager"
    ref = Qwen3ForCausalLM(hf).eval()
    state = {}
    for name, p in ours.state_dict().items():
        if ".attn.q_norm." in name or ".attn.k_norm." in name:
            i = name.split(".")[1]
            state[f"model.layers.{i}.self_attn.{name.split('.')[3]}.weight"] = p
        else:
            state[dream.FAMILY.to_ckpt_name(name)] = p
    ref.load_state_dict(state, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, L), generator=_gen(12))
    pos = torch.arange(L)
    allow = (pos[None, :] // block) <= (pos[:, None] // block)
    mask = torch.zeros(2, 1, L, L).masked_fill(~allow, torch.finfo(torch.float32).min)
    with torch.no_grad():
        theirs = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        mine = ours(ids)
        no_norm = DiffusionTransformer(replace(cfg, qk_norm=False)).eval()
        no_norm.load_state_dict({n: p for n, p in ours.state_dict().items() if "_norm." not in
                                 n or "attn." not in n})
        wrong = no_norm(ids)
    assert (mine - theirs).abs().max() <= 1e-4, (mine - theirs).abs().max()
    assert (wrong - theirs).abs().max() > 1e-2           # the check has teeth: q/k norm matters
    assert theirs.std() > 0.5


# ------------------------------------------------------------------ config and the engine
def test_model_config_validates_the_new_fields():
    cfg = tiny_model("llada").cfg
    assert cfg.attention == BIDIRECTIONAL and cfg.mlp_kind == "dense" and not cfg.qk_norm
    with pytest.raises(ValueError, match="ModelConfig.mlp_kind must be one of"):
        replace(cfg, mlp_kind="sparse")
    with pytest.raises(ValueError, match=r"ModelConfig.dense_layers must be layer indices in "
                                         r"\[0, 2\)"):
        replace(cfg, dense_layers=(2,))
    with pytest.raises(ValueError, match="ModelConfig.rotary_dim must be even"):
        replace(cfg, rotary_dim=cfg.head_dim + 2)
    with pytest.raises(ValueError, match="ModelConfig.attention must be an AttentionPattern"):
        replace(cfg, attention="block_causal")
    assert replace(cfg, dense_layers=(0,)).layer_mlp_kind(0) == "dense"
    assert replace(cfg, qk_norm=True).num_params() == cfg.num_params() + 2 * 2 * cfg.head_dim


@pytest.mark.parametrize("change", [{"qk_norm": True}, {"rotary_dim": 8},
                                    {"qk_norm": True, "rotary_dim": 8}])
def test_the_paged_engine_computes_what_the_dense_loop_computes(change):
    """Per-head q/k norm and partial rotary in the paged path (``attention_backend.
    attend_normed``): the exact sampler token for token against the dense reference loop.
    (Block-causal attention: tests/test_block_causal.py.)"""
    from test_sampler import reference_vanilla, run_engine, tiny
    base = tiny("llada", seed=4)
    cfg = replace(base.cfg, **change)
    model = DiffusionTransformer(cfg)
    model.init_weights(std=0.3, seed=4)
    prompts = [[1, 5, 6, 7, 8, 9], [1, 20, 21]]
    reqs, _ = run_engine(model, prompts, SamplingParams(max_tokens=16, block_length=8,
                                                        early_stop=False, **EXACT))
    for prompt, req in zip(prompts, reqs):
        ref, _ = reference_vanilla(model, prompt, 16, 8, 16)      # the generated ids
        assert req.canvas[len(prompt):].tolist() == ref
    assert cfg.paged_unsupported() is None


def test_family_builds_its_model_through_the_registry():
    fam = registry.by_name("llada")
    cfg = tiny_model("llada").cfg
    model = fam.build(cfg, "cpu", torch.float64)
    assert isinstance(model, DiffusionTransformer) and model.embed.weight.dtype == torch.float64
    assert fam.build(cfg).embed.weight.is_meta                      # default: nothing allocated
    with pytest.raises(ValueError, match="is not a 'dream' config"):
        registry.by_name("dream").build(cfg)
    assert tiny_llada_config()["architectures"][0] in fam.architectures
