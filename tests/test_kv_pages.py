"""Page pack / unpack (kernels/kv_pages.py): the Triton kernels against the PyTorch reference
under the interpreter at tiny LLaDA-like (MHA) and Dream-like (GQA) shapes, round trips, layer
groups, buffer views, quantisation contracts, layout errors, and the benchmark's CPU smoke run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from flash_dllm.cache.paged import PagedKVLayout
from flash_dllm.kernels import kv_pages
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and kv_pages.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")
FP8 = torch.float8_e4m3fn
# (layers, kv_heads, head_dim): many kv heads (LLaDA: MHA) vs few (Dream: GQA)
SHAPES = {"llada": (3, 4, 16), "dream": (2, 1, 32)}
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.element_size()])


def _pool(model: str, pages: int, page_size: int, dtype, seed: int = 0) -> torch.Tensor:
    L, H, D = SHAPES[model]
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(L, 2, pages, page_size, H, D, generator=g) * 3).to(dtype)


def _ids(pages: int, n: int, seed: int = 0, dtype=torch.int64) -> torch.Tensor:
    return torch.randperm(pages, generator=torch.Generator().manual_seed(seed))[:n].to(dtype)


def _expected(kv: torch.Tensor, ids: torch.Tensor, l0: int = 0, l1: int | None = None):
    """[n, Lr, 2, S, H, D] by plain indexing, page by page."""
    return torch.stack([kv[l0:l1, :, int(p)] for p in ids])


# ---- plain copies ------------------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("model", ["llada", "dream"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_round_trip_bit_exact(model, dtype):
    kv = _pool(model, 9, 4, dtype)
    kv[0, 1, 3, 0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0]).to(dtype)
    ids = _ids(9, 4, seed=1, dtype=torch.int32 if dtype == torch.float16 else torch.int64)
    ids[0] = 3                                            # a page holding NaN / -inf / -0
    got, scales = kv_pages.pack_pages_triton(kv, ids)
    ref, ref_scales = kv_pages.pack_pages_reference(kv, ids)
    assert scales is None and ref_scales is None
    assert got.shape == (4, SHAPES[model][0], 2, 4, *SHAPES[model][1:]) and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(_bits(got), _bits(_expected(kv, ids)))
    dst = torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(got, ids, dst)
    want = torch.zeros_like(kv)
    kv_pages.unpack_pages_reference(ref, ids, want)
    assert torch.equal(_bits(dst), _bits(want))
    moved = torch.zeros(9, dtype=torch.bool)
    moved[ids.long()] = True
    assert torch.equal(_bits(dst[:, :, moved]), _bits(kv[:, :, moved]))   # bit-exact round trip
    assert not dst[:, :, ~moved].any()                                      # nothing else written


@needs_interpreter
@pytest.mark.parametrize("page_size,block", [(1, None), (16, None), (16, 256)])
def test_copy_page_sizes_and_chunks(page_size, block):
    kv = _pool("llada", 6, page_size, torch.bfloat16, seed=2)  # block 256: 4 chunks a fragment
    ids = torch.tensor([5, 0, 3])
    got, _ = kv_pages.pack_pages_triton(kv, ids, block=block)
    assert torch.equal(_bits(got), _bits(_expected(kv, ids)))
    dst = torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(got, ids, dst, block=block)
    assert torch.equal(_bits(dst[:, :, ids]), _bits(kv[:, :, ids]))


@needs_interpreter
def test_copy_masked_tail_and_repeated_ids():
    kv = _pool("dream", 5, 3, torch.float32, seed=3)       # fragment 96 values, blocks of 64
    ids = torch.tensor([4, 1, 4])
    got, _ = kv_pages.pack_pages_triton(kv, ids, block=64)
    assert torch.equal(got, _expected(kv, ids))


@needs_interpreter
@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (2, 3)])
def test_layer_groups(layers):
    kv = _pool("llada", 7, 4, torch.bfloat16, seed=4)
    ids = torch.tensor([6, 2])
    l0, l1 = layers
    got, _ = kv_pages.pack_pages_triton(kv, ids, layers=layers)
    ref, _ = kv_pages.pack_pages_reference(kv, ids, layers=layers)
    assert got.shape == (2, l1 - l0, 2, 4, 4, 16)
    assert torch.equal(_bits(got), _bits(ref)) and torch.equal(got, _expected(kv, ids, l0, l1))
    dst = torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(got, ids, dst, layers=layers)
    assert torch.equal(dst[l0:l1, :, ids], kv[l0:l1, :, ids])
    dst[l0:l1, :, ids] = 0
    assert not dst.any()                                   # other layers untouched


@needs_interpreter
def test_out_views_into_staging_buffers():
    kv = _pool("llada", 8, 4, torch.bfloat16, seed=5)
    ids = torch.tensor([7, 1, 4])
    staging = torch.full((6, 3, 2, 4, 4, 16), 7.0, dtype=torch.bfloat16)
    out = staging[2:5]                                     # a contiguous slice of pages
    got, _ = kv_pages.pack_pages_triton(kv, ids, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(staging[2:5], _expected(kv, ids))
    assert (staging[:2] == 7).all() and (staging[5:] == 7).all()
    flat = torch.full((10 + got.numel(),), 7.0, dtype=torch.bfloat16)   # at an element offset
    kv_pages.pack_pages_triton(kv, ids, out=flat[10:].view(got.shape))
    assert torch.equal(flat[10:].view(got.shape), got) and (flat[:10] == 7).all()
    # unpack a layer group straight out of a whole-page staging buffer: a strided view
    dst = torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(staging[2:5, 1:3], ids, dst, layers=(1, 3))
    assert torch.equal(dst[1:3, :, ids], kv[1:3, :, ids]) and not dst[0].any()


@needs_interpreter
@pytest.mark.parametrize("out_dtype", [None, torch.float8_e4m3fn, torch.int8])
def test_pack_into_strided_record_rows_equals_the_reference(out_dtype):
    """The offloader packs straight into the payload columns of a batch of page records (rows
    strided by the record size): kernel and reference agree with a contiguous pack, bytes
    outside the payload columns are untouched, and unpack reads the rows back in place."""
    kv = _pool("llada", 8, 4, torch.bfloat16, seed=9)
    ids = torch.tensor([6, 2, 3])
    want, want_scales = kv_pages.pack_pages_reference(kv, ids, out_dtype=out_dtype)
    dtype = want.dtype
    payload = want[0].numel() * want.element_size()
    for pack in (kv_pages.pack_pages_triton, kv_pages.pack_pages_reference):
        rec = torch.full((3, payload + 64), 0xA5, dtype=torch.uint8)
        out = rec[:, :payload].view(dtype).view(want.shape)
        got, scales = pack(kv, ids, out=out, out_dtype=out_dtype)
        assert got.data_ptr() == rec.data_ptr() and not out.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert (rec[:, payload:] == 0xA5).all()
        if out_dtype is not None:
            assert torch.equal(scales, want_scales)
        dst = torch.zeros_like(kv)
        kv_pages.unpack_pages_triton(out, ids, dst, scales)
        ref = torch.zeros_like(kv)
        kv_pages.unpack_pages_reference(want, ids, ref, want_scales)
        assert torch.equal(dst, ref)


@needs_interpreter
def test_empty_page_list():
    kv = _pool("dream", 4, 4, torch.bfloat16)
    ids = torch.zeros(0, dtype=torch.int64)
    got, _ = kv_pages.pack_pages_triton(kv, ids)
    assert got.shape == (0, 2, 2, 4, 1, 32)
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=FP8)
    assert q.shape == (0, 2, 2, 4, 1, 32) and s.shape == (0, 2, 2, 1)
    assert kv_pages.unpack_pages_triton(got, ids, kv) is kv


# ---- quantised ---------------------------------------------------------------------------------
def _check_bounds(x: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor, qdtype, pool_dtype):
    """|x - deq| within the format's rounding (plus the pool dtype's rounding of deq)."""
    s = scales[:, :, :, None, :, None]
    err = (x - deq).abs()
    # deq = q * scale is rounded once, to fp32 or to the pool dtype
    pool_eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8,
                torch.float16: 2.0 ** -10}[pool_dtype]
    slack = pool_eps * deq.abs() + 1e-6 * s
    if qdtype == torch.int8:
        assert (err <= s / 2 + slack).all()
    else:
        normal = x.abs() >= s * 2.0 ** -6                  # e4m3 normal range
        assert (err[normal] <= (2.0 ** -4 * x.abs() + slack)[normal]).all()   # < the 2^-3 bound
        assert (err[~normal] <= (s * 2.0 ** -10 + slack)[~normal]).all()      # half a subnormal


@needs_interpreter
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("dtype,model", [(torch.bfloat16, "llada"), (torch.float16, "dream"),
                                         (torch.float32, "llada")])
def test_quantised_matches_reference(qdtype, dtype, model):
    kv = _pool(model, 7, 4, dtype, seed=6)
    kv[1, 0, 2, :, 0] = 0                                  # one head of one fragment: amax 0
    ids = torch.tensor([2, 6, 0])
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=qdtype)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    H = SHAPES[model][1]
    assert q.dtype == qdtype and s.dtype == torch.float32 and s.shape == (3, kv.shape[0], 2, H)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)   # same rounding
    assert s[0, 1, 0, 0] == 1.0 and not q[0, 1, 0, :, 0].float().any()      # amax 0 -> scale 1
    x = _expected(kv, ids).float()
    amax = x.abs().amax(dim=(3, 5))
    qmax = kv_pages.QMAX[qdtype]
    assert torch.equal(s, torch.where(amax > 0, amax / qmax, torch.ones_like(amax)))
    dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(q, ids, dst, s)
    kv_pages.unpack_pages_reference(q, ids, want, s)
    assert torch.equal(_bits(dst), _bits(want))            # dequantised identically
    deq = dst[:, :, ids].permute(2, 0, 1, 3, 4, 5).float()
    _check_bounds(x, deq, s, qdtype, dtype)


@needs_interpreter
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("model,page_size", [("dream", 8), ("llada", 4)])
def test_quantised_small_tiles_and_layer_group(qdtype, model, page_size):
    # tiles of 64 values: dream (D 32) loops over 4 blocks of 2 tokens, twice (amax, then write);
    # llada (D 16, 4 heads, 4 tokens) splits the heads over 4 programs
    kv = _pool(model, 5, page_size, torch.bfloat16, seed=7)
    ids = torch.tensor([4, 1])
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=qdtype, layers=(1, 2), block=64)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype, layers=(1, 2))
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)
    dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(q, ids, dst, s, layers=(1, 2), block=64)   # 2 or 4 rows each
    kv_pages.unpack_pages_reference(q, ids, want, s, layers=(1, 2))
    assert torch.equal(_bits(dst), _bits(want)) and not dst[0].any()


@needs_interpreter
def test_quantised_out_and_out_scales_views():
    kv = _pool("dream", 6, 4, torch.bfloat16, seed=8)
    ids = torch.tensor([3, 5])
    vals = torch.zeros((4, 2, 2, 4, 1, 32), dtype=FP8)
    scales = torch.zeros((4, 2, 2, 1))
    q, s = kv_pages.pack_pages_triton(kv, ids, out=vals[1:3], out_scales=scales[1:3])
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=FP8)
    assert q.data_ptr() == vals[1:3].data_ptr() and s.data_ptr() == scales[1:3].data_ptr()
    assert torch.equal(_bits(vals[1:3]), _bits(ref_q)) and torch.equal(scales[1:3], ref_s)
    assert not _bits(vals[0]).any() and not scales[3].any()


def _tie_pool(qdtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 pool, 1 layer, 2 heads, D = 8; head 0 has amax QMAX (scale exactly 1) and exact ties
    of the format; head 1 is all zeros."""
    kv = torch.zeros(1, 2, 2, 2, 2, 8)
    if qdtype == torch.int8:
        vals = [127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -3.5]
        want = [127, 0, 2, 2, -2, 0, 126, -4]
    else:        # 1 + 1/16 and 1 + 3/16: ties at 3 mantissa bits; 2^-10, 3 * 2^-10: subnormal ties
        vals = [448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, -5 * 2.0 ** -10, 300.0]
        want = [448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, -2.0 ** -8, 288.0]
    kv[0, 0, 1, 0, 0] = torch.tensor(vals)
    return kv, torch.tensor(want)


@needs_interpreter
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
def test_round_half_to_even(qdtype):
    kv, want = _tie_pool(qdtype)
    ids = torch.tensor([1])
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=qdtype)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    assert torch.equal(_bits(q), _bits(ref_q)) and torch.equal(s, ref_s)
    assert s[0, 0, 0].tolist() == [1.0, 1.0] and s[0, 0, 1].tolist() == [1.0, 1.0]
    assert torch.equal(q[0, 0, 0, 0, 0].float(), want.float())


@needs_interpreter
def test_fp8_every_code_dequantises_like_torch():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]              # the 254 finite codes: + then - half
    buf = codes.view(FP8).reshape(1, 1, 2, 1, 1, 127)   # K: positive codes, V: negative codes
    scales = torch.tensor([1.0, 0.37]).reshape(1, 1, 2, 1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        dst = torch.zeros(1, 2, 1, 1, 1, 127, dtype=dtype)
        want = torch.zeros_like(dst)
        kv_pages.unpack_pages_triton(buf, torch.tensor([0]), dst, scales)
        kv_pages.unpack_pages_reference(buf, torch.tensor([0]), want, scales)
        assert torch.equal(_bits(dst), _bits(want))
    assert torch.equal(dst[0, 0, 0].flatten(), buf[0, 0, 0].flatten().half())  # K: scale 1


def test_reference_scale_is_a_true_division():
    """scale = amax / QMAX correctly rounded (what the CPU, the interpreter and div_rn compute);
    torch on CUDA turns `t / python_scalar` into `t * fl32(1 / scalar)`, which differs by an ulp
    for ~1 head in 4: the reference divides by a tensor so it is the same on every device
    (tests/gpu/test_kv_pages_gpu.py compares the CUDA reference with the CPU one)."""
    kv = _pool("llada", 16, 8, torch.bfloat16, seed=11)
    ids = torch.arange(16)
    for qdtype in (FP8, torch.int8):
        _, s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
        amax = _expected(kv, ids).float().abs().amax(dim=(3, 5))
        exact = (amax.double() / kv_pages.QMAX[qdtype]).float()   # fp32-correct: no double rounding
        assert torch.equal(s, exact)
        recip = amax * torch.tensor(1.0 / kv_pages.QMAX[qdtype], dtype=torch.float32)
        assert not torch.equal(s, recip)                # the data tells the two apart


def _guarded_pool(pages: int, dtype=torch.bfloat16, seed: int = 12):
    """(kv [L, 2, pages, ...] as a view of a pool with one zero guard page either side, the whole
    pool): ids -1 and `pages` address the guards, so an unmasked access stays in memory we own
    and shows up in them."""
    whole = torch.zeros(3, 2, pages + 2, 4, 4, 16, dtype=dtype)
    whole[:, :, 1:-1] = _pool("llada", pages, 4, dtype, seed=seed)
    return whole[:, :, 1:-1], whole


@needs_interpreter
@pytest.mark.parametrize("qdtype", [None, FP8, torch.int8])
@pytest.mark.parametrize("block", [None, 64])
def test_bad_page_ids_are_masked_and_counted(qdtype, block):
    kv, whole = _guarded_pool(5)
    whole[:, :, 0] = 1.0                                   # guards with data: a read would show
    whole[:, :, -1] = -1.0
    ids = torch.tensor([2, 5, -1, 0, 7])                   # 3 ids outside [0, 5)
    ok = torch.tensor([True, False, False, True, False])
    bad = torch.zeros(1, dtype=torch.int32)
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=qdtype, block=block, bad=bad)
    assert bad.tolist() == [3]
    ref_bad = torch.zeros(1, dtype=torch.int32)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype, bad=ref_bad)
    assert ref_bad.tolist() == [3] and torch.equal(_bits(q), _bits(ref_q))
    assert not _bits(q[~ok]).any()                         # bad records: zeros ...
    if qdtype is not None:
        assert torch.equal(s, ref_s) and (s[~ok] == 1).all()   # ... with scale 1
    good, _ = kv_pages.pack_pages_reference(kv, ids[ok], out_dtype=qdtype)
    assert torch.equal(_bits(q[ok]), _bits(good))
    # unpack: the bad records go nowhere (the guards and every other page stay as they were)
    before = whole.clone()
    src = _pool("llada", 5, 4, torch.bfloat16, seed=13)
    buf, sc = kv_pages.pack_pages_reference(src, torch.arange(5), out_dtype=qdtype)
    bad.zero_()
    kv_pages.unpack_pages_triton(buf, ids, kv, sc, block=block, bad=bad)
    assert bad.tolist() == [3]
    want = before.clone()
    ref_bad = torch.zeros(1, dtype=torch.int32)
    kv_pages.unpack_pages_reference(buf, ids, want[:, :, 1:-1], sc, bad=ref_bad)
    assert ref_bad.tolist() == [3] and torch.equal(_bits(whole), _bits(want))
    assert torch.equal(_bits(whole[:, :, 0]), _bits(before[:, :, 0]))
    assert torch.equal(_bits(whole[:, :, -1]), _bits(before[:, :, -1]))
    changed = (_bits(whole) != _bits(before)).flatten(3).any(-1).any(0).any(0)   # [pages + 2]
    assert changed.tolist() == [False, True, False, True, False, False, False]   # pages 0 and 2


@needs_interpreter
def test_bad_page_ids_without_a_counter_still_write_nothing():
    kv, whole = _guarded_pool(4)
    before = whole.clone()
    buf = torch.ones(2, 3, 2, 4, 4, 16, dtype=torch.bfloat16)
    kv_pages.unpack_pages_triton(buf, torch.tensor([4, -1], dtype=torch.int32), kv)
    assert torch.equal(_bits(whole), _bits(before))
    q, _ = kv_pages.pack_pages_triton(kv, torch.tensor([-1, 4]))
    assert not _bits(q).any()


def _same_with_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits where neither is NaN, NaN in the same places (a NaN's sign is unspecified)."""
    fa, fb = a.float(), b.float()
    nan = fa.isnan()
    return torch.equal(nan, fb.isnan()) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@needs_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy: inf/inf
@pytest.mark.parametrize("qdtype", [FP8, torch.int8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_values_quantise_like_the_reference(qdtype, dtype):
    kv = _pool("llada", 3, 4, dtype, seed=14)
    kv[0, 0, 1, 2, 1, 5] = float("nan")                   # head 1: NaN among finite values
    kv[1, 1, 1, 0, 2, 3] = float("inf")                   # head 2: +inf
    kv[1, 1, 1, 3, 3, 0] = float("-inf")                  # head 3: -inf
    kv[2, 0, 1, 1, 0, 7] = float("nan")                   # head 0: NaN and inf together
    kv[2, 0, 1, 2, 0, 8] = float("inf")
    ids = torch.tensor([1, 0])
    q, s = kv_pages.pack_pages_triton(kv, ids, out_dtype=qdtype, block=64)
    ref_q, ref_s = kv_pages.pack_pages_reference(kv, ids, out_dtype=qdtype)
    assert torch.equal(s, ref_s)                           # NaN heads: scale 1 on both
    assert s[0, 0, 0, 1] == 1 and s[0, 2, 0, 0] == 1
    assert s[0, 1, 1, 2] == float("inf") and s[0, 1, 1, 3] == float("inf")
    if qdtype == FP8:
        assert _same_with_nans(q, ref_q)
        assert q[0, 0, 0, 2, 1, 5].float().isnan()        # NaN stays NaN (was: -448)
    else:
        assert torch.equal(q, ref_q) and q[0, 0, 0, 2, 1, 5] == 0   # no int8 NaN: code 0
    dst, want = torch.zeros_like(kv), torch.zeros_like(kv)
    kv_pages.unpack_pages_triton(q, ids, dst, s)
    kv_pages.unpack_pages_reference(q, ids, want, s)
    assert _same_with_nans(dst, want)
    assert dst[1, 1, 1, :, 2].isnan().all() and dst[1, 1, 1, :, 3].isnan().all()  # inf heads
    finite = dst[0, 0, 1, :, 1].flatten()                  # the NaN head's other values survive
    assert finite.isnan().sum() == (1 if qdtype == FP8 else 0) and finite.isfinite().sum() >= 63


# ---- layouts and errors --------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_bad_layouts_raise(impl):
    if impl == "triton" and not (HAS_TRITON and kv_pages.INTERPRET):
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    pack = getattr(kv_pages, f"pack_pages_{impl}")
    unpack = getattr(kv_pages, f"unpack_pages_{impl}")
    kv = _pool("llada", 4, 4, torch.bfloat16)
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="kv must be"):
        pack(kv[0], ids)                                              # wrong rank
    with pytest.raises(ValueError, match="kv's pages must be contiguous"):
        pack(kv.transpose(4, 5), ids)
    with pytest.raises(ValueError, match="page_ids must be"):
        pack(kv, ids[None])
    with pytest.raises(ValueError, match="page_ids must be one of"):
        pack(kv, ids.float())
    with pytest.raises(ValueError, match="layers must be"):
        pack(kv, ids, layers=(2, 2))
    with pytest.raises(ValueError, match="out's pages must be contiguous"):
        pack(kv, ids, out=torch.empty(2, 3, 2, 4, 4, 32, dtype=torch.bfloat16)[..., ::2])
    with pytest.raises(ValueError, match="out must be"):
        pack(kv, ids, out=torch.empty(3, 3, 2, 4, 4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out dtype"):                 # dtype mismatch
        pack(kv, ids, out=torch.empty(2, 3, 2, 4, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="out dtype"):
        pack(kv, ids, out=torch.empty(2, 3, 2, 4, 4, 16, dtype=torch.int8), out_dtype=FP8)
    with pytest.raises(ValueError, match="out_dtype must be"):
        pack(kv, ids, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_scales given"):
        pack(kv, ids, out_scales=torch.empty(2, 3, 2, 4))
    with pytest.raises(ValueError, match="out_scales must be"):
        pack(kv, ids, out_dtype=FP8, out_scales=torch.empty(2, 3, 2, 5))
    buf = torch.zeros(2, 3, 2, 4, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="buf must be"):
        unpack(buf[:, :2], ids, kv)
    with pytest.raises(ValueError, match="buf dtype"):
        unpack(buf.float(), ids, kv)                                  # dtype mismatch
    with pytest.raises(ValueError, match="buf's pages must be contiguous"):
        unpack(buf.transpose(4, 5).contiguous().transpose(4, 5), ids, kv)
    with pytest.raises(ValueError, match="when scales"):
        unpack(buf, ids, kv, torch.ones(2, 3, 2, 4))
    with pytest.raises(ValueError, match="scales must be"):
        unpack(buf.to(torch.int8), ids, kv, torch.ones(2, 3, 2, 4, dtype=torch.float64))


def test_reference_checks_page_ids_in_range():
    kv = _pool("dream", 4, 4, torch.float32)
    with pytest.raises(ValueError, match=r"page_ids must lie in \[0, 4\)"):
        kv_pages.pack_pages_reference(kv, torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="page_ids must lie"):
        kv_pages.unpack_pages_reference(torch.zeros(1, 2, 2, 4, 1, 32), torch.tensor([-1]), kv)


def test_op_on_cpu_is_the_reference():
    kv = _pool("llada", 5, 2, torch.float32)
    ids = torch.tensor([4, 0, 2])
    got, _ = kv_pages.pack_pages(kv, ids)
    assert torch.equal(got, _expected(kv, ids)) and kv_pages.op is kv_pages.pack_pages
    q, s = kv_pages.pack_pages(kv, ids, out_dtype=torch.int8, layers=(1, 2))
    dst = torch.zeros_like(kv)
    assert kv_pages.unpack_pages(q, ids, dst, s, layers=(1, 2)) is dst
    assert (dst[1, :, ids] - kv[1, :, ids]).abs().max() <= s.max() / 2 * (1 + 1e-5)


def test_packed_shape_and_bytes():
    llada = PagedKVLayout(32, 1000, 16, 32, 128)            # LLaDA-8B, bf16
    assert kv_pages.packed_shape(llada, 625) == (625, 32, 2, 16, 32, 128)
    assert kv_pages.packed_bytes(llada, 1) == 8 << 20 == llada.bytes_per_page
    assert kv_pages.packed_bytes(llada, 625) == 625 * llada.bytes_per_page    # 5.24 GiB
    assert kv_pages.packed_bytes(llada, 1, FP8) == (4 << 20) + 32 * 2 * 32 * 4
    assert (kv_pages.packed_bytes(llada, 2, torch.int8, layers=(0, 8))
            == 2 * (1 << 20) + 2 * 8 * 2 * 32 * 4)
    dream = PagedKVLayout(28, 10, 16, 4, 128)
    assert kv_pages.packed_bytes(dream, 3) == 3 * dream.bytes_per_page
    assert kv_pages.packed_bytes(dream.shape, 3, torch.float32) == 6 * dream.bytes_per_page
    assert kv_pages.packed_bytes(torch.zeros(2, 2, 3, 4, 1, 8), 2) == 2 * 2 * 2 * 4 * 8 * 4
    with pytest.raises(ValueError, match="dtype is required"):
        kv_pages.packed_bytes(dream.shape, 3)
    with pytest.raises(ValueError, match="layers must be"):
        kv_pages.packed_shape(dream, 3, layers=(0, 29))


def test_bench_smoke_runs_on_cpu(tmp_path):
    path = (Path(__file__).resolve().parents[1] / "benchmarks" / "disagg"
            / "bench_kv_pages.py")
    spec = importlib.util.spec_from_file_location("bench_kv_pages", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "kv_pages.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [m["model"] for m in rep["models"]] == ["llada8b", "dream7b"]
    for m in rep["models"]:
        names = [r["name"] for r in m["rows"]]
        for want in ("d2d_copy", "pack", "unpack", "pack_fp8", "pack_int8", "fragment_loop_pack",
                     "d2h_copy", "pack+d2h", "fragment_loop_d2h"):
            assert want in names
        for r in m["rows"]:
            assert "error" not in r, r
            assert r["ms"] > 0 and r["gbps"] >= 0 and r["moved_bytes"] > 0
            assert (r["vs_copy"] is None) == (r["name"] in ("d2d_copy", "d2h_copy", "h2d_copy"))
