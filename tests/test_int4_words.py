"""int4 words (``quant_decode.interleave_int4``, ``quant_gemm``'s read ``JOIN = 3``, issue 40): the
layout is a permutation of the packed int4 bytes that round-trips, each word holds the columns
its docstring says, the GPU's bit recipe decodes every nibble of every word to ``q``, and the
weight-only kernel reading the words equals the reference on the canonical layout (the
interpreter: split, transposed dots, bias, rows not a multiple of the tile), as does the
dequantize kernel reading them. The engine stores int4 linears as words on a GPU; the CPU keeps
bytes; ``FLASH_DLLM_INT4_WORDS`` = 0 / 1 forces either (findings/quantization.md)."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.kernels import quant_decode, quant_gemm
from flash_dllm.kernels._triton import HAS_TRITON


def _codes(n, k, seed=0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quant_gemm.quantize(w, 4, 128)


def test_the_layout_round_trips_and_words_hold_their_columns():
    q, _ = _codes(6, 384)
    words = quant_decode.interleave_int4(q)
    assert words.shape == q.shape and words.dtype == torch.uint8
    assert torch.equal(quant_decode.deinterleave_int4(words), q)
    u = (quant_gemm.unpack(q, 4) + 8).tolist()                      # codes, column order
    b = words.tolist()
    for n in range(6):
        for t in range(3):                                           # K tiles of 128
            for w in range(16):
                word = int.from_bytes(bytes(b[n][(t * 16 + w) * 4:(t * 16 + w) * 4 + 4]),
                                      "little")
                got = [(word >> (4 * i)) & 0xF for i in range(8)]
                assert got == [u[n][t * 128 + w + 16 * i] for i in range(8)]


def test_the_layout_needs_whole_tiles():
    q, _ = _codes(2, 128)
    with pytest.raises(ValueError, match="multiple of the tile 128"):
        quant_decode.interleave_int4(q[:, :32])


def test_the_gpu_recipe_decodes_every_nibble_of_every_word():
    g = torch.Generator().manual_seed(3)
    a = torch.randint(-2**31, 2**31, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    b = torch.randint(-2**31, 2**31, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    a[:4] = torch.tensor([0, -1, 0x12345678, -0x76543211], dtype=torch.int32)
    pairs = quant_decode.int4_words_reference(a, b)
    for i, (lo, hi) in enumerate(pairs):
        for word, got in ((a, lo), (b, hi)):
            want = ((word.to(torch.int64) >> (4 * i)) & 0xF) - 8
            assert torch.equal(got.float(), want.float()), i


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("M,N,K,split,swap,bias", [
    (5, 40, 256, 1, 0, False), (5, 40, 256, 2, 1, True), (32, 64, 512, 4, 1, False),
    (3, 96, 384, 1, 0, True)])
def test_the_kernel_reading_words_equals_the_reference(M, N, K, split, swap, bias):
    g = torch.Generator().manual_seed(M + N + K)
    q, s = _codes(N, K, seed=K)
    x = torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    want = quant_gemm.weight_only_reference(x, q, s, b, 4)
    cfg = {"BLOCK_M": 16 if M <= 16 else 32, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": split,
           "JOIN": 3, "SWAP": swap, "num_warps": 4, "num_stages": 1}
    got = quant_gemm.weight_only_triton(x, quant_decode.interleave_int4(q), s, b, 4, cfg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_words_are_a_layout_not_a_tile():
    q, s = _codes(32, 256)
    x = torch.randn(4, 256)
    for cfg, group in (({"BLOCK_K": 64, "JOIN": 3}, 128), ({"BLOCK_K": 128, "JOIN": 3}, 64)):
        qq, ss = quant_gemm.quantize(torch.randn(32, 256), 4, group)
        with pytest.raises(ValueError, match="JOIN=3 reads int4 words"):
            quant_gemm.weight_only_triton(x, qq, ss, None, 4, cfg)
    # a tuned file never names it (the stored bytes decide the read, not the tiles)
    with pytest.raises(ValueError, match="JOIN = 3 is not a valid tile"):
        quant_gemm.check_tile({"JOIN": 3}, "tuned")


def test_an_int4_linear_stored_as_words_computes_as_bytes(monkeypatch):
    """Words (forced here: ``FLASH_DLLM_INT4_WORDS=1``): a linear of whole tiles holds the codes and
    computes (and dequantizes) as the byte layout does; narrow groups, other widths and int8
    keep bytes; MoE experts hold words unless ``EXPERT_WORDS`` is off."""
    from torch import nn

    from flash_dllm.layers import quant

    monkeypatch.setenv(quant.WORDS_ENV, "1")
    torch.manual_seed(0)
    lin = nn.Linear(256, 96, bias=True)
    words = quant.QuantLinear(lin, quant.make_method("int4", 128))
    plain = quant.QuantLinear(lin, quant.IntMethod(4, 128, words=False))
    # int32 words [N, K / 8]: the stored tensor says its layout
    assert words.qweight.dtype == torch.int32 and words.qweight.shape == (96, 32)
    assert torch.equal(words.qweight.view(torch.uint8), quant_decode.interleave_int4(plain.qweight))
    assert torch.equal(words.dequantized(torch.float32), plain.dequantized(torch.float32))
    x = torch.randn(3, 5, 256)
    torch.testing.assert_close(words(x), plain(x), rtol=0, atol=0)
    for mode, group, width in (("int4", 64, 256), ("int4", 32, 96), ("int8", 128, 256)):
        w = nn.Linear(width, 32)
        kept = quant.QuantLinear(w, quant.make_method(mode, group))
        assert torch.equal(kept.qweight, quant_gemm.quantize(w.weight, int(mode[3:]), group)[0])
    gate_up, down = torch.randn(2, 256, 256), torch.randn(2, 256, 128)   # [E, 2I, d], [E, d, I]
    experts = quant.QuantExperts(gate_up, down, quant.make_method("int4", 128))
    for part, w in (("gate_up", gate_up), ("down", down)):
        assert torch.equal(getattr(experts, f"{part}_qweight").view(torch.uint8),
                           quant_decode.interleave_int4(quant_gemm.quantize(w, 4, 128)[0]))
    x, ids = torch.randn(5, 256), torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1], [0, 1]])
    mix = torch.rand(5, 2)
    plain = quant.QuantExperts(gate_up, down, quant.IntMethod(4, 128, words=False))
    torch.testing.assert_close(experts(x, ids, mix), plain(x, ids, mix), rtol=0, atol=0)
    monkeypatch.setattr(quant, "EXPERT_WORDS", False)
    experts = quant.QuantExperts(gate_up, down, quant.make_method("int4", 128))
    assert experts.gate_up_qweight.dtype == experts.down_qweight.dtype == torch.uint8


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_op_dispatches_words_as_bytes_on_every_path(monkeypatch):
    """``quant_gemm.op`` on int32 words (CUDA dispatch forced onto the interpreter): the skinny
    word read, the dequantized GEMM from ``DEQUANT_MIN_ROWS`` rows and the deterministic tile
    all give the byte layout's values."""
    from flash_dllm.kernels._triton import batch_invariant_launches

    monkeypatch.setattr(quant_gemm, "use_triton", lambda *t: True)
    monkeypatch.setattr(quant_gemm, "DEQUANT_MIN_ROWS", 8)
    q, s = _codes(48, 256, seed=7)
    words = quant_decode.interleave_int4(q).view(torch.int32)
    g = torch.Generator().manual_seed(8)
    bias = torch.randn(48, generator=g)
    for rows in (3, 12):                           # skinny kernel / dequantized GEMM
        x = torch.randn(rows, 256, generator=g)
        torch.testing.assert_close(quant_gemm.op(x, words, s, bias, 4),
                                   quant_gemm.weight_only_reference(x, q, s, bias, 4),
                                   rtol=1e-4, atol=1e-4)
        with batch_invariant_launches():
            torch.testing.assert_close(quant_gemm.op(x, words, s, bias, 4),
                                       quant_gemm.op(x, q, s, bias, 4), rtol=1e-4, atol=1e-4)


def test_words_are_the_gpu_layout_and_the_variable_forces_either(monkeypatch):
    """Unforced, an int4 weight on a GPU is stored as words and one on the CPU as bytes (its
    reference would de-interleave every call); ``FLASH_DLLM_INT4_WORDS`` 0 / 1 forces either;
    int8 never. (A stand-in says "cuda": the decision reads only the weight's device and shape.)"""
    from types import SimpleNamespace

    from flash_dllm.layers import quant

    def weight(kind):
        return SimpleNamespace(device=torch.device(kind), is_cuda=kind == "cuda",
                               shape=(64, 256), dim=lambda: 2)

    monkeypatch.delenv(quant.WORDS_ENV, raising=False)
    assert quant.IntMethod(4, 128)._words(weight("cuda"))
    assert not quant.IntMethod(4, 128)._words(weight("cpu"))
    assert not quant.IntMethod(4, 64)._words(weight("cuda"))          # a group inside a tile
    assert not quant.IntMethod(8, 128)._words(weight("cuda"))
    monkeypatch.setenv(quant.WORDS_ENV, "0")
    assert not quant.IntMethod(4, 128)._words(weight("cuda"))
    monkeypatch.setenv(quant.WORDS_ENV, "1")
    assert quant.IntMethod(4, 128)._words(weight("cpu"))
    assert not quant.IntMethod(8, 128)._words(weight("cpu"))
    monkeypatch.setenv(quant.WORDS_ENV, "true")
    with pytest.raises(ValueError, match="FLASH_DLLM_INT4_WORDS must be 0 .* or 1 .*'true'"):
        quant.IntMethod(4, 128)
    monkeypatch.delenv(quant.WORDS_ENV)
    from flash_dllm.kernels import _triton
    monkeypatch.setattr(_triton, "DISABLE", True)             # no Triton: bytes on a GPU too
    assert not quant.IntMethod(4, 128)._words(weight("cuda"))


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("N, K, group", [(40, 256, 128), (33, 512, 256), (8, 384, 128)])
def test_the_dequantize_kernel_reads_words(N, K, group):
    """``dequantize_triton`` on int32 words (the many-row path's copy): the reference's values
    in float32, and the byte kernel's bits in bf16 (the interpreter)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    q, s = quant_gemm.quantize(w, 4, group)
    words = quant_decode.interleave_int4(q).view(torch.int32)
    assert torch.equal(quant_decode.dequantize_triton(words, s, 4, torch.float32),
                       quant_decode.dequantize(q, s, 4, torch.float32))
    assert torch.equal(quant_decode.dequantize_triton(words, s, 4, torch.bfloat16),
                       quant_decode.dequantize_triton(q, s, 4, torch.bfloat16))
    with pytest.raises(ValueError, match="int4's layout"):
        quant_decode.dequantize_triton(words, s, 8, torch.float32)
    with pytest.raises(ValueError, match="integer codes"):       # e4m3 codes are not integers
        quant_decode.dequantize_triton(torch.zeros(N, K, dtype=torch.float8_e4m3fn),
                                       torch.ones(N, 1), 8, torch.float32)
