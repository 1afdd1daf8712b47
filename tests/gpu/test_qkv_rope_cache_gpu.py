"""The fused QKV projection + RoPE + paged cache write kernel vs its reference at real shapes, bf16,
on CUDA.

Run on the GPU box: ``python -m pytest -m gpu tests/gpu/test_qkv_rope_cache_gpu.py -q`` (the repo's
pytest config deselects the ``gpu`` marker by default). Shapes: LLaDA-8B (d 4096, 32 heads = 32 kv
heads, head_dim 128, theta 5e5, fp32 RoPE, no bias) and Dream-7B (d 3584, 28 heads, 4 kv heads,
head_dim 128, theta 1e6, bf16 RoPE, q/k/v biases). Acceptance: relative error <= 1e-2 (the kernel
sums the GEMM in another order than cuBLAS, so a bf16 output may differ in its last bit before
RoPE); cache rows a call must not write stay bit-identical.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import paged_reference as paged
from flash_dllm.kernels import qkv_rope_cache, rope_cache

DEV = torch.device("cuda")
BF16 = torch.bfloat16
PAGE_SIZE = 16
LLADA = dict(d=4096, H=32, Hkv=32, D=128, theta=500000.0, fp32_rope=True, bias=False)
DREAM = dict(d=3584, H=28, Hkv=4, D=128, theta=1000000.0, fp32_rope=False, bias=True)
MODELS = {"llada": LLADA, "dream": DREAM}


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, seed, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), device=DEV) * scale).to(dtype)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _problem(model, T, seed=0):
    """x [T, d], the fused weight (N(0, 1/d) so q/k/v are ~N(0, 1)) and bias, positions, slots
    (distinct random free slots, one -1 when T > 1) and a one-layer page pool of random values."""
    cfg = MODELS[model]
    H, Hkv, D, d = cfg["H"], cfg["Hkv"], cfg["D"], cfg["d"]
    N = (H + 2 * Hkv) * D
    x = _randn(T, d, seed=seed)
    w = _randn(N, d, seed=seed + 1, scale=d ** -0.5)
    b = _randn(N, seed=seed + 2, scale=0.5) if cfg["bias"] else None
    positions = torch.randperm(4096, generator=_gen(seed + 3), device=DEV)[:T]
    P = paged.pages_needed(T, PAGE_SIZE) * 2 + 3
    slots = torch.randperm(P * PAGE_SIZE, generator=_gen(seed + 4), device=DEV)[:T]
    if T > 1:
        slots[T // 2] = -1                               # padding row: no K/V write
    inv = rope_cache.inv_freq(D, cfg["theta"], DEV)
    cache = _randn(1, 2, P, PAGE_SIZE, Hkv, D, seed=seed + 5)
    return x, w, b, positions, slots, inv, cache


def _args(model):
    cfg = MODELS[model]
    return cfg["H"], cfg["Hkv"], cfg["fp32_rope"]


@pytest.mark.parametrize("T", [1, 32, 64])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_qkv_rope_cache(T, model):
    H, Hkv, fp32_rope = _args(model)
    x, w, b, positions, slots, inv, cache = _problem(model, T)
    init, ref_cache = cache.clone(), cache.clone()
    kc, vc = paged.layer_kv(cache, 0)
    rk, rv = paged.layer_kv(ref_cache, 0)
    q = qkv_rope_cache.qkv_rope_cache_triton(x, w, b, positions, kc, vc, slots, inv, H, Hkv,
                                             fp32_rope)
    q_ref = qkv_rope_cache.qkv_rope_cache_reference(x, w, b, positions, rk, rv, slots, inv, H,
                                                    Hkv, fp32_rope)
    torch.cuda.synchronize()
    assert q.shape == q_ref.shape and q.dtype == BF16
    assert _rel(q, q_ref) <= 1e-2
    assert (q.float() - q_ref.float()).abs().max().item() < 0.25   # no single wrong element
    written = torch.zeros(kc.shape[0] * PAGE_SIZE, dtype=torch.bool, device=DEV)
    idx = slots[slots >= 0].long()
    written[idx] = True
    for name, got, ref, before in (("k", kc, rk, init[0, 0]), ("v", vc, rv, init[0, 1])):
        got, ref, before = got.flatten(0, 1), ref.flatten(0, 1), before.flatten(0, 1)
        assert _rel(got[idx], ref[idx]) <= 1e-2, f"{name} cache rows"
        assert (got[idx].float() - ref[idx].float()).abs().max().item() < 0.25, name
        assert torch.equal(got[~written], before[~written]), f"{name}: an unwritten slot changed"


@pytest.mark.parametrize("model", ["llada", "dream"])
def test_op_dispatch(model):
    """Triton (bit-identical to a direct launch) for T <= MAX_ROWS, the reference above."""
    H, Hkv, fp32_rope = _args(model)
    T = qkv_rope_cache.MAX_ROWS
    x, w, b, positions, slots, inv, cache = _problem(model, T, seed=10)
    cache2 = cache.clone()
    q = qkv_rope_cache.op(x, w, b, positions, *paged.layer_kv(cache, 0), slots, inv, H, Hkv,
                          fp32_rope)
    q2 = qkv_rope_cache.qkv_rope_cache_triton(x, w, b, positions, *paged.layer_kv(cache2, 0),
                                              slots, inv, H, Hkv, fp32_rope)
    assert torch.equal(q, q2) and torch.equal(cache, cache2)

    T = qkv_rope_cache.MAX_ROWS + 1
    x, w, b, positions, slots, inv, cache = _problem(model, T, seed=20)
    cache2 = cache.clone()
    q = qkv_rope_cache.op(x, w, b, positions, *paged.layer_kv(cache, 0), slots, inv, H, Hkv,
                          fp32_rope)
    q2 = qkv_rope_cache.qkv_rope_cache_reference(x, w, b, positions, *paged.layer_kv(cache2, 0),
                                                 slots, inv, H, Hkv, fp32_rope)
    assert torch.equal(q, q2) and torch.equal(cache, cache2)


def test_captures_in_cuda_graph():
    """No host syncs: the launch replays from a CUDA graph with fresh inputs."""
    H, Hkv, fp32_rope = _args("dream")
    x, w, b, positions, slots, inv, cache = _problem("dream", 32, seed=30)
    kc, vc = paged.layer_kv(cache, 0)

    def step():
        return qkv_rope_cache.op(x, w, b, positions, kc, vc, slots, inv, H, Hkv, fp32_rope)

    step()                                                             # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_graph = step()
    x.copy_(_randn(*x.shape, seed=31))
    positions.copy_(torch.randperm(4096, generator=_gen(32), device=DEV)[:x.shape[0]])
    graph.replay()
    torch.cuda.synchronize()
    k_graph, v_graph = kc.clone(), vc.clone()
    q_eager = step()
    assert torch.equal(q_graph, q_eager)
    assert torch.equal(kc, k_graph) and torch.equal(vc, v_graph)
