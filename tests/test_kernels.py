"""Triton kernels vs their PyTorch references (``TRITON_INTERPRET=1`` on the CPU, tiny shapes), and
the references vs dense, obviously-correct PyTorch.

NOTE: the interpreter must be chosen before ``triton`` is first imported (``triton.language``'s own
jit helpers are built at import), so this module sets ``TRITON_INTERPRET=1`` before importing
anything else. If some earlier test module already imported triton normally, the interpreted tests
here skip and ``test_interpreted_suite_in_fresh_process`` re-runs this file in a fresh interpreter.

Interpreter limits (Triton 3.9): ``tl.dot`` on bf16 is wrong (numpy matmul on raw uint16), so the
dot kernels run fp32 and fp16 here and bf16 only on the GPU; fp32->bf16 casts truncate instead of
rounding to nearest even, so bf16 outputs are compared to within 1 ulp.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

_TRITON_PREIMPORTED = "triton" in sys.modules
if not _TRITON_PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

import paged_reference as paged
from flash_dllm.kernels import OPS, paged_attention, rmsnorm, rope_cache
from flash_dllm.kernels._triton import HAS_TRITON

INTERPRETED = HAS_TRITON and all(m.INTERPRET for m in (rmsnorm, rope_cache, paged_attention))
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED,
    reason="triton is not installed" if not HAS_TRITON else
    "triton was imported before TRITON_INTERPRET=1 could be set; see "
    "test_interpreted_suite_in_fresh_process")


def _interpreter_loops_to_loaded_bounds() -> bool:
    """Older interpreters (seen: Triton 3.6) call ``int()`` on the 1-element array of a loaded
    scalar, which numpy >= 2.4 refuses; the compiled GPU path is unaffected."""
    if not INTERPRETED:
        return False
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(n_ptr, out_ptr):
        n = tl.load(n_ptr)
        for i in range(0, n, 1):
            tl.store(out_ptr, i)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        _probe[(1,)](torch.tensor([3], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001 - any failure means "cannot", reported as the skip reason
        return False
    return out.item() == 2


LOADED_BOUNDS = _interpreter_loops_to_loaded_bounds()
needs_loaded_bounds = pytest.mark.skipif(
    INTERPRETED and not LOADED_BOUNDS,
    reason="this triton's interpreter cannot loop to a loaded bound under numpy >= 2.4 "
           "(newer triton can; CI installs the latest)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    # fp32: accumulation-order noise; half precision: ~1 ulp of the output dtype (the interpreter
    # truncates fp32->bf16 where the GPU rounds to nearest)
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3),
           torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol[0], atol=tol[1], msg=what)


# ---- rmsnorm -----------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rmsnorm_triton_matches_reference(dtype, with_residual):
    T, d = 7, 40                                         # d not a power of two
    big = _rand(T, d + 8, dtype=dtype, seed=1)
    x = big[:, 3:3 + d]                                  # strided rows
    res = _rand(T, d, dtype=dtype, seed=2) if with_residual else None
    w = (1.0 + 0.1 * _rand(d, seed=3)).to(dtype)
    out, new_res = rmsnorm.rmsnorm_triton(x, w, 1e-5, res)
    ref_out, ref_res = rmsnorm.rmsnorm_reference(x, w, 1e-5, res)
    assert out.dtype == ref_out.dtype and out.shape == (T, d)
    _close(out, ref_out, dtype, "normed")
    _close(new_res, ref_res, dtype, "new residual")


@needs_interpreter
def test_rmsnorm_fp32_weight_promotes():
    x = _rand(3, 24, dtype=torch.bfloat16, seed=4)
    w = 1.0 + 0.1 * _rand(24, seed=5)
    out, _ = rmsnorm.rmsnorm_triton(x, w, 1e-6)
    ref, _ = rmsnorm.rmsnorm_reference(x, w, 1e-6)
    assert out.dtype == torch.float32
    _close(out, ref, torch.bfloat16, "normed")


def test_rmsnorm_reference_matches_layer():
    from flash_dllm.layers.norm import RMSNorm
    for dtype in (torch.float32, torch.bfloat16):
        layer = RMSNorm(32, 1e-5).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(1.0 + 0.1 * _rand(32, seed=6))
        x, r = _rand(5, 32, dtype=dtype, seed=7), _rand(5, 32, dtype=dtype, seed=8)
        out, new_res = rmsnorm.rmsnorm_reference(x, layer.weight, 1e-5, r)
        assert torch.equal(new_res, x + r)
        assert torch.equal(out, layer(x + r))


# ---- rope + cache write ------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("dtype,fp32_math", [(torch.float32, True), (torch.bfloat16, True),
                                             (torch.bfloat16, False)])
@pytest.mark.parametrize("head_dim", [16, 12])           # 12: half (6) is not a power of two
@pytest.mark.parametrize("qk_norm", [False, True])        # per-head q/k RMSNorm first (SDAR)
@pytest.mark.parametrize("T,H", [(11, 4), (3, 5)])      # q's heads over 2 / 4 programs a token
def test_rope_cache_triton_matches_reference(dtype, fp32_math, head_dim, qk_norm, T, H):
    assert rope_cache.q_programs(T, H) == (2 if H == 4 else 4)
    Hkv, D, S, P = 2, head_dim, 4, 9
    qkv = _rand(T, (H + 2 * Hkv) * D, dtype=dtype, seed=20)
    q, k, v = rope_cache.split_qkv(qkv, H, Hkv, D)       # strided views of one projection
    positions = torch.randperm(40, generator=_gen(21))[:T]
    slots = torch.randperm(P * S, generator=_gen(22))[:T]
    slots[T - 2] = -1                                    # padding row: no write
    inv = rope_cache.inv_freq(D, 10000.0)
    init = _rand(P, S, Hkv, D, dtype=dtype, seed=23)
    kc, vc = init.clone(), init.clone() + 1
    kr, vr = kc.clone(), vc.clone()
    norms = ((1 + 0.1 * _rand(D, seed=24)).to(dtype), (1 - 0.1 * _rand(D, seed=25)).to(dtype),
             1e-6) if qk_norm else None
    q_out = rope_cache.rope_cache_triton(q, k, v, positions, kc, vc, slots, inv, fp32_math,
                                         norms)
    q_ref = rope_cache.rope_cache_reference(q, k, v, positions, kr, vr, slots, inv, fp32_math,
                                            norms)
    if qk_norm and not fp32_math:
        # the interpreter truncates the normed values to bf16 (the GPU rounds): 1-ulp inputs,
        # which the activation-dtype rotation's cancellations grow to a few ulps of its output
        # (tests/gpu/test_kernels_gpu.py compares the GPU's rounding with the unfused kernels)
        for got, want in ((q_out, q_ref), (kc, kr)):
            torch.testing.assert_close(got.float(), want.float(), rtol=0.07, atol=0.07)
    else:
        _close(q_out, q_ref, dtype, "rotated q")
        _close(kc, kr, dtype, "k cache")
    assert torch.equal(vc, vr)                           # v is copied, never rounded


def test_rope_cache_reference_matches_rotary_layer():
    from flash_dllm.layers.rotary import Rotary
    T, H, Hkv, D, S = 6, 4, 2, 16, 4
    for dtype in (torch.float32, torch.bfloat16):
        for fp32_math in (True, False):
            rot = Rotary(D, 10000.0, apply_in_fp32=fp32_math)
            q, k, v = (_rand(T, n, D, dtype=dtype, seed=30 + n) for n in (H, Hkv, Hkv + 1))
            v = v[:, :Hkv]
            positions = torch.tensor([0, 3, 4, 17, 100, 1023])
            cache = paged.allocate_kv_cache(paged.PagedKVLayout(1, 4, S, Hkv, D, dtype), zero=True)
            kc, vc = paged.layer_kv(cache, 0)
            table = paged.block_table([[2, 0, 3]])
            slots = paged.slot_mapping(table, torch.zeros(T, dtype=torch.long),
                                       torch.arange(T), S)
            q_out = rope_cache.rope_cache_reference(q, k, v, positions, kc, vc, slots,
                                                    rot._freqs(torch.device("cpu")), fp32_math)
            assert torch.equal(q_out, rot(q, positions))
            k_dense, v_dense = paged.gather_kv(cache, 0, table[0], T)
            assert torch.equal(k_dense, rot(k, positions))
            assert torch.equal(v_dense, v)


def test_rope_cache_qk_norm_reference_is_norm_then_rotary():
    """The fused q/k norm is the layer's own: ``RMSNorm`` per head, then the rotation."""
    from flash_dllm.layers.norm import RMSNorm
    from flash_dllm.layers.rotary import Rotary
    T, H, Hkv, D, S = 5, 4, 2, 16, 4
    for dtype in (torch.float32, torch.bfloat16):
        qn, kn = RMSNorm(D, 1e-6).to(dtype), RMSNorm(D, 1e-6).to(dtype)
        with torch.no_grad():
            qn.weight.copy_(1 + 0.1 * _rand(D, seed=40))
            kn.weight.copy_(1 - 0.1 * _rand(D, seed=41))
        rot = Rotary(D, 10000.0, apply_in_fp32=True)
        q, k, v = (_rand(T, n, D, dtype=dtype, seed=42 + n) for n in (H, Hkv, Hkv))
        positions = torch.tensor([0, 3, 4, 17, 100])
        kc = torch.zeros(3, S, Hkv, D, dtype=dtype)
        vc = torch.zeros_like(kc)
        slots = torch.arange(T)
        with torch.no_grad():
            q_out = rope_cache.rope_cache_reference(
                q, k, v, positions, kc, vc, slots, rot._freqs(torch.device("cpu")), True,
                (qn.weight, kn.weight, 1e-6))
            assert torch.equal(q_out, rot(qn(q), positions))
            assert torch.equal(kc.view(-1, Hkv, D)[:T], rot(kn(k), positions))


@needs_interpreter
@pytest.mark.parametrize("dtype,fp32_math", [(torch.float32, True), (torch.bfloat16, True),
                                             (torch.bfloat16, False)])
@pytest.mark.parametrize("rotary_dim", [8, 4, 2])       # of 16: LLaDA2's half, a quarter, one pair
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_cache_partial_rotary_matches_reference(dtype, fp32_math, rotary_dim, qk_norm):
    """Partial rotary (LLaDA2: the first ``rotary_dim`` values of a head rotate, the rest pass):
    the kernel against the reference, which is the model's own ``Rotary(rotary_dim=)`` after the
    per-head norms (independently: the layers' modules)."""
    from flash_dllm.layers.norm import RMSNorm
    from flash_dllm.layers.rotary import Rotary
    T, H, Hkv, D, S, P = 7, 4, 2, 16, 4, 5
    qkv = _rand(T, (H + 2 * Hkv) * D, dtype=dtype, seed=50)
    q, k, v = rope_cache.split_qkv(qkv, H, Hkv, D)
    positions = torch.randperm(40, generator=_gen(51))[:T]
    slots = torch.randperm(P * S, generator=_gen(52))[:T]
    slots[2] = -1
    rot = Rotary(D, 10000.0, apply_in_fp32=fp32_math, rotary_dim=rotary_dim)
    inv = rot._freqs(torch.device("cpu"))
    qn, kn = RMSNorm(D, 1e-6).to(dtype), RMSNorm(D, 1e-6).to(dtype)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.1 * _rand(D, seed=53))
        kn.weight.copy_(1 - 0.1 * _rand(D, seed=54))
    norms = (qn.weight.detach(), kn.weight.detach(), 1e-6) if qk_norm else None
    init = _rand(P, S, Hkv, D, dtype=dtype, seed=55)
    kc, vc, kr, vr = init.clone(), init.clone() + 1, init.clone(), init.clone() + 1
    q_out = rope_cache.rope_cache_triton(q, k, v, positions, kc, vc, slots, inv, fp32_math,
                                         norms, rotary_dim)
    q_ref = rope_cache.rope_cache_reference(q, k, v, positions, kr, vr, slots, inv, fp32_math,
                                            norms, rotary_dim)
    with torch.no_grad():
        want = rot(qn(q) if qk_norm else q, positions)
    assert torch.equal(q_ref, want)
    assert torch.equal(q_ref[..., rotary_dim:], (qn(q) if qk_norm else q)[..., rotary_dim:])
    if qk_norm and not fp32_math:              # (the interpreter's bf16 truncation: see above)
        for got, ref in ((q_out, q_ref), (kc, kr)):
            torch.testing.assert_close(got.float(), ref.float(), rtol=0.07, atol=0.07)
    else:
        _close(q_out, q_ref, dtype, "rotated q (partial)")
        _close(kc, kr, dtype, "k cache (partial)")
    assert torch.equal(vc, vr)


def test_rope_cache_takes_whole_heads_or_up_to_half():
    assert rope_cache.takes_rotary(128, 128) and rope_cache.takes_rotary(64, 128)
    assert not rope_cache.takes_rotary(96, 128) and not rope_cache.takes_rotary(5, 128)
    q = torch.zeros(2, 2, 8)
    kc = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="rotary_dim must be head_dim \\(8\\) or even"):
        rope_cache.rope_cache_triton(q, q, q, torch.arange(2), kc, kc.clone(), torch.arange(2),
                                     rope_cache.inv_freq(6, 1e4), True, None, 6)


def test_rope_cache_rejects_a_bad_norm_weight():
    q = torch.zeros(2, 2, 8)
    kc = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="q norm weight must be a contiguous \\[8\\]"):
        rope_cache.rope_cache_triton(q, q, q, torch.arange(2), kc, kc.clone(), torch.arange(2),
                                     rope_cache.inv_freq(8, 1e4), True,
                                     (torch.ones(6), torch.ones(8), 1e-6))


# ---- paged attention ---------------------------------------------------------------------------
def _paged_problem(q_lens, k_lens, H, Hkv, D, S, dtype, seed):
    """Random packed queries and a shuffled page pool holding each request's K/V."""
    width = max(paged.pages_needed(L, S) for L in k_lens)
    total = sum(paged.pages_needed(L, S) for L in k_lens) + 3
    perm = torch.randperm(total, generator=_gen(seed)).tolist()
    rows, i = [], 0
    for L in k_lens:
        n = paged.pages_needed(L, S)
        rows.append(perm[i:i + n])
        i += n
    cache = _rand(1, 2, total, S, Hkv, D, dtype=dtype, seed=seed + 1)
    q = _rand(sum(q_lens), H, D, dtype=dtype, seed=seed + 2, scale=2.0)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return (q, cache, cu, torch.tensor(k_lens, dtype=torch.int32),
            paged.block_table(rows, width=width + 1))


@needs_interpreter
@needs_loaded_bounds
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,Hkv", [(4, 2), (2, 2)])
def test_paged_attention_triton_matches_reference(dtype, H, Hkv):
    q_lens, k_lens = [5, 0, 18, 2], [13, 7, 21, 0]      # ragged, not multiples of page or tile
    q, cache, cu, lens, table = _paged_problem(q_lens, k_lens, H, Hkv, 16, 4, dtype, seed=40)
    kc, vc = paged.layer_kv(cache, 0)
    out, mass = paged_attention.paged_attention_triton(
        q, kc, vc, cu, lens, table, max(q_lens), return_mass=True, block_m=16, block_n=16)
    ref, ref_mass = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table,
                                                              return_mass=True)
    _close(out, ref, dtype, "attention output")
    torch.testing.assert_close(mass, ref_mass, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(mass.sum(1), torch.tensor([n * H * (L > 0) for n, L in
                                                          zip(q_lens, k_lens)]).float(),
                               rtol=1e-4, atol=1e-3)
    out2 = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, max(q_lens),
                                                  block_m=16, block_n=16)
    assert torch.equal(out2, out)                        # tracking does not change the output


@needs_interpreter
@needs_loaded_bounds
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_paged_attention_split_kv_matches_reference(splits):
    """Split-KV (flash-decoding): chunks of keys merged by their log-sum-exp; requests with no
    keys, fewer keys than chunks and no queries are all in the batch."""
    q_lens, k_lens = [5, 0, 18, 2, 3], [13, 7, 21, 0, 70]
    q, cache, cu, lens, table = _paged_problem(q_lens, k_lens, 4, 2, 16, 4, torch.float32,
                                               seed=41)
    kc, vc = paged.layer_kv(cache, 0)
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)
    out = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, max(q_lens),
                                                 max_seqlen_k=max(k_lens), block_m=16,
                                                 block_n=16, num_splits=splits)
    _close(out, ref, torch.float32, "split-KV attention output")
    # asking for the mass never splits: same output as the unsplit kernel
    out_m, _ = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, max(q_lens),
                                                      return_mass=True, max_seqlen_k=max(k_lens),
                                                      block_m=16, block_n=16, num_splits=splits)
    _close(out_m, ref, torch.float32, "attention output with mass")


@needs_interpreter
@needs_loaded_bounds
@pytest.mark.parametrize("splits", [None, 3])
def test_paged_attention_packs_gqa_heads_for_few_queries(splits):
    """A block of <= 4 queries with 4 query heads per kv head: one program takes the 4 heads'
    rows together (``heads_per_program``), the same answer as one head per program and as the
    reference (bitwise on the GPU: tests/gpu/test_kernels_gpu.py)."""
    assert paged_attention.heads_per_program(4, 4, 16, False) == 4
    assert paged_attention.heads_per_program(4, 4, 16, True) == 1      # deterministic / mass
    assert paged_attention.heads_per_program(1, 4, 16, False) == 1      # no GQA (LLaDA)
    assert paged_attention.heads_per_program(8, 5, 16, False) == 2      # 5 queries -> 8 rows
    q_lens, k_lens = [4, 0, 3, 1], [13, 7, 70, 0]
    q, cache, cu, lens, table = _paged_problem(q_lens, k_lens, 8, 2, 16, 4, torch.float32,
                                               seed=43)
    kc, vc = paged.layer_kv(cache, 0)
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)
    kw = dict(max_seqlen_k=max(k_lens), block_m=16, block_n=16, num_splits=splits)
    out = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 4, **kw)
    one, _ = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 4,
                                                    return_mass=True, block_m=16, block_n=16)
    _close(out, ref, torch.float32, "packed-heads attention output")
    _close(out, one, torch.float32, "packed vs one head per program")


def test_split_plan():
    plan = paged_attention.split_plan
    assert plan(2048, 1024, 64) == (1, 0)                 # batch 64: enough programs
    assert plan(32, None, 64) == (1, 0)                   # no host bound on the keys
    n, chunk = plan(32, 1024, 64)                         # batch 1 of LLaDA-8B: 32 programs
    assert n * 32 >= 200 and chunk % 64 == 0 and n * chunk >= 1024 > (n - 1) * chunk
    assert plan(32, 64, 64) == (1, 0)                     # one tile of keys: nothing to split
    assert paged_attention.seqlen_bound(1) == 256 and paged_attention.seqlen_bound(1025) == 2048


def test_paged_attention_reference_matches_sdpa():
    q_lens, k_lens = [3, 6, 1], [9, 14, 4]
    H, Hkv, D = 6, 2, 8
    q, cache, cu, lens, table = _paged_problem(q_lens, k_lens, H, Hkv, D, 4, torch.float32, 50)
    kc, vc = paged.layer_kv(cache, 0)
    out, mass = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table,
                                                          return_mass=True)
    for b in range(len(q_lens)):
        k, v = paged.gather_kv(cache, 0, table[b], k_lens[b])           # [L, Hkv, D]
        qb = q[cu[b]:cu[b + 1]]
        o = F.scaled_dot_product_attention(qb.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], enable_gqa=True)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], o[0].transpose(0, 1))
        kk = k.repeat_interleave(H // Hkv, 1)
        p = torch.softmax(torch.einsum("qhd,khd->hqk", qb, kk) / math.sqrt(D), -1)
        torch.testing.assert_close(mass[b, :k_lens[b]], p.sum((0, 1)))
        assert (mass[b, k_lens[b]:] == 0).all()


# ---- paged layout helpers, dispatch, launcher checks -------------------------------------------
def test_paged_layout_helpers():
    llada = paged.PagedKVLayout(32, 10, 16, 32, 128, torch.bfloat16)
    assert llada.bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert paged.PagedKVLayout(28, 1, 16, 4, 128).bytes_per_token == 56 * 1024
    assert paged.PagedKVLayout.for_budget(llada.bytes_per_page * 7 + 5, 32, 32, 128).num_pages == 7
    with pytest.raises(ValueError):
        paged.PagedKVLayout(0, 1, 16, 4, 128)
    cu = torch.tensor([0, 3, 3, 5])
    req = paged.token_requests(cu, 5)
    assert req.tolist() == [0, 0, 0, 2, 2]
    table = paged.block_table([[4, 1], [], [0, 2, 3]])
    pos = torch.tensor([0, 2, 5, 7, 8])
    assert paged.slot_mapping(table, req, pos, 4).tolist() == [16, 18, 5, 11, 12]


def test_ops_dispatch_to_reference_on_cpu():
    x, r, w = _rand(3, 8, seed=60), _rand(3, 8, seed=61), _rand(8, seed=62)
    out, res = OPS["rmsnorm"](x[None], w, 1e-5, r[None])                 # [1, 3, 8] works too
    ref = rmsnorm.rmsnorm_reference(x, w, 1e-5, r)
    assert torch.equal(out[0], ref[0]) and torch.equal(res[0], ref[1])


@needs_interpreter
@needs_loaded_bounds
def test_ops_route_to_triton_when_allowed(monkeypatch):
    """The op() glue (reshapes, argument order) on the Triton branch, forced on CPU tensors."""
    for mod in (rmsnorm, rope_cache, paged_attention):
        monkeypatch.setattr(mod, "use_triton", lambda *t: True)
    x, r, w = _rand(2, 3, 24, seed=80), _rand(2, 3, 24, seed=81), _rand(24, seed=82)
    out, res = OPS["rmsnorm"](x, w, 1e-5, r)                             # [2, 3, 24]
    ref = rmsnorm.rmsnorm_reference(x, w, 1e-5, r)
    assert out.shape == x.shape
    _close(out, ref[0], torch.float32, "normed")
    _close(res, ref[1], torch.float32, "residual")
    q, cache, cu, lens, table = _paged_problem([3, 2], [6, 9], 2, 1, 16, 4, torch.float32, 84)
    kc, vc = paged.layer_kv(cache, 0)
    _close(OPS["paged_attention"](q, kc, vc, cu, lens, table, 3),
           paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table),
           torch.float32, "attention")
    qq, kk, vv = _rand(2, 2, 16, seed=85), _rand(2, 1, 16, seed=86), _rand(2, 1, 16, seed=87)
    kr, vr = kc.clone(), vc.clone()
    inv = rope_cache.inv_freq(16, 10000.0)
    slots = torch.tensor([5, 0])
    got = OPS["rope_cache"](qq, kk, vv, torch.tensor([3, 9]), kc, vc, slots, inv)
    ref_q = rope_cache.rope_cache_reference(qq, kk, vv, torch.tensor([3, 9]), kr, vr, slots, inv)
    _close(got, ref_q, torch.float32, "rotated q")
    _close(kc, kr, torch.float32, "k cache")


@needs_interpreter
def test_launchers_reject_bad_layouts():
    q, cache, cu, lens, table = _paged_problem([2], [5], 2, 2, 16, 4, torch.float32, seed=70)
    kc, vc = paged.layer_kv(cache, 0)
    with pytest.raises(ValueError, match="int32"):
        paged_attention.paged_attention_triton(q, kc, vc, cu.long(), lens, table, 2)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        paged_attention.paged_attention_triton(q[:, :1].expand(2, 3, 16), kc, vc, cu, lens,
                                               table, 2)
    with pytest.raises(ValueError, match="contiguous"):
        rmsnorm.rmsnorm_triton(_rand(8, 4).t(), _rand(8), 1e-5)
    with pytest.raises(ValueError, match="inv_freq"):
        qq, kk, vv = (_rand(2, n, 16) for n in (2, 2, 2))
        rope_cache.rope_cache_triton(qq, kk, vv, torch.arange(2), kc, vc, torch.arange(2),
                                     torch.ones(4))


@pytest.mark.skipif(not HAS_TRITON or INTERPRETED, reason="only when this process could not "
                    "interpret (triton imported before TRITON_INTERPRET=1 was set)")
def test_interpreted_suite_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           __file__], check=False, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
