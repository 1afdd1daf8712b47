"""The fused QKV projection + RoPE + paged cache write kernel against its reference, under the
interpreter (tiny shapes; tests/conftest.py sets TRITON_INTERPRET=1 on machines without a GPU).

Interpreter limits (Triton 3.9): fp32->bf16 casts truncate instead of rounding to nearest even and
the GEMM sums in another order than torch, so a bf16 projection may differ in its last bit before
RoPE: bf16 is compared loosely, fp32 tightly.
"""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import qkv_rope_cache, rope_cache
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and qkv_rope_cache.INTERPRET),
    reason="triton is not installed" if not HAS_TRITON else
    "needs triton under TRITON_INTERPRET=1 (set before triton is first imported)")

PAGES, PAGE_SIZE = 10, 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _problem(T, hidden, H, Hkv, D, dtype, bias, strided, seed=0):
    """Random x (optionally with row stride > hidden), weight, bias, positions, slots (some -1)
    and caches full of random values."""
    N = (H + 2 * Hkv) * D
    x = _rand(T, hidden + 24, seed=seed, dtype=dtype)[:, 5:5 + hidden] if strided else \
        _rand(T, hidden, seed=seed, dtype=dtype)
    w = _rand(N, hidden, seed=seed + 1, dtype=dtype, scale=hidden ** -0.5)
    b = _rand(N, seed=seed + 2, dtype=dtype, scale=0.1) if bias else None
    positions = torch.randint(0, 300, (T,), generator=_gen(seed + 3))
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=_gen(seed + 4))[:T].to(torch.int32)
    slots[::3] = -1                                      # padding rows: no K/V write
    inv = rope_cache.inv_freq(D, 10000.0)
    kc = _rand(PAGES, PAGE_SIZE, Hkv, D, seed=seed + 5, dtype=dtype)
    vc = _rand(PAGES, PAGE_SIZE, Hkv, D, seed=seed + 6, dtype=dtype)
    return x, w, b, positions, slots, inv, kc, vc


def _written(slots: torch.Tensor) -> torch.Tensor:
    """[PAGES, PAGE_SIZE] bool: the cache rows a call writes."""
    mask = torch.zeros(PAGES * PAGE_SIZE, dtype=torch.bool)
    mask[slots[slots >= 0].long()] = True
    return mask.view(PAGES, PAGE_SIZE)


# (T, hidden, H, Hkv, D, bias, strided x, config): MHA and GQA, one row, a partial row tile, a
# K loop of several BLOCK_K steps with a ragged last one, one and several column chunks per half
CASES = [
    (1, 64, 2, 2, 16, False, False, dict(BLOCK_M=16, BLOCK_C=8, BLOCK_K=32)),
    (5, 96, 4, 2, 32, True, True, dict(BLOCK_M=16, BLOCK_C=8, BLOCK_K=32)),
    (17, 80, 4, 2, 16, True, False, dict(BLOCK_M=16, BLOCK_C=4, BLOCK_K=32)),
    (17, 72, 2, 2, 32, False, True, dict(BLOCK_M=16, BLOCK_C=16, BLOCK_K=32)),
]


@needs_interpreter
@pytest.mark.parametrize("dtype,fp32_math", [(torch.float32, True), (torch.float32, False),
                                             (torch.bfloat16, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[2]}-Hkv{c[3]}-D{c[4]}"
                                                      f"{'-bias' if c[5] else ''}"
                                                      f"{'-strided' if c[6] else ''}")
def test_matches_reference(case, dtype, fp32_math):
    T, hidden, H, Hkv, D, bias, strided, config = case
    x, w, b, positions, slots, inv, kc, vc = _problem(T, hidden, H, Hkv, D, dtype, bias, strided)
    kc0, vc0 = kc.clone(), vc.clone()
    kr, vr = kc.clone(), vc.clone()
    q = qkv_rope_cache.qkv_rope_cache_triton(x, w, b, positions, kc, vc, slots, inv, H, Hkv,
                                             fp32_math, config=config)
    q_ref = qkv_rope_cache.qkv_rope_cache_reference(x, w, b, positions, kr, vr, slots, inv, H,
                                                    Hkv, fp32_math)
    assert q.shape == (T, H, D) and q.dtype == dtype and q.is_contiguous()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for what, got, ref in (("rotated q", q, q_ref), ("k cache", kc, kr), ("v cache", vc, vr)):
        torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, msg=what)
    keep = ~_written(slots)
    assert torch.equal(kc[keep], kc0[keep]) and torch.equal(vc[keep], vc0[keep])


@needs_interpreter
def test_default_config_and_int64_indices():
    # default tiles (BLOCK_C = D/2 here) and int64 positions/slots, as the engine may pass
    T, hidden, H, Hkv, D = 3, 48, 2, 1, 16
    x, w, b, positions, slots, inv, kc, vc = _problem(T, hidden, H, Hkv, D, torch.float32, True,
                                                      False, seed=10)
    slots = slots.long()
    kr, vr = kc.clone(), vc.clone()
    q = qkv_rope_cache.qkv_rope_cache_triton(x, w, b, positions, kc, vc, slots, inv, H, Hkv)
    q_ref = qkv_rope_cache.qkv_rope_cache_reference(x, w, b, positions, kr, vr, slots, inv, H,
                                                    Hkv)
    for got, ref in ((q, q_ref), (kc, kr), (vc, vr)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_default_config():
    llada = qkv_rope_cache.default_config(32, 96 * 128, 4096, 128)
    assert (llada["BLOCK_M"], llada["BLOCK_C"], llada["BLOCK_K"]) == (32, 16, 256)
    dream = qkv_rope_cache.default_config(1, 36 * 128, 3584, 128)
    assert (dream["BLOCK_M"], dream["BLOCK_C"]) == (16, 16)
    assert qkv_rope_cache.default_config(200, 36 * 128, 3584, 128)["BLOCK_M"] == 64
    # few programs wanted: BLOCK_C stays at the largest power of two (<= 64) dividing D/2
    assert qkv_rope_cache.default_config(4, 3 * 128, 64, 128, num_sms=1)["BLOCK_C"] == 64
    assert qkv_rope_cache.default_config(4, 8 * 24, 64, 24)["BLOCK_C"] == 4


@needs_interpreter
def test_empty_batch():
    x, w, b, positions, slots, inv, kc, vc = _problem(0, 32, 2, 2, 16, torch.float32, False, False)
    kc0 = kc.clone()
    q = qkv_rope_cache.qkv_rope_cache_triton(x, w, b, positions, kc, vc, slots, inv, 2, 2)
    assert q.shape == (0, 2, 16) and torch.equal(kc, kc0)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_refuses_bad_layouts():
    T, hidden, H, Hkv, D = 3, 32, 2, 2, 16
    x, w, b, positions, slots, inv, kc, vc = _problem(T, hidden, H, Hkv, D, torch.float32, True,
                                                      False)
    run = qkv_rope_cache.qkv_rope_cache_triton

    with pytest.raises(ValueError, match="weight must have .* rows"):
        run(x, w[:-D], b, positions, kc, vc, slots, inv, H, Hkv)
    with pytest.raises(ValueError, match="hidden size"):
        run(x[:, :-1], w, b, positions, kc, vc, slots, inv, H, Hkv)
    with pytest.raises(ValueError, match="must be even"):
        odd = torch.zeros(PAGES, PAGE_SIZE, Hkv, 15)
        run(x, torch.zeros((H + 2 * Hkv) * 15, hidden), None, positions, odd, odd.clone(), slots,
            torch.zeros(7), H, Hkv)
    with pytest.raises(ValueError, match="BLOCK_C=16 must divide"):
        run(x, w, b, positions, kc, vc, slots, inv, H, Hkv, config=dict(BLOCK_C=16))
    with pytest.raises(ValueError, match="caches"):
        run(x, w, b, positions, kc, vc[:, :, :1], slots, inv, H, Hkv)
    with pytest.raises(ValueError, match="inv_freq"):
        run(x, w, b, positions, kc, vc, slots, inv.double(), H, Hkv)
    with pytest.raises(ValueError, match="bias"):
        run(x, w, b[:-1], positions, kc, vc, slots, inv, H, Hkv)
    with pytest.raises(ValueError, match="dtype"):
        run(x, w.double(), b, positions, kc, vc, slots, inv, H, Hkv)
    with pytest.raises(ValueError, match="slot_mapping"):
        run(x, w, b, positions, kc, vc, slots[:-1], inv, H, Hkv)


def test_op_uses_reference_on_cpu():
    T, hidden, H, Hkv, D = 6, 32, 4, 2, 16
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b, positions, slots, inv, kc, vc = _problem(T, hidden, H, Hkv, D, dtype, True, True,
                                                          seed=20)
        kr, vr = kc.clone(), vc.clone()
        q = qkv_rope_cache.op(x, w, b, positions, kc, vc, slots, inv, H, Hkv, False)
        q_ref = qkv_rope_cache.qkv_rope_cache_reference(x, w, b, positions, kr, vr, slots, inv,
                                                        H, Hkv, False)
        assert torch.equal(q, q_ref) and torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.skipif(not (HAS_TRITON and qkv_rope_cache.INTERPRET),
                    reason="needs triton under TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_engine_with_fused_projection_matches_unfused(monkeypatch, family):
    """The paged engine with every layer's q/k/v projection + RoPE + page write in the fused
    kernel (interpreted on the CPU, float32) gives the tokens of the unfused path."""
    from flash_dllm.config import EngineConfig, SamplingParams
    from flash_dllm.layers.attention_backend import PagedAttentionMetadata as PagedContext
    from test_sampler import PROMPTS, run_engine, tiny

    model = tiny(family, seed=3)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                            threshold=0.3)
    cfg = EngineConfig(fuse_projections=True)
    ref, oref = run_engine(model, PROMPTS[:2], params, config=cfg)
    calls = []
    real = PagedContext.attend_projected

    def spy(self, *args):
        calls.append(1)
        return real(self, *args)
    monkeypatch.setattr(qkv_rope_cache, "takes_triton", lambda x, w, kc: x.shape[0] <= 64)
    monkeypatch.setattr(PagedContext, "attend_projected", spy)
    got, ogot = run_engine(model, PROMPTS[:2], params, config=cfg)
    assert calls                                         # the fused kernel did run
    for a, b in zip(oref, ogot):
        assert a.token_ids == b.token_ids
