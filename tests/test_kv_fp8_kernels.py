"""fp8 KV pages (``kernels/kv_quant``, ``--kv-cache-dtype fp8``): the quantised page write against
its error bound (scales that grow and requantise a page's entries), the graph-safe write and the
paged attention kernel reading fp8 pages against their references (``TRITON_INTERPRET=1``, tiny
shapes), and the tiers' page records carrying the scales under their checksum."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_dllm.cache.io.kv_offload import KVOffloader
from flash_dllm.cache.paged import PagedKVLayout, allocate_kv_scales
from flash_dllm.cache.tiers import Block, Store
from flash_dllm.kernels import kv_quant, paged_attention
from flash_dllm.kernels._triton import HAS_TRITON

FP8 = torch.float8_e4m3fn
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and paged_attention.INTERPRET),
    reason="needs triton under TRITON_INTERPRET=1 (set before triton is first imported)")


def _empty(P, ps, Hkv, D, seed=0):
    """An fp8 cache whose bytes are garbage (NaN codes too), as ``torch.empty`` may give."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (P, ps, Hkv, D), generator=g, dtype=torch.uint8)
    return raw.view(FP8), torch.zeros(P, Hkv)


def _bound(x: torch.Tensor, s: torch.Tensor, rounds: int) -> torch.Tensor:
    """Half an e4m3 ulp of ``x`` on the grid of scale ``s`` (2^-4 relative for normals, s * 2^-10
    below the normal range), once per rounding."""
    return rounds * (x.abs() * 2.0**-4 + s * 2.0**-10) + 1e-12


def test_quantize_dequantize_error_bound_and_zero_scale():
    x = torch.randn(64, 2, 32) * torch.logspace(-3, 2, 64)[:, None, None]
    s = x.abs().amax(-1) / kv_quant.FP8_MAX                        # [64, 2]
    y = kv_quant.dequantize(kv_quant.quantize(x, s), s, torch.float32)
    assert ((y - x).abs() <= _bound(x, s[..., None], 1)).all()
    assert (y.abs().amax(-1) <= x.abs().amax(-1) * (1 + 2.0**-4)).all()
    z = kv_quant.quantize(torch.zeros(3, 2, 8), torch.zeros(3, 2))   # scale 0: zeros, no NaN
    assert torch.equal(z.float(), torch.zeros(3, 2, 8))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 8), st.floats(-4, 3)),
                min_size=1, max_size=12), st.integers(0, 2**16))
def test_appended_rows_keep_every_entry_within_its_bound(writes, seed):
    """Rows written a few at a time into one page (offset, count, log10 magnitude): after every
    write, each written slot reads back its last value within half an ulp per scale growth of
    its page since it was written, and the scale is the running amax / 448."""
    ps, Hkv, D = 8, 2, 16
    cache, scale = _empty(2, ps, Hkv, D, seed)
    g = torch.Generator().manual_seed(seed)
    last = torch.full((ps, Hkv, D), float("nan"))
    grown = torch.zeros(ps, dtype=torch.long)      # growths of the page since slot i was written
    amax = torch.zeros(Hkv)
    for off, n, mag in writes:
        n = min(n, ps - off)
        x = torch.randn(n, Hkv, D, generator=g) * 10.0**mag
        before = scale[1].clone()
        kv_quant.write_reference(cache, scale, torch.arange(off, off + n) + ps, x)
        grown += (scale[1] > before).any().long()
        last[off:off + n], grown[off:off + n] = x, 0
        amax = torch.maximum(amax, x.abs().amax((0, 2)))
        assert torch.allclose(scale[1], amax / kv_quant.FP8_MAX)
        got = kv_quant.read_pages(cache, scale, torch.tensor([1]), torch.float32)[0]
        seen = ~torch.isnan(last[:, 0, 0])
        bound = _bound(last, scale[1][None, :, None], 1 + grown[:, None, None])
        assert ((got - last).abs() <= bound)[seen].all()
        assert (got[~seen] == 0).all()              # the page's never-written slots: zeros
    assert (scale[0] == 0).all()                    # the other page: untouched


@needs_interpreter
def test_graph_safe_write_equals_the_reference():
    P, ps, Hkv, D = 6, 4, 2, 16
    a, sa = _empty(P, ps, Hkv, D, seed=1)
    b, sb = a.clone(), sa.clone()
    g = torch.Generator().manual_seed(3)
    for rows, mag in ((torch.tensor([5, 6, 7, 8, 9, 20, 21]), 1.0),
                      (torch.tensor([4, 9, 22]), 8.0),          # grows pages 1 and 5
                      (torch.tensor([10, 11]), 0.1)):            # no growth
        x = torch.randn(len(rows), Hkv, D, generator=g) * mag
        kv_quant.write_graph_safe(a, sa, rows, x)
        kv_quant.write_reference(b, sb, rows, x)
        assert torch.equal(sa, sb)
        used = torch.nonzero(sa.amax(1) > 0).flatten()
        ya = kv_quant.read_pages(a, sa, used, torch.float32)
        yb = kv_quant.read_pages(b, sb, used, torch.float32)
        assert torch.equal(ya, yb)                  # same roundings (nearest-even e4m3)


def _fp8_pages(seed=0, P=7, ps=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(seed)
    kc, ks = _empty(P, ps, Hkv, D, seed)
    vc, vs = _empty(P, ps, Hkv, D, seed + 1)
    table = torch.tensor([[3, 1, 4], [0, 5, 2], [6, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 7, 3], dtype=torch.int32)
    slots = torch.cat([(table[b].long()[:, None] * ps + torch.arange(ps)).flatten()[:n]
                       for b, n in enumerate(lens.tolist())])
    mags = torch.logspace(-1, 1, len(slots))[:, None, None]
    kv_quant.write_reference(kc, ks, slots, torch.randn(len(slots), Hkv, D, generator=g) * mags)
    kv_quant.write_reference(vc, vs, slots, torch.randn(len(slots), Hkv, D, generator=g))
    return kc, vc, ks, vs, table, lens


def test_reference_reads_fp8_pages_as_their_dequantised_values():
    kc, vc, ks, vs, table, lens = _fp8_pages()
    q = torch.randn(6, 4, 16)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    got = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table, k_scale=ks,
                                                    v_scale=vs)
    kd = kv_quant.read_pages(kc, ks, torch.arange(kc.shape[0]), torch.float32)
    vd = kv_quant.read_pages(vc, vs, torch.arange(vc.shape[0]), torch.float32)
    want = paged_attention.paged_attention_reference(q, kd, vd, cu, lens, table)
    assert torch.allclose(got, want, atol=1e-6)
    with pytest.raises(ValueError, match="float8_e4m3fn caches come with k_scale and v_scale"):
        paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table)


@needs_interpreter
@pytest.mark.parametrize("mode", ["plain", "mass", "split"])
def test_triton_paged_attention_reads_fp8_pages_as_the_reference(mode):
    kc, vc, ks, vs, table, lens = _fp8_pages(seed=5)
    q = torch.randn(6, 4, 16)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    mass = mode == "mass"
    ref = paged_attention.paged_attention_reference(q, kc, vc, cu, lens, table, return_mass=mass,
                                                    k_scale=ks, v_scale=vs)
    extra = dict(max_seqlen_k=16, num_splits=2, block_n=4) if mode == "split" else {}
    got = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 3,
                                                 return_mass=mass, k_scale=ks, v_scale=vs,
                                                 **extra)
    for a, b in zip(got if mass else (got,), ref if mass else (ref,)):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)



@needs_interpreter
@pytest.mark.parametrize("split", [False, True])
def test_fp8_pages_with_fp16_dots_equal_the_reference(split):
    """``f16``: bf16 queries rounded to fp16 (exact in its range), the codes converted to fp16
    (exact), each tile's probabilities scaled by the keys' v scales over the tile's largest:
    the bf16 output equals the reference's to its rounding. (Through the interpreter only fp16
    converts e4m3 right: its bf16 conversion of the codes is wrong, so the kernel's bf16 dots
    are tested on the GPU.)"""
    kc, vc, ks, vs, table, lens = _fp8_pages(seed=7)
    vs[0] *= 1e-3                                 # one page of far smaller values in the tiles
    q = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    ref = paged_attention.paged_attention_reference(q.float(), kc, vc, cu, lens, table,
                                                    k_scale=ks, v_scale=vs)
    extra = dict(max_seqlen_k=16, num_splits=2, block_n=4) if split else dict(block_n=8)
    got = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 3, k_scale=ks,
                                                 v_scale=vs, f16=True, **extra)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="f16"):
        paged_attention.paged_attention_triton(q.float(), kc, vc, cu, lens, table, 3,
                                               k_scale=ks, v_scale=vs, f16=True)


@needs_interpreter
def test_fp16_dots_keep_precision_on_a_page_of_far_smaller_values():
    """The attention of request 0 sits on its first page (k scale x 100) whose values are 1e6
    times smaller than the next page's in the same tile: the probabilities are scaled per row
    before fp16, so its output keeps bf16's relative precision (scaled per tile, p x 1e-6 would
    fall into fp16's subnormals)."""
    kc, vc, ks, vs, table, lens = _fp8_pages(seed=3)
    first = int(table[0, 0])
    ks[first] *= 100.0
    vs[first] *= 1e-6
    q = (torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    ref = paged_attention.paged_attention_reference(q.float(), kc, vc, cu, lens, table,
                                                    k_scale=ks, v_scale=vs)[:3]
    got = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 3, k_scale=ks,
                                                 v_scale=vs, f16=True, block_n=8)[:3].float()
    top = ref.abs().amax(-1)                                             # [3 rows, 4 heads]
    small = top < 1e-4                       # (row, head)s that see the small page's values
    assert small.sum() >= 3, top
    err = (got - ref).abs().amax(-1)
    assert (err[small] <= 2e-2 * top[small]).all(), (err[small] / top[small]).max()


def test_pool_of_fp8_pages_holds_about_twice_the_tokens_of_bf16():
    budget = 64 << 20
    bf16 = PagedKVLayout.for_budget(budget, 32, 8, 128, 16, torch.bfloat16)
    fp8 = PagedKVLayout.for_budget(budget, 32, 8, 128, 16, FP8)
    assert fp8.scale_bytes_per_page == 2 * 32 * 8 * 4
    assert fp8.total_bytes <= budget and 1.9 < fp8.tokens / bf16.tokens <= 2.0
    assert allocate_kv_scales(bf16) is None
    assert allocate_kv_scales(PagedKVLayout(2, 3, 16, 4, 8, FP8)).shape == (2, 2, 3, 4)


def test_tier_records_carry_the_scales_and_their_checksum_covers_them():
    P, ps, Hkv, D, L = 10, 4, 2, 16, 3
    kv = torch.empty(L, 2, P, ps, Hkv, D, dtype=FP8)
    scales = torch.zeros(L, 2, P, Hkv)
    g = torch.Generator().manual_seed(0)
    for layer in range(L):
        for h in range(2):
            kv_quant.write_reference(kv[layer, h], scales[layer, h], torch.arange(P * ps),
                                     torch.randn(P * ps, Hkv, D, generator=g))
    off = KVOffloader(kv, 4, "bf16", group_pages=2, scales=scales)
    assert off.layout.dtype == FP8 and off.layout.scales == L * 2 * Hkv * 4
    blocks = [Block(bytes([i]) * 16) for i in range(3)]
    off.run([Store(b, p, i) for i, (b, p) in enumerate(zip(blocks, [1, 2, 3]))])
    off.drain()
    want_kv, want_s = kv.view(torch.uint8)[:, :, 1:4].clone(), scales[:, :, 1:4].clone()
    kv.view(torch.uint8)[:, :, 6:9] = 0
    scales[:, :, 6:9] = 9.0
    lay = off.layout
    off.host.view(1)[lay.payload + 5] ^= 0x40           # a bit of record 1's scales
    ok = off.load([0, 1, 2], [6, 7, 8], [b.key for b in blocks])
    assert ok == [True, False, True]
    assert torch.equal(kv.view(torch.uint8)[:, :, 6], want_kv[:, :, 0])      # bit-exact codes
    assert torch.equal(scales[:, :, 6], want_s[:, :, 0])                     # and scales
    assert torch.equal(kv.view(torch.uint8)[:, :, 8], want_kv[:, :, 2])
    assert (kv.view(torch.uint8)[:, :, 7] == 0).all() and (scales[:, :, 7] == 9.0).all()
    with pytest.raises(ValueError, match="kv_offload_dtype must be bf16 or fp8"):
        KVOffloader(kv, 4, "int8", scales=scales)
    with pytest.raises(ValueError, match="comes with its scales"):
        KVOffloader(kv, 4, "bf16")


def test_kernel_switches_read_0_or_1_and_name_a_bad_value(monkeypatch):
    """``_triton.env_switch`` (FLASH_DLLM_ATTN_FP8_F16, FLASH_DLLM_KV_FP8_HW_ROUND): the default
    when unset, 0 / 1 when set, one error naming the variable otherwise."""
    from flash_dllm.kernels._triton import env_switch
    name = "FLASH_DLLM_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env_switch(name, True, "off", "on") and not env_switch(name, False, "off", "on")
    monkeypatch.setenv(name, "0")
    assert not env_switch(name, True, "off", "on")
    monkeypatch.setenv(name, "1")
    assert env_switch(name, False, "off", "on")
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=f"{name} must be 0 \\(off\\) or 1 \\(on\\), got 'yes'"):
        env_switch(name, False, "off", "on")
