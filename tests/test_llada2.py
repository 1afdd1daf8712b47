"""LLaDA2.x (issue 39): a tiny random checkpoint in the real layout (fused ``query_key_value``,
one tensor per expert, float32 ``expert_bias``, sharded) loads strictly, and ``LLM.logits`` equals
an independent plain-PyTorch forward written here that reads the checkpoint's own tensors, with
block-causal and with full attention; the router against a brute force over every choice of
groups and experts (ties, the bias choosing but not weighting); the load errors; the save/load
round trip; ``LLM.logits`` for LLaDA and Dream."""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from conftest import (EOS_ID, EOT_ID, EXACT, MASK_ID, TINY_VOCAB_SIZE, llada2_tensors,
                      tiny_llada2_config, write_tiny_llada2_checkpoint)
from flash_dllm import LLM, SamplingParams
from flash_dllm.bench.shapes import SHAPES
from flash_dllm.kernels import fused_moe
from flash_dllm.layers.attention import block_causal
from flash_dllm.layers.moe import MoE, MoEConfig
from flash_dllm.models.loader import CheckpointError, load_model, read_json, save_checkpoint
from flash_dllm.models.registry import resolve

TOL = 1e-4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ the independent forward
def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in sorted(set(index.values())):
        with safe_open(str(folder / fname), framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def reference_logits(folder: Path, ids: torch.Tensor, block: int | None) -> torch.Tensor:
    """LLaDA2's forward from its config.json and tensors, written from MODELS.md alone: ids
    [B, L] -> logits [B, L, V]; ``block``: block-causal with that block size, None: full."""
    cfg, t = json.loads((folder / "config.json").read_text()), read_checkpoint(folder)
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, G = cfg["num_experts"], cfg["n_group"]
    B, L = ids.shape

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def swiglu(x, prefix):
        g, u, dn = (t[f"{prefix}.{p}_proj.weight"] for p in ("gate", "up", "down"))
        return (F.silu(x @ g.T) * (x @ u.T)) @ dn.T

    rot = int(hd * cfg["partial_rotary_factor"])
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot)
    ang = torch.arange(L).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(x):                                   # [B, L, heads, hd]: the first rot values
        r, rest = x[..., :rot], x[..., rot:]
        half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)

    pos = torch.arange(L)
    allow = (pos[None] // block <= pos[:, None] // block) if block else torch.ones(L, L).bool()
    x = t["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms(x, t[f"{p}.input_layernorm.weight"])
        qkv = h @ t[f"{p}.attention.query_key_value.weight"].T
        if cfg.get("use_qkv_bias"):
            qkv = qkv + t[f"{p}.attention.query_key_value.bias"]
        qkv = qkv.view(B, L, H + 2 * Hkv, hd)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        q = rope(rms(q, t[f"{p}.attention.query_layernorm.weight"]))
        k = rope(rms(k, t[f"{p}.attention.key_layernorm.weight"]))
        k, v = k.repeat_interleave(H // Hkv, 2), v.repeat_interleave(H // Hkv, 2)
        s = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(hd)
        a = torch.einsum("bhlm,bmhd->blhd", s.masked_fill(~allow, float("-inf")).softmax(-1), v)
        x = x + a.reshape(B, L, H * hd) @ t[f"{p}.attention.dense.weight"].T
        h = rms(x, t[f"{p}.post_attention_layernorm.weight"])
        if i < cfg["first_k_dense_replace"]:
            x = x + swiglu(h, f"{p}.mlp")
            continue
        y = torch.zeros_like(h)
        for b, j in itertools.product(range(B), range(L)):        # one token at a time
            hj = h[b, j]
            sc = torch.sigmoid(t[f"{p}.mlp.gate.weight"].float() @ hj.float())
            c = sc + t[f"{p}.mlp.gate.expert_bias"]
            per = E // G
            gscore = [sorted(c[g * per:(g + 1) * per].tolist(), reverse=True)[:2] for g in range(G)]
            groups = sorted(range(G), key=lambda g: (-(c.new_tensor(gscore[g][0])
                                                       + c.new_tensor(gscore[g][1])).item(), g))
            cand = [e for e in range(E) if e // per in groups[:cfg["topk_group"]]]
            chosen = sorted(cand, key=lambda e: (-c[e].item(), e))[:cfg["num_experts_per_tok"]]
            w = sc[chosen] / sc[chosen].sum() * cfg["routed_scaling_factor"]
            for e, we in zip(chosen, w):
                y[b, j] += we * swiglu(hj, f"{p}.mlp.experts.{e}")
            y[b, j] += swiglu(hj, f"{p}.mlp.shared_experts")
        x = x + y
    return rms(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llada2_folder(tmp_path_factory) -> Path:
    return write_tiny_llada2_checkpoint(tmp_path_factory.mktemp("llada2") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def llada2_llm(llada2_folder):
    with LLM(str(llada2_folder), dtype="float32") as llm:
        yield llm


def _ids(B: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, TINY_VOCAB_SIZE, (B, L), generator=_gen(seed))


# -------------------------------------------------------------------------- parity
@pytest.mark.parametrize("block_length,oracle_block", [(None, 32), (8, 8), (40, None)])
def test_logits_equal_an_independent_forward(llada2_folder, llada2_llm, block_length,
                                             oracle_block):
    """None: the model's own pattern (block-causal, 32); 8: another block size; 40 (the whole
    canvas): full attention."""
    ids = _ids(2, 40, seed=1)
    ids[0, 5:12] = MASK_ID                           # canvases hold masks, as when decoding
    got = llada2_llm.logits(ids.tolist(), block_length=block_length)
    want = reference_logits(llada2_folder, ids, oracle_block)
    assert got.shape == (2, 40, TINY_VOCAB_SIZE) and got.dtype == torch.float32
    assert (got - want).abs().max() <= TOL, (got - want).abs().max()
    assert want.std() > 0.5
    one = llada2_llm.logits(ids[1].tolist(), block_length=block_length)
    assert one.shape == (40, TINY_VOCAB_SIZE) and (one - got[1]).abs().max() <= 1e-5


def test_the_pattern_has_teeth(llada2_llm):
    """Block-causal: a token of block 1 never reaches block 0; full attention: it does."""
    a = _ids(1, 40, seed=2)
    b = a.clone()
    b[0, 35] = (a[0, 35] + 1) % TINY_VOCAB_SIZE
    la, lb = llada2_llm.logits(a), llada2_llm.logits(b)
    # NOTE: equal up to rounding, not bit for bit: the expert GEMMs' row counts follow which
    # tokens route where, and a CPU GEMM's rounding follows its row count
    assert (la[0, :32] - lb[0, :32]).abs().max() <= 1e-5
    assert (la[0, 32:] - lb[0, 32:]).abs().max() > 1e-3
    fa, fb = llada2_llm.logits(a, block_length=40), llada2_llm.logits(b, block_length=40)
    assert (fa[0, :32] - fb[0, :32]).abs().max() > 1e-3


def test_config_tokenizer_and_refusals(llada2_folder, llada2_llm):
    cfg = llada2_llm.cfg
    assert cfg.arch == "llada2" and cfg.attention == block_causal(32) and cfg.logit_shift == 0
    assert cfg.qk_norm and cfg.rotary_dim == 8 and not cfg.rope_fp32
    assert cfg.mlp_kind == "moe" and cfg.dense_layers == (0,)
    assert cfg.moe == MoEConfig(num_experts=8, top_k=2, intermediate_size=32,
                                num_shared_experts=1, score_function="sigmoid", expert_bias=True,
                                n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=2.5)
    # no mask_token_id in config.json: the tokenizer's <|mdm_mask|>; eos from all three files
    assert cfg.mask_token_id == MASK_ID and set(cfg.eos_token_ids) == {EOS_ID, EOT_ID}
    model = llada2_llm._model
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    text = llada2_llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("assistant<|end_header_id|>\n\n")


def test_llm_without_an_engine(llada2_folder, llada2_llm, monkeypatch):
    """A model the paged engine refuses (``paged_unsupported``) still loads: logits work,
    generate and .engine raise the reason."""
    from flash_dllm.models.config import ModelConfig
    monkeypatch.setattr(ModelConfig, "paged_unsupported", lambda self: "no pages for you")
    with LLM(str(llada2_folder), dtype="float32") as llm:
        assert llm._engine is None and llm.cfg.mask_token_id == MASK_ID
        with pytest.raises(ValueError, match="no pages for you; LLM.logits"):
            llm.generate("hi", SamplingParams(max_tokens=8, **EXACT))
        with pytest.raises(ValueError, match="no pages for you"):
            llm.engine
        ids = _ids(1, 20, seed=9)
        assert (llm.logits(ids) - llada2_llm.logits(ids)).abs().max() <= 1e-5


def test_published_sizes():
    """LLaDA2.0-mini: 16 B parameters, 1.4 B active (inclusionAI's model card)."""
    raw = SHAPES["llada2-mini"]
    cfg = resolve(raw).parse_config(raw)
    assert 16.0e9 < cfg.num_params() < 16.5e9 and 1.40e9 < cfg.active_params() < 1.46e9
    dense = resolve(SHAPES["llada-8b"]).parse_config(SHAPES["llada-8b"])
    assert dense.active_params() == dense.num_params()


# ------------------------------------------------------------------------------ routing
def _brute_force(s: torch.Tensor, c: torch.Tensor, cfg: MoEConfig) -> dict[int, float]:
    """Every choice of ``topk_group`` groups, then every choice of ``top_k`` experts in them:
    the highest total wins, ties to the lexicographically first choice."""
    E, G, per = cfg.num_experts, cfg.n_group, cfg.num_experts // cfg.n_group
    gscore = [c[g * per:(g + 1) * per].topk(min(2, per)).values.sum() for g in range(G)]
    groups = max(itertools.combinations(range(G), cfg.topk_group),
                 key=lambda gs: (sum(gscore[g] for g in gs).item(), [-g for g in gs]))
    allowed = [e for e in range(E) if e // per in groups]
    best = max(itertools.combinations(allowed, cfg.top_k),
               key=lambda es: (sum(c[e] for e in es).item(), [-e for e in es]))
    w = s[list(best)]
    if cfg.norm_topk_prob:
        w = w / w.sum()
    return {e: float(x) * cfg.routed_scaling_factor for e, x in zip(best, w.detach())}


def _moe(cfg: MoEConfig, hidden: int = 8, seed: int = 0) -> MoE:
    moe = MoE(hidden, cfg)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            scale = 0.1 if name.endswith("expert_bias") else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=_gen(seed)) * scale)
    return moe.eval()


@pytest.mark.parametrize("ties", [False, True])
def test_group_limited_routing_matches_brute_force(ties):
    cfg = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, score_function="sigmoid",
                    expert_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    moe = _moe(cfg, seed=4)
    x = torch.randn(64, 8, generator=_gen(5))
    if ties:        # equal experts in a group, and group 3 a copy of group 0: equal groups
        with torch.no_grad():
            w, bias = moe.gate.weight, moe.gate.expert_bias
            w[5], bias[5] = w[4], bias[4]
            w[12:16], bias[12:16] = w[0:4].clone(), bias[0:4].clone()
            x[::4] = 0.0                              # every score 0.5: all experts tie
    ids, weights = moe.route(x)
    logits = x @ moe.gate.weight.T
    s = torch.sigmoid(logits)
    c = s + moe.gate.expert_bias
    for t in range(x.shape[0]):
        want = _brute_force(s[t], c[t], cfg)
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), (t, got, want)
        for e in want:
            assert abs(got[e] - want[e]) < 1e-6
    with torch.no_grad():
        moe.gate.expert_bias.zero_()
    assert moe.route(torch.zeros(1, 8))[0].tolist() == [[0, 1, 2, 3]]   # all tied: lowest


def test_the_bias_chooses_but_does_not_weight():
    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=4, score_function="sigmoid",
                    expert_bias=True, routed_scaling_factor=2.5)
    moe = _moe(cfg)
    s = torch.tensor([0.9, 0.8, 0.3, 0.1])
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, 0] = torch.log(s / (1 - s))          # logits whose sigmoid is s
        moe.gate.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.9]))
    ids, w = moe.route(torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]]))
    assert ids.tolist() == [[3, 0]]                   # 0.1 + 0.9 beats 0.8
    assert torch.allclose(w, torch.tensor([[0.1, 0.9]]) * 2.5)
    with torch.no_grad():
        moe.gate.expert_bias.zero_()
    assert moe.route(torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 0]]))[0].tolist() == [[0, 1]]


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_routing_without_groups(norm):
    """SDAR / LLaDA-MoE (Qwen-MoE): softmax scores, top-k, renormalised when asked."""
    cfg = MoEConfig(num_experts=8, top_k=3, intermediate_size=4, norm_topk_prob=norm)
    moe = _moe(cfg, seed=6)
    x = torch.randn(10, 8, generator=_gen(7))
    ids, w = moe.route(x)
    probs = (x @ moe.gate.weight.T).softmax(-1)
    top = probs.topk(3)
    want = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    assert torch.equal(ids, top.indices) and torch.allclose(w, want, atol=1e-6)


def test_moe_layer_and_expert_op_against_a_token_loop():
    cfg = MoEConfig(num_experts=8, top_k=2, intermediate_size=6, num_shared_experts=2,
                    score_function="sigmoid", expert_bias=True, n_group=2, topk_group=1)
    moe = _moe(cfg, seed=8)
    x = torch.randn(3, 5, 8, generator=_gen(9))
    with torch.no_grad():
        got = moe(x)
        ids, w = moe.route(x.reshape(-1, 8))
        want = torch.zeros(15, 8)
        for t, row in enumerate(x.reshape(-1, 8)):
            for e, we in zip(ids[t].tolist(), w[t]):
                g, u = moe.w_gate_up[e].chunk(2, 0)
                want[t] += we * (moe.w_down[e] @ (F.silu(g @ row) * (u @ row)))
            want[t] += moe.shared(row)
        assert torch.allclose(got.reshape(-1, 8), want, atol=1e-5)
        fused = fused_moe.op(x.reshape(-1, 8), moe.w_gate_up, moe.w_down, ids, w)
        assert torch.allclose(fused + moe.shared(x.reshape(-1, 8)), want, atol=1e-5)
        moe.fuse()                                       # the shared expert's gate/up fused
        assert torch.allclose(moe(x), got, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    ({"top_k": 0}, r"MoEConfig.top_k must be an integer >= 1, got 0"),
    ({"score_function": "sparsemixer"}, r"MoEConfig.score_function must be one of"),
    ({"n_group": 3}, r"MoEConfig.n_group \(3\) must divide num_experts \(8\)"),
    ({"n_group": 8, "topk_group": 1}, r"MoEConfig.n_group \(8\) leaves fewer than 2 experts"),
    ({"topk_group": 5}, r"MoEConfig.topk_group must be in \[1, n_group=4\]"),
    ({"top_k": 5, "topk_group": 1}, r"MoEConfig.top_k \(5\) exceeds the experts left"),
    ({"score_function": "softmax"}, (r"MoEConfig.expert_bias is supported with score_function "
                                     r"'sigmoid' only")),
    ({"score_function": "softmax", "expert_bias": False},
     r"MoEConfig.n_group: group-limited routing is supported with score_function 'sigmoid'"),
])
def test_moe_config_refuses_bad_options(change, message):
    base = dict(num_experts=8, top_k=2, intermediate_size=4, score_function="sigmoid",
                expert_bias=True, n_group=4, topk_group=2)
    with pytest.raises(ValueError, match=message):
        MoEConfig(**{**base, **change})


def test_model_config_moe_fields(llada2_llm):
    cfg = llada2_llm.cfg
    with pytest.raises(ValueError, match="ModelConfig.moe must be a MoEConfig"):
        replace(cfg, moe=None)
    with pytest.raises(ValueError, match="ModelConfig.moe is set but mlp_kind is 'dense'"):
        replace(cfg, mlp_kind="dense")


# --------------------------------------------------------------------------- loading errors
def _bad_folder(tmp_path, mutate=None, **config):
    cfg = tiny_llada2_config(**config)
    tensors = llada2_tensors(tiny_llada2_config(), seed=0)
    if mutate is not None:
        mutate(tensors)
    return write_tiny_llada2_checkpoint(tmp_path / "bad", config=cfg, tensors=tensors,
                                        tokenizer=False)


@pytest.mark.parametrize("mutate,config,message", [
    (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"), {},
     r"missing tensors in .*\['model.layers.2.mlp.experts.3.up_proj.weight'\]"),
    (lambda t: t.update({"model.layers.1.mlp.experts.0.extra_proj.weight": torch.ones(2)}), {},
     r"unexpected tensors .*model.layers.1.mlp.experts.0.extra_proj.weight"),
    (lambda t: t.update({"model.layers.1.attention.rotary_emb.inv_freq": torch.ones(4)}), {},
     r"unexpected tensors .*model.layers.1.attention.rotary_emb.inv_freq"),
    (lambda t: t.update({"model.layers.2.mlp.experts.4.down_proj.weight": torch.ones(64, 3)}),
     {}, r"shape mismatch for model.layers.2.mlp.experts.4.down_proj.weight"),
    (None, {"num_experts": 16},
     r"num_experts=16, but layer 1 of the checkpoint holds experts 0..7"),
    (None, {"num_experts": 4, "n_group": 2, "topk_group": 1},
     r"num_experts=4, but layer 1 of the checkpoint holds experts 0..7"),
    (lambda t: t.pop("model.layers.1.mlp.gate.expert_bias"), {},
     r"missing tensors .*model.layers.1.mlp.gate.expert_bias"),
])
def test_strict_loading_names_the_problem(tmp_path, mutate, config, message):
    folder = _bad_folder(tmp_path, mutate, **config)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


@pytest.mark.parametrize("key,value", [
    ("score_function", "softmax"), ("score_function", "sparsemixer"),
    ("moe_router_enable_expert_bias", False), ("norm_topk_prob", False),
    ("router_dtype", "bf16"), ("use_bias", True), ("rope_scaling", {"type": "yarn"}),
    ("use_rmsnorm", False), ("num_nextn_predict_layers", 1), ("hidden_act", "gelu"),
    ("moe_shared_expert_intermediate_size", 64),
])
def test_unsupported_config_values_are_refused(tmp_path, key, value):
    folder = _bad_folder(tmp_path, **{key: value})
    with pytest.raises(ValueError, match=f"LLaDA2 config.json sets {key}={value!r}"):
        load_model(folder)


def test_absent_use_bias_means_true_and_is_refused():
    raw = tiny_llada2_config()
    del raw["use_bias"]
    with pytest.raises(ValueError, match="use_bias=True \\(true when absent\\)"):
        resolve(raw).parse_config(raw)


def test_one_expert_per_token_keeps_its_raw_score():
    """inclusionAI's gate normalises only when it picks more than one expert."""
    raw = tiny_llada2_config(num_experts_per_tok=1)
    assert not resolve(raw).parse_config(raw).moe.norm_topk_prob


def test_bad_router_numbers_name_the_key():
    raw = tiny_llada2_config(topk_group=5)
    with pytest.raises(ValueError, match=r"LLaDA2 config.json: MoEConfig.topk_group must be in"):
        resolve(raw).parse_config(raw)


# ------------------------------------------------------------------------ save / load / dtypes
def test_save_writes_the_real_layout_back(llada2_folder, tmp_path):
    model, cfg = load_model(llada2_folder)
    out = save_checkpoint(model, tmp_path / "saved", dtype=torch.float32, max_shard_bytes=60_000)
    original, saved = read_checkpoint(llada2_folder), read_checkpoint(out)
    assert set(saved) == set(original)
    for name, t in original.items():
        assert torch.equal(saved[name], t), name
    again, cfg2 = load_model(out)
    assert replace(cfg2, eos_token_ids=cfg.eos_token_ids, mask_token_id=None) == \
        replace(cfg, mask_token_id=None)
    assert read_json(out / "config.json")["model_type"] == "llada2_moe"
    ids = _ids(2, 36, seed=3)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    bf16 = save_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    with safe_open(str(bf16 / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.1.mlp.gate.expert_bias").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    half, _ = load_model(bf16, dtype="bfloat16")
    assert half.layers[1].mlp.gate.expert_bias.dtype == torch.float32
    assert half.layers[1].mlp.w_gate_up.dtype == torch.bfloat16
    with torch.no_grad():
        assert (half(ids).float() - model(ids)).abs().max() < 0.5      # runs, roughly agrees


def test_qkv_bias_and_fused_projections(tmp_path):
    """use_qkv_bias: the fused bias splits like the weight; fuse_projections keeps the logits."""
    folder = write_tiny_llada2_checkpoint(tmp_path / "bias", seed=5, use_qkv_bias=True,
                                          tokenizer=False)
    model, _ = load_model(folder)
    ids = _ids(1, 40, seed=6)
    with torch.no_grad():
        got = model(ids)
        assert (got - reference_logits(folder, ids, 32)).abs().max() <= TOL
        model.fuse_projections()
        assert (model(ids) - got).abs().max() <= 1e-5


# ------------------------------------------------------------------ LLM.logits, every family
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_logits_for_llada_and_dream(make_tiny_checkpoint, family):
    folder = make_tiny_checkpoint(family, seed=2)
    model, cfg = load_model(folder)
    ids = _ids(2, 12, seed=4)
    with torch.no_grad():
        full = model(ids)
        blocks = model(ids, pattern=block_causal(4))
    if cfg.logit_shift:                              # Dream: row i predicts position i
        full = torch.cat([full[:, :1], full[:, :-1]], 1)
        blocks = torch.cat([blocks[:, :1], blocks[:, :-1]], 1)
    with LLM(str(folder), dtype="float32") as llm:
        assert llm.engine is not None                # these families still get their engine
        assert torch.equal(llm.logits(ids.tolist()), full)
        assert torch.equal(llm.logits(ids[0]), full[0])
        got = llm.logits(ids, block_length=4)
        assert torch.equal(got, blocks) and (got - full).abs().max() > 1e-3
        one_block = llm.logits(ids, block_length=12)                 # one block: full
        assert (one_block - full).abs().max() <= 1e-5


@pytest.mark.parametrize("token_ids,kwargs,message", [
    ([[5, 6, 7], [5, 6]], {}, (r"the canvases of a batch must have one length, got 3 \(canvas "
                               r"0\) and 2 \(canvas 1\)")),
    ([5, TINY_VOCAB_SIZE, 7], {}, (rf"token id {TINY_VOCAB_SIZE} at position 1 of canvas 0 "
                                   rf"is outside the vocabulary \[0, {TINY_VOCAB_SIZE}\)")),
    ([5, -1], {}, r"token id -1 at position 1 of canvas 0"),
    ([5, 6.0], {}, r"token ids must be integers, got 6.0 at position 1 of canvas 0"),
    ("hello", {}, r"takes a list of token ids .*got str"),
    ([], {}, r"needs at least one canvas of at least one token"),
    ([5] * 257, {}, r"a canvas of 257 tokens exceeds the model's maximum length of 256"),
    ([5, 6], {"block_length": 0}, r"block_length must be an integer >= 1 or None, got 0"),
    ([5, 6], {"block_length": 2.5}, r"block_length must be an integer >= 1 or None, got 2.5"),
    (torch.ones(2, 2), {}, r"1-D or 2-D integer tensor of token ids, got a 2-D torch.float32"),
])
def test_logits_bad_input(llada2_llm, token_ids, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llada2_llm.logits(token_ids, **kwargs)
