"""The fused MoE on int8 / int4 experts (issue 40) against its PyTorch reference under the
interpreter: routing with padding rows, several K steps and column tiles, a group smaller than
the K tile, ids outside [0, E); the reference equals the fp experts' reference on the dequantized
weights; ``QuantExperts`` runs it."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import fused_moe as fm
from flash_dllm.kernels import fused_moe_quant as fq
from flash_dllm.kernels import quant_gemm
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and fq.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")
SMALL = {"BLOCK_M": 16, "GU_N": 16, "GU_K": 32, "DN_N": 16, "DN_K": 32}
# bf16: h is rounded to bf16 between the GEMMs, so an fp32 sum summed in another order may round
# one h element the other way (seen: one of 576 outputs 1.6 % of the scale off)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _problem(T, E, k, d, I, dtype, bits, group, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(dtype)
    gu = torch.randn(E, 2 * I, d, generator=g) / d ** 0.5
    dn = torch.randn(E, d, I, generator=g) / I ** 0.5
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    w = torch.rand(ids.shape, generator=g) + 0.1
    return (x, *quant_gemm.quantize(gu, bits, group), *quant_gemm.quantize(dn, bits, group),
            ids, w)


def _unpacked(q, s, bits, group):
    """The weight from the layout written out by hand: nibbles (low = even column), q * scale."""
    if bits == 4:
        q = torch.stack([(q & 0xF).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8], -1)
        q = q.flatten(-2)
    return q.float() * s.float().repeat_interleave(group, dim=-1)


def test_reference_is_the_fp_reference_on_the_unpacked_experts():
    """The CPU path (``op`` off CUDA) equals the fp experts' reference on weights unpacked
    independently of ``quant_gemm.dequantize``."""
    for bits in (8, 4):
        x, gq, gs, dq, ds, ids, w = _problem(7, 5, 2, 64, 32, torch.float32, bits, 32, seed=1)
        want = fm.fused_moe_reference(x, _unpacked(gq, gs, bits, 32), _unpacked(dq, ds, bits, 32),
                                      ids, w)
        assert torch.equal(fq.op(x, gq, gs, dq, ds, bits, ids, w), want)


@needs_interpreter
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("I,group", [(48, 16), (64, 32)])
def test_kernel_matches_reference(bits, dtype, I, group):
    # d 64: two K steps of 32; I 48: a ragged last column tile, group 16 < the K tile (each
    # weight dequantized before the dot); group 32 = the K tile: the scale after the dot
    x, gq, gs, dq, ds, ids, w = _problem(9, 6, 3, 64, I, dtype, bits, group, seed=bits)
    ids[0, 0] = -1                          # a non-local expert (expert parallelism): nothing
    ref = fq.fused_moe_quant_reference(x, gq, gs, dq, ds, bits, ids, w)
    got = fq.fused_moe_quant_triton(x, gq, gs, dq, ds, bits, ids, w, config=SMALL)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_match_reference(dtype):
    """e4m3 codes with one scale per row (``--quantization fp8``'s experts): the kernel against
    the fp experts' reference on ``codes * scale``, each part its own input as its group."""
    from flash_dllm.kernels import fp8_gemm
    g = torch.Generator().manual_seed(5)
    T, E, k, d, I = 9, 6, 3, 64, 48
    x = torch.randn(T, d, generator=g).to(dtype)
    gq, gs = fp8_gemm.quantize_weight(torch.randn(E, 2 * I, d, generator=g) / d ** 0.5)
    dq, ds = fp8_gemm.quantize_weight(torch.randn(E, d, I, generator=g) / I ** 0.5)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    w = torch.rand(ids.shape, generator=g) + 0.1
    ids[0, 0] = -1
    gs, ds = gs.unsqueeze(-1), ds.unsqueeze(-1)
    ref = fq.fused_moe_quant_reference(x, gq, gs, dq, ds, 8, ids, w)
    want = fm.fused_moe_reference(x, fp8_gemm.dequantize(gq, gs[..., 0], dtype),
                                  fp8_gemm.dequantize(dq, ds[..., 0], dtype), ids, w)
    assert torch.equal(ref, want)
    got = fq.fused_moe_quant_triton(x, gq, gs, dq, ds, 8, ids, w, config=SMALL)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


@needs_interpreter
def test_int4_needs_k_tiles_of_32():
    x, gq, gs, dq, ds, ids, w = _problem(3, 4, 2, 64, 32, torch.float32, 4, 32, seed=0)
    with pytest.raises(ValueError, match="int4 needs GU_K and DN_K >= 32"):
        fq.fused_moe_quant_triton(x, gq, gs, dq, ds, 4, ids, w, config={**SMALL, "GU_K": 16})


def test_bad_shapes_name_the_operand():
    x, gq, gs, dq, ds, ids, w = _problem(3, 4, 2, 64, 32, torch.float32, 4, 32, seed=0)
    with pytest.raises(ValueError, match=r"gu_q must be \[E, 2I, 32\]"):
        fq.op(x, gq[:, :, :16], gs, dq, ds, 4, ids, w)
    with pytest.raises(ValueError, match="bits must be one of"):
        fq.op(x, gq, gs, dq, ds, 3, ids, w)


@needs_interpreter
@pytest.mark.parametrize("parts", ["both", "gate_up", "down"])
def test_int4_words_experts_equal_bytes(parts):
    """Experts whose codes are int4 words (``quant_decode.interleave_int4``; one part or both,
    each read by its own launch): the kernel equals the reference on the byte layout, and the
    reference reads words as bytes."""
    from flash_dllm.kernels import quant_decode
    x, gq, gs, dq, ds, ids, w = _problem(9, 4, 2, 256, 128, torch.float32, 4, 128, seed=3)
    ids[0, 0] = -1
    words = {n: quant_decode.interleave_int4(q).view(torch.int32) for n, q in
             (("gate_up", gq), ("down", dq))}
    gw = words["gate_up"] if parts in ("both", "gate_up") else gq
    dw = words["down"] if parts in ("both", "down") else dq
    ref = fq.fused_moe_quant_reference(x, gq, gs, dq, ds, 4, ids, w)
    assert torch.equal(fq.fused_moe_quant_reference(x, gw, gs, dw, ds, 4, ids, w), ref)
    got = fq.fused_moe_quant_triton(x, gw, gs, dw, ds, 4, ids, w,
                                    config={**SMALL, "GU_K": 64, "DN_K": 64})
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_int4_words_experts_need_whole_tiles_in_their_groups():
    from flash_dllm.kernels import quant_decode
    x, gq, gs, dq, ds, ids, w = _problem(3, 4, 2, 256, 128, torch.float32, 4, 64, seed=0)
    words = quant_decode.interleave_int4(gq).view(torch.int32)
    with pytest.raises(ValueError, match="gu_q is int4 words"):
        fq.op(x, words, gs, dq, ds, 4, ids, w)
    with pytest.raises(ValueError, match="int4's layout, not int8"):
        fq.op(x, words, gs, dq, ds, 8, ids, w)
    with pytest.raises(ValueError, match="hold one code"):       # signed bytes are not nibbles
        fq.op(x, gq, gs, dq.view(torch.int8), ds, 4, ids, w)
