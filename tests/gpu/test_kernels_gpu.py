"""Triton kernels vs their PyTorch references at real shapes, bf16, on CUDA.

Run on the GPU box: ``python -m pytest -m gpu tests/gpu -q`` (the repo's pytest config deselects
the ``gpu`` marker by default). Shapes: LLaDA-8B (d 4096, 32 heads = 32 kv heads, head_dim 128,
vocab 126,464, MASK 126,336) and Dream-7B (d 3584, 28 heads, 4 kv heads, head_dim 128, vocab
152,064). Acceptance: relative error <= 1e-2 (bf16), exact where the math allows it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import paged_reference as paged
from flash_dllm.kernels import OPS, paged_attention, rmsnorm, rope_cache
from flash_dllm.kernels._triton import use_triton

DEV = torch.device("cuda")
BF16 = torch.bfloat16
LLADA = dict(d=4096, H=32, Hkv=32, D=128, V=126464, mask=126336, theta=500000.0, fp32_rope=True)
DREAM = dict(d=3584, H=28, Hkv=4, D=128, V=152064, mask=151666, theta=1000000.0, fp32_rope=False)
MODELS = {"llada": LLADA, "dream": DREAM}


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, seed, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), device=DEV) * scale).to(dtype)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_dispatch_picks_triton_on_cuda():
    x = _randn(4, 64, seed=0)
    assert use_triton(x)


# ---- rmsnorm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 37, 4096])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_rmsnorm(T, model):
    d = MODELS[model]["d"]
    x, r = _randn(T, d, seed=1), _randn(T, d, seed=2)
    w = (1 + 0.1 * torch.randn(d, generator=_gen(3), device=DEV)).to(BF16)
    out, res = OPS["rmsnorm"](x, w, 1e-5, r)
    ref, ref_res = rmsnorm.rmsnorm_reference(x, w, 1e-5, r)
    assert torch.equal(res, ref_res)                    # same fp32 add, same RNE rounding
    assert _rel(out, ref) < 1e-2
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2)   # <= 1 bf16 ulp apart
    out3, res3 = OPS["rmsnorm"](x.view(1, T, d), w, 1e-5, r.view(1, T, d))  # [1, T, d] works
    assert torch.equal(out3[0], out) and torch.equal(res3[0], res)
    out2, _ = OPS["rmsnorm"](x, w, 1e-5)
    torch.testing.assert_close(out2, rmsnorm.rmsnorm_reference(x, w, 1e-5)[0], rtol=1.6e-2,
                               atol=1.6e-2)


# ---- rope + cache write ------------------------------------------------------------------------
@pytest.mark.parametrize("T", [4, 37, 2048])           # q's heads over 16 / 2 / 1 programs
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_rope_cache(T, model):
    cfg = MODELS[model]
    H, Hkv, D, S = cfg["H"], cfg["Hkv"], cfg["D"], 16
    P = paged.pages_needed(T, S) * 2 + 3
    qkv = _randn(T, (H + 2 * Hkv) * D, seed=20)
    q, k, v = rope_cache.split_qkv(qkv, H, Hkv, D)
    positions = torch.randperm(4096, generator=_gen(21), device=DEV)[:T]
    slots = torch.randperm(P * S, generator=_gen(22), device=DEV)[:T]
    slots[T // 2] = -1
    inv = rope_cache.inv_freq(D, cfg["theta"], DEV)
    cache = _randn(1, 2, P, S, Hkv, D, seed=23)
    ref_cache = cache.clone()
    kc, vc = paged.layer_kv(cache, 0)
    q_out = OPS["rope_cache"](q, k, v, positions, kc, vc, slots, inv, cfg["fp32_rope"])
    rk, rv = paged.layer_kv(ref_cache, 0)
    q_ref = rope_cache.rope_cache_reference(q, k, v, positions, rk, rv, slots, inv,
                                            cfg["fp32_rope"])
    assert _rel(q_out, q_ref) < 1e-2 and _rel(kc, rk) < 1e-2
    torch.testing.assert_close(q_out, q_ref, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(kc, rk, rtol=1.6e-2, atol=1.6e-2)
    assert torch.equal(vc, rv)


@pytest.mark.parametrize("T", [4, 300])
@pytest.mark.parametrize("fp32_rope", [False, True])
def test_rope_cache_qk_norm_equals_norm_then_rope(fp32_rope, T):
    """q/k normed per head inside the RoPE + page write kernel (SDAR, LLaDA-MoE) against the
    unfused kernels (``rmsnorm`` per head, then ``rope_cache``) on SDAR-4B's heads: equal but
    for the mean square's summation order (two halves vs one row; rarely one bf16 ulp)."""
    H, Hkv, D, S = 32, 8, 128, 16
    P = paged.pages_needed(T, S) + 2
    q, k, v = rope_cache.split_qkv(_randn(T, (H + 2 * Hkv) * D, seed=50), H, Hkv, D)
    wq, wk = (1 + 0.1 * _randn(D, seed=51)), (1 - 0.1 * _randn(D, seed=52))
    positions = torch.randperm(4096, generator=_gen(53), device=DEV)[:T]
    slots = torch.randperm(P * S, generator=_gen(54), device=DEV)[:T]
    inv = rope_cache.inv_freq(D, 1e6, DEV)
    kc, vc = _randn(P, S, Hkv, D, seed=55), _randn(P, S, Hkv, D, seed=56)
    kc2, vc2 = kc.clone(), vc.clone()
    fused = OPS["rope_cache"](q, k, v, positions, kc, vc, slots, inv, fp32_rope, (wq, wk, 1e-6))
    qn, kn = OPS["rmsnorm"](q, wq, 1e-6)[0], OPS["rmsnorm"](k, wk, 1e-6)[0]
    plain = OPS["rope_cache"](qn, kn, v, positions, kc2, vc2, slots, inv, fp32_rope)
    for got, want in ((fused, plain), (kc, kc2)):
        torch.testing.assert_close(got, want, rtol=3.2e-2, atol=3.2e-2)
        assert (got != want).float().mean().item() < 0.01
    assert torch.equal(vc, vc2)


@pytest.mark.parametrize("T", [4, 32, 300])
@pytest.mark.parametrize("fp32_rope", [False, True])
def test_rope_cache_partial_rotary_equals_the_module(fp32_rope, T):
    """LLaDA2-mini's heads (16 on 4 kv heads, D 128, the first 64 values rotating, q/k normed):
    the RoPE + page write kernel with ``rotary_dim`` against the model's own path (``rmsnorm``
    per head, then ``Rotary(rotary_dim=64)`` in PyTorch, then the page write): in fp32 math
    equal but for the mean square's summation order (rarely one bf16 ulp); in the activation
    dtype's math (LLaDA2's) each product rounded alone as torch's kernels round it (the launch's
    ``EXACT_ROUNDING``: contracted into FMAs, ~20 % of values were one ulp off)."""
    from flash_dllm.layers.rotary import Rotary
    H, Hkv, D, S, R = 16, 4, 128, 16, 64
    P = paged.pages_needed(T, S) + 2
    q, k, v = rope_cache.split_qkv(_randn(T, (H + 2 * Hkv) * D, seed=60), H, Hkv, D)
    wq, wk = (1 + 0.1 * _randn(D, seed=61)), (1 - 0.1 * _randn(D, seed=62))
    positions = torch.randperm(4096, generator=_gen(63), device=DEV)[:T]
    slots = torch.randperm(P * S, generator=_gen(64), device=DEV)[:T]
    rot = Rotary(D, 600000.0, fp32_rope, rotary_dim=R)
    kc, vc = _randn(P, S, Hkv, D, seed=65), _randn(P, S, Hkv, D, seed=66)
    kc2, vc2 = kc.clone(), vc.clone()
    fused = OPS["rope_cache"](q, k, v, positions, kc, vc, slots, rot._freqs(DEV), fp32_rope,
                              (wq, wk, 1e-6), R)
    qn, kn = OPS["rmsnorm"](q, wq, 1e-6)[0], OPS["rmsnorm"](k, wk, 1e-6)[0]
    plain = rot(qn, positions)
    kc2.view(-1, Hkv, D)[slots.long()] = rot(kn, positions)
    vc2.view(-1, Hkv, D)[slots.long()] = v
    for got, want in ((fused, plain), (kc, kc2)):
        differ = (got != want).float().mean().item()
        print(f"\nfp32_rope={fp32_rope} T={T}: rel {_rel(got, want):.2e}, max "
              f"{(got.float() - want.float()).abs().max().item():.3e}, differing {differ:.4f}")
        assert _rel(got, want) < 1e-2
        torch.testing.assert_close(got, want, rtol=3.2e-2, atol=3.2e-2)
        assert differ < 0.01        # (bf16 math: each product rounded, no FMA: EXACT_ROUNDING)
    assert (fused[..., R:] != qn[..., R:]).float().mean().item() < 0.01   # passed through
    assert torch.equal(vc, vc2)


# ---- paged attention ---------------------------------------------------------------------------
def _problem(model, q_lens, k_lens, S=16, seed=30):
    cfg = MODELS[model]
    H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
    need = [paged.pages_needed(L, S) for L in k_lens]
    total = sum(need) + 5
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    rows, i = [], 0
    for n in need:
        rows.append(perm[i:i + n])
        i += n
    cache = _randn(1, 2, total, S, Hkv, D, seed=seed + 1)
    q = _randn(sum(q_lens), H, D, seed=seed + 2)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    return q, cache, cu, lens, paged.block_table(rows, DEV)


@pytest.mark.parametrize("split", [False, True])
def test_paged_attention_packed_gqa_heads_equal_one_head_per_program(split):
    """SDAR-4B's batch-1 block step (4 queries, 32 heads on 8 kv heads): the program that packs
    a kv head's 4 query heads answers bitwise as one head per program (mass tracking keeps one
    head per program) and as the reference."""
    H, Hkv, D, S = 32, 8, 128, 16
    q_lens, k_lens = [4, 3], [1024, 517]
    need = [paged.pages_needed(L, S) for L in k_lens]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(60)).tolist()
    table = paged.block_table([perm[:need[0]], perm[need[0]:sum(need)]], DEV)
    cache = _randn(1, 2, sum(need) + 3, S, Hkv, D, seed=61)
    kc, vc = paged.layer_kv(cache, 0)
    q = _randn(sum(q_lens), H, D, seed=62)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32, device=DEV)
    lens = torch.tensor(k_lens, dtype=torch.int32, device=DEV)
    assert paged_attention.heads_per_program(H // Hkv, 4, 16, False) == 4
    kw = dict(max_seqlen_k=1024, num_splits=None if split else 1)
    out = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 4, **kw)
    one, _ = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 4,
                                                    return_mass=True)
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    if not split:
        assert torch.equal(out, one)


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("case", ["block", "ragged", "canvas"])
def test_paged_attention(model, case):
    q_lens, k_lens = {
        "block": ([32] * 8, [1024] * 8),                            # dual-cache step, batch 8
        "ragged": ([32, 1, 77, 5, 32], [1024, 545, 77, 1000, 33]),  # not multiples of 16/64
        "canvas": ([1024], [1024]),                                  # a block's first step
    }[case]
    q, cache, cu, lens, table = _problem(model, q_lens, k_lens)
    kc, vc = paged.layer_kv(cache, 0)
    out, mass = OPS["paged_attention"](q, kc, vc, cu, lens, table, max(q_lens), return_mass=True)
    ref, ref_mass = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table,
                                                              return_mass=True)
    assert _rel(out, ref) < 1e-2
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert _rel(mass, ref_mass) < 1e-2
    H = q.shape[1]
    torch.testing.assert_close(mass.sum(1), torch.tensor(q_lens, device=DEV).float() * H,
                               rtol=1e-3, atol=1e-2)
    # and against torch's own SDPA on the gathered dense K/V of each request
    for b in range(len(q_lens)):
        k, v = paged.gather_kv(cache, 0, table[b], k_lens[b])
        qb = q[cu[b]:cu[b + 1]]
        o = F.scaled_dot_product_attention(qb.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], enable_gqa=True)
        assert _rel(out[cu[b]:cu[b + 1]], o[0].transpose(0, 1)) < 1e-2


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("case", ["b1", "ragged"])
def test_paged_attention_split_kv(model, case):
    """Small batches split each request's keys (split_plan) and merge the chunks."""
    q_lens, k_lens = {"b1": ([32], [1024]), "ragged": ([32, 1, 7], [1024, 545, 0])}[case]
    q, cache, cu, lens, table = _problem(model, q_lens, k_lens)
    kc, vc = paged.layer_kv(cache, 0)
    bound = paged_attention.seqlen_bound(max(k_lens))
    n, _ = paged_attention.split_plan(q.shape[1] * len(q_lens), bound, 64)
    assert n > 1                                              # the case does split
    out = OPS["paged_attention"](q, kc, vc, cu, lens, table, max(q_lens), max_seqlen_k=bound)
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)
    assert _rel(out, ref) < 1e-2
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    whole = OPS["paged_attention"](q, kc, vc, cu, lens, table, max(q_lens))   # unsplit
    assert _rel(out, whole) < 1e-2     # fp32 partials merged, then rounded: not bitwise


def test_kernels_capture_in_cuda_graph():
    """No host syncs: the step's kernels replay from a CUDA graph with fresh inputs."""
    cfg = LLADA
    H, Hkv, D, S = cfg["H"], cfg["Hkv"], cfg["D"], 16
    q_lens, k_lens = [32, 32], [512, 300]
    q, cache, cu, lens, table = _problem("llada", q_lens, k_lens)
    kc, vc = paged.layer_kv(cache, 0)
    T = q.shape[0]
    qkv = _randn(T, (H + 2 * Hkv) * D, seed=40)
    positions = torch.cat([torch.arange(480, 512), torch.arange(268, 300)]).to(DEV)
    req = paged.token_requests(cu, T)
    slots = paged.slot_mapping(table, req, positions, S)
    inv = rope_cache.inv_freq(D, cfg["theta"], DEV)
    h = _randn(T, cfg["d"], seed=41)
    w = _randn(4096, cfg["d"], seed=42, scale=0.05)

    def step():
        qq, kk, vv = rope_cache.split_qkv(qkv, H, Hkv, D)
        q_rot = OPS["rope_cache"](qq, kk, vv, positions, kc, vc, slots, inv, True)
        out, mass = OPS["paged_attention"](q_rot, kc, vc, cu, lens, table, 32, return_mass=True)
        return (out, mass) + tuple(OPS["argmax_confidence"](F.linear(h, w), 7))

    step()                                                             # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    qkv.copy_(_randn(T, (H + 2 * Hkv) * D, seed=43))
    h.copy_(_randn(T, cfg["d"], seed=44))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(outs, eager):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)


# ---- argmax_confidence / silu_mul ---------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 4, 32, 2048])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_argmax_confidence(N, model):
    from flash_dllm.kernels import argmax_confidence as ac
    cfg = MODELS[model]
    logits = _randn(N, cfg["V"], seed=50 + N, scale=4.0)
    logits[0, cfg["mask"]] = 100.0                 # MASK is the max: never proposed
    if N > 1:
        logits[1, 7] = logits[1, 9] = 90.0         # an exact bf16 tie: the lower id wins
    tok, conf = ac.argmax_confidence_triton(logits, cfg["mask"])
    rtok, rconf = ac.argmax_confidence_reference(logits, cfg["mask"])
    assert torch.equal(tok, rtok)
    if N > 1:
        assert tok[1].item() == 7
    torch.testing.assert_close(conf, rconf, rtol=1e-4, atol=1e-6)
    t1, c1 = ac.argmax_confidence_triton(logits[N - 1:], cfg["mask"])   # a row alone: same bits
    assert torch.equal(t1, tok[N - 1:]) and torch.equal(c1, conf[N - 1:])


@pytest.mark.parametrize("T", [1, 32, 2048])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_silu_mul(T, model):
    from flash_dllm.kernels import silu_mul
    inter = {"llada": 12288, "dream": 18944}[model]
    x = _randn(T, 2 * inter, seed=70, scale=3.0)
    got = OPS["silu_mul"](x)
    ref = silu_mul.silu_mul_reference(x)
    assert got.shape == (T, inter)
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1.6e-2)   # <= 2 bf16 ulp apart
    assert (got != ref).float().mean().item() < 0.01                 # nearly all bit-equal
