"""The skinny GEMM (``kernels/skinny_gemm``) against its PyTorch math under the Triton interpreter:
plain, with a bias, split over K (the last slice adds the partials), SwiGLU's fused activation,
ragged shapes; and its dispatch: only where a tuned entry says so, never in a deterministic mode,
under autograd, on the CPU or past ``MAX_ROWS``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels import silu_mul, skinny_gemm, tuned_configs
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and skinny_gemm.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")


def _rand(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("M,N,K,cfg", [
    (4, 96, 256, {"BLOCK_N": 32, "BLOCK_K": 64}),                  # whole tiles, no split
    (5, 80, 200, {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}),    # ragged N and K, split
    (19, 48, 512, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4}),  # 2 row tiles
])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(M, N, K, cfg, bias):
    x = _rand(M, K, seed=1, dtype=torch.bfloat16)
    w = _rand(N, K, seed=2, dtype=torch.bfloat16, scale=0.05)
    b = _rand(N, seed=3, dtype=torch.bfloat16) if bias else None
    ref = (x.float() @ w.float().t() + (b.float() if bias else 0)).to(torch.bfloat16)
    for _ in range(2):                           # the split's counters are re-armed
        got = skinny_gemm.skinny_triton(x, w, b, False, cfg)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)


@needs_interpreter
@pytest.mark.parametrize("split", [1, 4])
def test_silu_gate_up_matches_the_unfused_pair(split):
    """One launch: gate and up tiles, each rounded to bf16, then silu_mul's math."""
    M, I, K = 6, 72, 384
    x = _rand(M, K, seed=4, dtype=torch.bfloat16)
    w = _rand(2 * I, K, seed=5, dtype=torch.bfloat16, scale=0.05)
    gate_up = (x.float() @ w.float().t()).to(torch.bfloat16)
    ref = silu_mul.silu_mul_reference(gate_up)
    got = skinny_gemm.skinny_triton(x, w, None, True,
                                    {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split})
    assert got.shape == (M, I)
    torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(skinny_gemm.silu_gate_up_reference(x.float(), w.float()),
                               F.silu((x.float() @ w.float().t())[:, :I])
                               * (x.float() @ w.float().t())[:, I:])


def test_bad_input_names_the_field():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight must be \\[N, 64\\]"):
        skinny_gemm.skinny_triton(x, torch.zeros(8, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="silu wants"):
        skinny_gemm.skinny_triton(x, torch.zeros(7, 64, dtype=torch.bfloat16), silu=True)
    with pytest.raises(ValueError, match="BLOCK_N = 24"):
        skinny_gemm.check_tile({"BLOCK_N": 24}, "t")


def test_dispatch_is_cublas_without_a_tuned_entry(monkeypatch):
    """On the CPU (and on a device without a sweep's entry, or past MAX_ROWS, or in a
    deterministic mode) ``linear`` is F.linear and ``silu_gate_up`` None."""
    x = _rand(4, 64, seed=6, dtype=torch.bfloat16)
    w = _rand(32, 64, seed=7, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(skinny_gemm.linear(x, w), F.linear(x, w))
        assert skinny_gemm.silu_gate_up(x, w) is None
    # a CUDA-looking call: the table decides; an empty entry means cuBLAS
    monkeypatch.setattr(skinny_gemm, "_device_name", lambda d: "Fake GPU")
    table = {"N32_K64": {"8": {"BLOCK_N": 32}, "32": {}}}
    monkeypatch.setattr(tuned_configs, "_load", lambda *a: [table])
    skinny_gemm._tuned.cache_clear()
    skinny_gemm._has_tables.cache_clear()

    class Cuda:                 # the few attributes tuned_config reads
        is_cuda, device, dtype = True, torch.device("cuda", 0), torch.bfloat16

        def __init__(self, rows):
            self.shape = (rows, 64)

        def dim(self):
            return 2
    with torch.no_grad():
        assert skinny_gemm.tuned_config(Cuda(4), 32, False) == {"BLOCK_N": 32}
        assert skinny_gemm.tuned_config(Cuda(16), 32, False) is None       # cuBLAS won
        assert skinny_gemm.tuned_config(Cuda(33), 32, False) is None       # > MAX_ROWS
        assert skinny_gemm.tuned_config(Cuda(4), 32, True) is None         # no silu entry
    assert skinny_gemm.tuned_config(Cuda(4), 32, False) is None            # autograd on
    monkeypatch.setattr(tuned_configs, "_load", lambda *a: [])              # no sweep here
    skinny_gemm._tuned.cache_clear()
    skinny_gemm._has_tables.cache_clear()
    with torch.no_grad():
        assert skinny_gemm.tuned_config(Cuda(4), 32, False) is None
    skinny_gemm._has_tables.cache_clear()
