"""The study kernels at real shapes, bf16, on CUDA (moved from ``tests/gpu/test_kernels_gpu.py``).

Run on a GPU machine: ``python3 -m pytest -m gpu benchmarks/studies -q`` (``benchmarks/run_gpu.sh``
group ``tests`` does). Acceptance as for the engine's kernels: relative error <= 1e-2 (bf16).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import confidence  # noqa: E402
import skinny_gemm  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
MODELS = {"llada": dict(d=4096, V=126464, mask=126336),
          "dream": dict(d=3584, V=152064, mask=151666)}


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, seed, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), device=DEV) * scale).to(dtype)


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("N", [1, 32, 300])
@pytest.mark.parametrize("model", ["llada", "dream"])
def test_confidence(N, model):
    cfg = MODELS[model]
    d, V, mask = cfg["d"], cfg["V"], cfg["mask"]
    h = _randn(N, d, seed=10)
    w = _randn(V, d, seed=11, scale=0.05)
    w[mask] = (h.float().mean(0) * 4 / h.float().mean(0).norm()).to(BF16)  # MASK wins most rows
    tok, conf, ent = confidence.op(h, w, mask)
    logits = h.float() @ w.float().t()                 # [N, V]
    ref_tok, ref_conf, ref_ent = confidence.confidence_reference(h, w, mask)
    assert not (tok == mask).any()
    masked = logits.clone()
    masked[:, mask] = float("-inf")
    best = masked.max(-1).values
    torch.testing.assert_close(masked.gather(1, tok[:, None])[:, 0], best, rtol=0, atol=1e-3)
    assert (tok == ref_tok).float().mean().item() >= 0.98
    torch.testing.assert_close(conf, ref_conf, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-3, atol=1e-3)
    # and without exclusion the planted MASK column is the argmax where it wins in the reference
    tok2, _, _ = confidence.op(h, w)
    assert ((tok2 == mask) == (logits.argmax(-1) == mask)).float().mean().item() >= 0.98


def test_confidence_captures_in_cuda_graph():
    """No host syncs: the kernel replays from a CUDA graph with fresh inputs."""
    h = _randn(64, 4096, seed=41)
    w = _randn(4096, 4096, seed=42, scale=0.05)
    confidence.op(h, w, 7)                                     # compile + warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = confidence.op(h, w, 7)
    h.copy_(_randn(64, 4096, seed=44))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, confidence.op(h, w, 7)):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("M", [1, 32, 64])
def test_skinny_gemm(M):
    x = _randn(M, 4096, seed=60)
    w = _randn(12288, 4096, seed=61, scale=0.02)
    assert _rel(skinny_gemm.skinny_gemm(x, w), F.linear(x, w)) < 1e-2
