"""Page pack / unpack kernels against their PyTorch reference at real shapes on CUDA.

Run on the GPU box: ``python -m pytest -m gpu tests/gpu/test_kv_pages_gpu.py -q``. Pools of a few
hundred 16-token pages of LLaDA-8B (32 layers, 32 kv heads, head_dim 128: 8 MiB a page in bf16)
and Dream-7B (28 layers, 4 kv heads: 896 KiB a page). Acceptance: copies bit-exact; quantised
bytes, scales and dequantised pools identical to the reference (same rounding, ties to even), and
to the reference run on the CPU; a pool past 2^31 elements (int64 offsets); page ids out of range
masked and counted; NaN / inf quantised as the reference does. Peak memory ~12 GB.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.kernels import kv_pages
from flash_dllm.kernels._triton import use_triton

DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
MODELS = {"llada": (32, 32, 128), "dream": (28, 4, 128)}    # (layers, kv_heads, head_dim)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t):
    return t.view(BITS[t.element_size()])


def _pool(model, pages, page_size=16, dtype=torch.bfloat16, seed=0):
    L, H, D = MODELS[model]
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(L, 2, pages, page_size, H, D, generator=g, device=DEV) * 2).to(dtype)


def _ids(pages, n, seed=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pages, generator=g)[:n].to(device=DEV, dtype=dtype)


def _equal_cpu_reference(kv, ids, q, s, qdtype, layers=None, k=16):
    """The first ``k`` records (codes and scales) equal the CPU reference's: the CUDA reference
    once divided by a Python scalar (``amax * fl32(1 / qmax)`` on CUDA, a true division on the
    CPU), so comparing kernel and CUDA reference alone could hide a wrong reference."""
    pages = kv[:, :, ids[:k].long()].cpu()                 # only those pages leave the GPU
    cq, cs = kv_pages.pack_pages_reference(pages, torch.arange(pages.shape[2]), out_dtype=qdtype,
                                           layers=layers)
    return torch.equal(s[:k].cpu(), cs) and torch.equal(_bits(q[:k].cpu()), _bits(cq))


def test_dispatch_picks_triton_on_cuda():
    kv = _pool("dream", 4)
    assert use_triton(kv, _ids(4, 2))


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_copy_bit_exact_round_trip(model, id_dtype):
    kv = _pool(model, 300)
    ids = _ids(300, 200, seed=1, dtype=id_dtype)
    got, scales = kv_pages.pack_pages(kv, ids)
    ref, _ = kv_pages.pack_pages_reference(kv, ids)
    assert scales is None and torch.equal(_bits(got), _bits(ref))
    dst = torch.zeros_like(kv)
    kv_pages.unpack_pages(got, ids, dst)
    idx = ids.long()
    assert torch.equal(_bits(dst[:, :, idx]), _bits(kv[:, :, idx]))
    dst[:, :, idx] = 0
    assert not dst.any()


@pytest.mark.parametrize("model", ["llada", "dream"])
def test_layer_groups_and_staging_views(model):
    kv = _pool(model, 200, seed=2)
    L = kv.shape[0]
    ids = _ids(200, 64, seed=3)
    full, _ = kv_pages.pack_pages_reference(kv, ids)
    staging = torch.empty((100, *full.shape[1:]), dtype=kv.dtype, device=DEV)
    for l0 in range(0, L, 8):                        # groups of 8 layers, as a pipeline sends
        grp = (l0, min(L, l0 + 8))
        out = torch.empty(kv_pages.packed_shape(kv, 64, grp), dtype=kv.dtype, device=DEV)
        kv_pages.pack_pages(kv, ids, out=out, layers=grp)
        assert torch.equal(_bits(out), _bits(full[:, grp[0]:grp[1]]))
    kv_pages.pack_pages(kv, ids, out=staging[10:74])
    assert torch.equal(_bits(staging[10:74]), _bits(full))
    dst = torch.zeros_like(kv)
    for l0 in range(0, L, 8):                        # unpack strided layer-group views
        grp = (l0, min(L, l0 + 8))
        kv_pages.unpack_pages(staging[10:74, grp[0]:grp[1]], ids, dst, layers=grp)
    assert torch.equal(_bits(dst[:, :, ids]), _bits(kv[:, :, ids]))


@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_quantised_equal_reference(model, qdtype):
    kv = _pool(model, 300, seed=4)
    kv[3, 1, 7, :, 2] = 0                            # one head of one fragment: amax 0
    ids = _ids(300, 200, seed=5)
    ids[0] = 7
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=qdtype)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    assert torch.equal(s, ref_s) and torch.equal(_bits(q), _bits(ref_q))
    assert _equal_cpu_reference(kv, ids, q, s, qdtype)
    assert s[0, 3, 1, 2] == 1.0
    dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
    kv_pages.unpack_pages(q, ids, dst, s)
    kv_pages.unpack_pages_reference(q, ids, want, s)
    assert torch.equal(_bits(dst), _bits(want))
    # the error bound, a few pages at a time (the whole LLaDA-shaped pool in float32 twice did
    # not fit an 80 GB card next to the pool itself)
    for a in range(0, ids.numel(), 25):
        sub = ids[a:a + 25]
        x = kv[:, :, sub].permute(2, 0, 1, 3, 4, 5).float()             # [n, L, 2, S, H, D]
        deq = dst[:, :, sub].permute(2, 0, 1, 3, 4, 5).float()
        sc = s[a:a + 25, :, :, None, :, None]
        err = (x - deq).abs()
        if qdtype == torch.int8:
            assert (err <= sc / 2 + 2.0 ** -8 * deq.abs() + 1e-6 * sc).all()
        else:
            normal = x.abs() >= sc * 2.0 ** -6
            assert (err[normal] <= (2.0 ** -3 * x.abs())[normal]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 64])
def test_other_dtypes_and_page_sizes(dtype, page_size):
    kv = _pool("llada", 24, page_size, dtype, seed=6)    # page 64: the quantiser loops (2 passes)
    ids = _ids(24, 10, seed=7)
    got, _ = kv_pages.pack_pages(kv, ids)
    assert torch.equal(_bits(got), _bits(kv_pages.pack_pages_reference(kv, ids)[0]))
    for qdtype in (FP8, torch.int8):
        q, s = kv_pages.pack_pages(kv, ids, out_dtype=qdtype, layers=(5, 9))
        ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype, layers=(5, 9))
        assert torch.equal(s, ref_s) and torch.equal(_bits(q), _bits(ref_q))
        assert _equal_cpu_reference(kv, ids, q, s, qdtype, layers=(5, 9))
        dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
        kv_pages.unpack_pages(q, ids, dst, s, layers=(5, 9))
        kv_pages.unpack_pages_reference(q, ids, want, s, layers=(5, 9))
        assert torch.equal(_bits(dst), _bits(want))


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_round_half_to_even_on_gpu(qdtype):
    """The kernel's magic-number and bit roundings survive the GPU compiler (no fast-math)."""
    kv = torch.zeros(1, 2, 2, 2, 2, 8, device=DEV)
    if qdtype == torch.int8:
        vals = [127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5]
        want = [127, 0, 2, 2, -2, 0, 126, -4]
    else:
        vals = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -5 * 2.0 ** -10, 300.0]
        want = [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, -2.0 ** -8, 288.0]
    kv[0, 0, 1, 0, 0] = torch.tensor(vals, device=DEV)
    ids = torch.tensor([1], device=DEV)
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=qdtype)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)
    assert _equal_cpu_reference(kv, ids, q, s, qdtype)
    assert q[0, 0, 0, 0, 0].float().tolist() == [float(w) for w in want]
    # every finite fp8 code dequantises like torch, into every pool dtype
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].to(DEV)
    buf = codes.view(FP8).reshape(1, 1, 2, 1, 1, 127)
    scales = torch.tensor([1.0, 0.37], device=DEV).reshape(1, 1, 2, 1)
    page0 = torch.tensor([0], device=DEV)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dst = torch.zeros(1, 2, 1, 1, 1, 127, dtype=dtype, device=DEV)
        want_pool = torch.zeros_like(dst)
        kv_pages.unpack_pages(buf, page0, dst, scales)
        kv_pages.unpack_pages_reference(buf, page0, want_pool, scales)
        assert torch.equal(_bits(dst), _bits(want_pool))


def test_pool_past_2_pow_31_elements():
    """560 LLaDA-8B pages = 2.35e9 elements (4.7 GB): offsets of pages >= 512 need int64."""
    L, H, D = MODELS["llada"]
    kv = torch.empty(L, 2, 560, 16, H, D, dtype=torch.bfloat16, device=DEV)
    assert kv.numel() > 2 ** 31
    ids = torch.tensor([559, 3, 530, 513, 511], device=DEV)
    for p in ids.tolist():
        kv[:, :, p].normal_()
    got, _ = kv_pages.pack_pages(kv, ids)
    ref, _ = kv_pages.pack_pages_reference(kv, ids)
    assert torch.equal(_bits(got), _bits(ref))
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=FP8)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=FP8)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)
    cq, cs = kv_pages.pack_pages_reference(kv[:, :, ids].cpu(), torch.arange(5), out_dtype=FP8)
    assert torch.equal(_bits(q.cpu()), _bits(cq)) and torch.equal(s.cpu(), cs)
    back = torch.tensor([555, 540, 520, 514, 512], device=DEV)   # write to other high pages
    kv_pages.unpack_pages(got, back, kv)
    assert torch.equal(_bits(kv[:, :, back]), _bits(kv[:, :, ids]))
    kv_pages.unpack_pages(q, back, kv, s)
    deq = (q.float() * s[:, :, :, None, :, None]).to(torch.bfloat16).permute(1, 2, 0, 3, 4, 5)
    assert torch.equal(_bits(kv[:, :, back]), _bits(deq))


@pytest.mark.parametrize("qdtype", [None, FP8, torch.int8])
def test_bad_page_ids_masked_and_counted_on_gpu(qdtype):
    """Ids outside [0, P) are never read or written (one guard page either side of the pool
    view catches a stray access) and are counted into `bad` with no host sync."""
    L, H, D = MODELS["dream"]
    whole = torch.zeros(L, 2, 34, 16, H, D, dtype=torch.bfloat16, device=DEV)
    kv = whole[:, :, 1:-1]                                   # 32 pages
    kv.normal_()
    ids = torch.tensor([5, 32, -1, 0, 1000, 31], device=DEV)
    ok = torch.tensor([True, False, False, True, False, True], device=DEV)
    bad = torch.zeros(1, dtype=torch.int32, device=DEV)
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=qdtype, bad=bad)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids[ok], out_dtype=qdtype)
    assert int(bad) == 3 and not _bits(q[~ok]).any()
    assert torch.equal(_bits(q[ok]), _bits(ref_q))
    if qdtype is not None:
        assert torch.equal(s[ok], ref_s) and (s[~ok] == 1).all()
    before = whole.clone()
    bad.zero_()
    kv_pages.unpack_pages(torch.ones_like(q) if qdtype is None else q, ids, kv,
                          None if qdtype is None else s, bad=bad)
    assert int(bad) == 3
    assert torch.equal(_bits(whole[:, :, 0]), _bits(before[:, :, 0]))       # guards untouched
    assert torch.equal(_bits(whole[:, :, -1]), _bits(before[:, :, -1]))
    kv_pages.unpack_pages(q, ids, kv, s)                     # no counter: still masked
    assert torch.equal(_bits(whole[:, :, 0]), _bits(before[:, :, 0]))


@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_non_finite_values_like_the_reference_on_gpu(qdtype):
    kv = _pool("dream", 8, seed=9)
    kv[0, 0, 1, 2, 1, 5] = float("nan")
    kv[1, 1, 1, 0, 2, 3] = float("inf")
    kv[2, 0, 3, 1, 0, 7] = float("-inf")
    ids = torch.tensor([1, 3, 0], device=DEV)
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=qdtype)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    assert torch.equal(s, ref_s) and s[0, 0, 0, 1] == 1 and s[0, 1, 1, 2] == float("inf")
    nan = q.float().isnan()
    assert torch.equal(nan, ref_q.float().isnan())
    assert torch.equal(_bits(q)[~nan], _bits(ref_q)[~nan])
    if qdtype == FP8:
        assert nan[0, 0, 0, 2, 1, 5]                          # was -448 before the fix
    dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
    kv_pages.unpack_pages(q, ids, dst, s)
    kv_pages.unpack_pages_reference(q, ids, want, s)
    assert torch.equal(dst.isnan(), want.isnan())
    assert torch.equal(_bits(dst)[~dst.isnan()], _bits(want)[~want.isnan()])
