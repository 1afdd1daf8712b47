"""The skinny bf16 GEMM on CUDA (``kernels/skinny_gemm``) against cuBLAS at SDAR-4B's batch-1 block-4
shapes (4 rows) and LLaDA-8B's (32 rows): plain, split over K, SwiGLU's fused activation against
cuBLAS + ``silu_mul``; replayed in a CUDA graph. ``python -m pytest -m gpu
tests/gpu/test_skinny_gemm_gpu.py -q``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.kernels import silu_mul, skinny_gemm

DEV = torch.device("cuda")


@pytest.mark.parametrize("M,N,K,silu", [(4, 6144, 2560, False), (4, 9728, 2560, True),
                                        (4, 2560, 9728, False), (32, 12288, 4096, True),
                                        (7, 4096, 4096, False)])
@pytest.mark.parametrize("split", [1, 4])
def test_skinny_matches_cublas(M, N, K, silu, split):
    g = torch.Generator(device=DEV).manual_seed(M + N + K)
    x = torch.randn(M, K, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * N if silu else N, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    ref = silu_mul.op(F.linear(x, w)) if silu else F.linear(x, w)
    cfg = {"BLOCK_M": 16 if M <= 16 else 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": split}
    got = skinny_gemm.skinny_triton(x, w, None, silu, cfg)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # bf16 outputs: at most a rounding apart, rarely (fp32 sums in another order)
    assert (got != ref).float().mean().item() < 0.05


def test_skinny_replays_in_a_graph_with_a_bias():
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(4, 2560, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(6144, 2560, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    b = torch.randn(6144, device=DEV, generator=g).to(torch.bfloat16)
    cfg = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2}
    first = skinny_gemm.skinny_triton(x, w, b, False, cfg)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        skinny_gemm.skinny_triton(x, w, b, False, cfg)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm.skinny_triton(x, w, b, False, cfg)
    for _ in range(10):
        graph.replay()
    assert torch.equal(out, first)
    torch.testing.assert_close(first.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)
