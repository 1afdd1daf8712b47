"""``deterministic`` on a GPU (issue 44): fixed-tile GEMMs and batch-invariant kernel launches
(``layers/batch_invariant``). A row's GEMM result alone equals the same row at any offset inside
any batch, bitwise; paged attention of one request alone equals it inside a batch; and the engine
answers requests that join a running batch at random steps exactly as alone (the CPU's
``tests/test_same_answer.py`` probe). Timing lines with ``-s``:
``python -m pytest -m gpu tests/gpu/test_deterministic_gpu.py -q -s``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm import LLM
from flash_dllm.bench.same_answer import batch_probe
from flash_dllm.kernels import fixed_gemm, paged_attention
from flash_dllm.kernels._triton import batch_invariant_launches

DEV = torch.device("cuda")


def _time(fn, reps=30) -> float:
    fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps * 1e3


@pytest.mark.parametrize("N,K", [(4096, 4096), (3 * 4096, 4096), (4096, 12288)])
def test_fixed_gemm_rows_are_batch_invariant(N, K):
    g = torch.Generator(device=DEV).manual_seed(N + K)
    w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(2048, K, device=DEV, generator=g).to(torch.bfloat16)
    full = fixed_gemm.fixed_gemm_triton(x, w)
    torch.testing.assert_close(full.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
    for lo, hi in [(0, 1), (5, 6), (100, 107), (1000, 1033), (2047, 2048), (17, 1500)]:
        assert torch.equal(fixed_gemm.fixed_gemm_triton(x[lo:hi].contiguous(), w), full[lo:hi])
    for M in (32, 2048):
        xm = x[:M].contiguous()
        fixed = _time(lambda: fixed_gemm.fixed_gemm_triton(xm, w))
        print(f"\nN={N} K={K} M={M}: fixed tiles {fixed:.1f} us, cuBLAS "
              f"{_time(lambda: F.linear(xm, w)):.1f} us")


def test_paged_attention_alone_equals_in_a_batch():
    g = torch.Generator(device=DEV).manual_seed(0)
    B, P, ps, Hkv, D, H = 16, 16 * 64, 16, 8, 128, 32
    kc = torch.randn(P, ps, Hkv, D, device=DEV, generator=g).to(torch.bfloat16)
    vc = torch.randn(P, ps, Hkv, D, device=DEV, generator=g).to(torch.bfloat16)
    table = torch.arange(P, device=DEV, dtype=torch.int32).view(B, 64)
    lens = torch.randint(100, 1024, (B,), device=DEV, generator=g).to(torch.int32)
    q = torch.randn(B * 32, H, D, device=DEV, generator=g).to(torch.bfloat16)
    cu = torch.arange(0, B * 32 + 1, 32, device=DEV, dtype=torch.int32)
    with batch_invariant_launches():
        full = paged_attention.paged_attention_triton(q, kc, vc, cu, lens, table, 32,
                                                      max_seqlen_k=1024)
        for b in (0, 7, 15):
            one = paged_attention.paged_attention_triton(
                q[32 * b:32 * b + 32].contiguous(), kc, vc, cu[:2].contiguous(),
                lens[b:b + 1].contiguous(), table[b:b + 1].contiguous(), 32, max_seqlen_k=1024)
            assert torch.equal(one, full[32 * b:32 * b + 32])


def test_engine_requests_joining_a_batch_answer_as_alone():
    det = batch_probe(LLM(device="cuda", deterministic=True), n=12, max_tokens=32)
    default = batch_probe(LLM(device="cuda"), n=12, max_tokens=32)
    print(f"\nanswers that differ from alone: deterministic {det['differ']} / 12, default "
          f"{default['differ']} / 12")
    assert det["differ"] == 0, det


def test_fp8_weights_with_deterministic_are_refused_on_a_gpu():
    with pytest.raises(ValueError, match="not batch-invariant on a GPU yet"):
        LLM(device="cuda", deterministic=True, quantization="fp8")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_only_quantized_engine_answers_as_alone(mode):
    """int8 / int4 weights (int4 as words, the GPU's layout) under ``deterministic``: one tile
    for any rows (``quant_gemm.op``), so requests joining a batch answer as alone."""
    det = batch_probe(LLM(device="cuda", deterministic=True, quantization=mode), n=12,
                      max_tokens=32)
    assert det["differ"] == 0, det
