"""The RoPE + quantising page write of fp8 pools (``kernels/rope_cache_fp8``) against its
reference (``rope_cache``'s rotation, then ``kv_quant.write_reference``), under
``TRITON_INTERPRET=1``: several steps into pages that start as garbage bytes, rows sharing pages,
scales that grow and requantise, padding rows. Bit for bit where the rotation is exact (position 0,
and V everywhere); elsewhere the kernel's and torch's cos / sin may differ by an ulp, so rotated
values may round the other way: within one e4m3 step."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import kv_quant, rope_cache, rope_cache_fp8
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and rope_cache_fp8.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")
P, PS, H, HKV, D = 6, 4, 4, 2, 16


def _steps(dtype, zero_pos: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i in range(4):                  # growing K scales, shrinking V ones: both requantise
        T = 7
        q = torch.randn(T, H, D, generator=g) * (i + 1)
        k = torch.randn(T, HKV, D, generator=g) * (i + 1)
        v = torch.randn(T, HKV, D, generator=g) * (3.5 - i)
        pos = (torch.zeros(T, dtype=torch.long) if zero_pos
               else torch.randint(0, 500, (T,), generator=g))
        slots = torch.randperm((P - 1) * PS, generator=g)[:T]      # the last page: never
        slots[2] = -1                                          # a padding row: no write
        steps.append((q.to(dtype), k.to(dtype), v.to(dtype), pos, slots))
    return steps


def _run(fn, steps, fp32_math):
    raw = torch.randint(0, 256, (2, P, PS, HKV, D), generator=torch.Generator().manual_seed(9),
                        dtype=torch.uint8)                    # garbage bytes, NaN codes too
    kc, vc = raw.view(kv_quant.FP8).unbind(0)
    ks, vs = torch.zeros(P, HKV), torch.zeros(P, HKV)
    inv = rope_cache.inv_freq(D, 10000.0)
    qs = [fn(q, k, v, pos, kc, vc, ks, vs, slots, inv, fp32_math)
          for q, k, v, pos, slots in steps]
    return qs, kc, vc, ks, vs


def _written(scale):
    return (scale > 0)[:, None, :, None].expand(-1, PS, -1, D)


@needs_interpreter
@pytest.mark.parametrize("dtype,fp32_math", [(torch.float32, True), (torch.bfloat16, True),
                                             (torch.bfloat16, False)])
def test_codes_and_scales_equal_the_reference_where_rotation_is_exact(dtype, fp32_math):
    steps = _steps(dtype, zero_pos=True, seed=1)
    ref = _run(rope_cache_fp8.rope_cache_fp8_reference, steps, fp32_math)
    got = _run(rope_cache_fp8.rope_cache_fp8_triton, steps, fp32_math)
    for a, b in zip(ref[0], got[0]):
        assert torch.equal(a, b)
    for cache in (1, 2):
        w = _written(ref[cache + 2])
        assert torch.equal(ref[cache].view(torch.uint8)[w], got[cache].view(torch.uint8)[w])
    assert torch.equal(ref[3], got[3]) and torch.equal(ref[4], got[4])
    assert (ref[3] > 0).any() and (ref[3] == 0).any()           # some pages never written


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_rows_within_one_e4m3_step_of_the_reference(dtype):
    """One step (each value rounded once: requantising histories would add a rounding per
    growth on each side; the exact test above covers them)."""
    steps = _steps(dtype, zero_pos=False, seed=2)[:1]
    ref = _run(rope_cache_fp8.rope_cache_fp8_reference, steps, True)
    got = _run(rope_cache_fp8.rope_cache_fp8_triton, steps, True)
    tol = 1e-5 if dtype == torch.float32 else 0.08
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    # V is not rotated: exact
    w = _written(ref[4])
    assert torch.equal(ref[2].view(torch.uint8)[w], got[2].view(torch.uint8)[w])
    assert torch.equal(ref[4], got[4])
    # K: scales within the rotation's rounding, values within one e4m3 step (plus the scale's)
    torch.testing.assert_close(got[3], ref[3], rtol=2.0**-7, atol=0.0)
    a = kv_quant.dequantize(ref[1], ref[3][:, None, :], torch.float32)
    b = kv_quant.dequantize(got[1], got[3][:, None, :], torch.float32)
    w = _written(ref[3])
    s = ref[3][:, None, :, None].expand_as(a)[w]
    assert ((a[w] - b[w]).abs() <= a[w].abs() * 2.0**-3 + s * 2.0**-8 + 1e-6).all()


@needs_interpreter
def test_no_rows_and_bad_layouts():
    inv = rope_cache.inv_freq(D, 10000.0)
    kc = torch.zeros(P, PS, HKV, D).to(kv_quant.FP8)
    s = torch.zeros(P, HKV)
    q, kv = torch.zeros(0, H, D), torch.zeros(0, HKV, D)
    e = torch.zeros(0, dtype=torch.long)
    assert rope_cache_fp8.rope_cache_fp8_triton(q, kv, kv, e, kc, kc.clone(), s, s.clone(), e,
                                                inv).shape == (0, H, D)
    with pytest.raises(ValueError, match="v_cache must be float8_e4m3fn"):
        rope_cache_fp8.rope_cache_fp8_triton(q, kv, kv, e, kc, torch.zeros(P, PS, HKV, D), s,
                                             s.clone(), e, inv)
    with pytest.raises(ValueError, match="k_scale must be contiguous float32"):
        rope_cache_fp8.rope_cache_fp8_triton(q, kv, kv, e, kc, kc.clone(), s.double(), s, e,
                                             inv)
