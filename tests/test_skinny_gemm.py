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


@needs_interpreter
@pytest.mark.parametrize("M,cfg_o,cfg_gu", [
    (4, {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2}, {"BLOCK_N": 16, "BLOCK_K": 32}),
    (19, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32}, {"BLOCK_N": 32, "BLOCK_K": 64,
                                                          "SPLIT_K": 2}),
])
def test_residual_add_then_normed_input_equal_the_unfused_chain(M, cfg_o, cfg_gu):
    """The output projection with the residual add in its epilogue (``residual``: out + r and
    the per-tile sums of squares) feeding the gate/up GEMM that norms its input on load
    (``norm_in``) against the unfused chain: GEMM, ``rmsnorm`` (add + norm), GEMM + SwiGLU.
    In fp16: the interpreter truncates in-kernel fp32 -> bf16 casts (torch rounds to nearest
    even), its fp16 casts round as torch's; the GPU test runs bf16."""
    from flash_dllm.kernels import rmsnorm
    dt = torch.float16
    d, K, inter = 80, 96, 48                       # ragged against the tiles
    a = _rand(M, K, seed=11, dtype=dt)
    wo = _rand(d, K, seed=12, dtype=dt, scale=0.1)
    r = _rand(M, d, seed=13, dtype=dt)
    g = (1 + 0.1 * _rand(d, seed=14)).to(dt)
    wgu = _rand(2 * inter, d, seed=15, dtype=dt, scale=0.1)
    h, sums = skinny_gemm.skinny_triton(a, wo, None, False, cfg_o, residual=r)
    o = skinny_gemm.skinny_triton(a, wo, None, False, cfg_o)
    normed, h_ref = rmsnorm.rmsnorm_reference(o, g, 1e-6, r)
    assert torch.equal(h, h_ref)                   # the same rounded product, the same add
    assert sums.shape == (M, -(-d // cfg_o["BLOCK_N"])) and sums.dtype == torch.float32
    torch.testing.assert_close(sums.sum(1), h.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
    got = skinny_gemm.skinny_triton(h, wgu, None, True, cfg_gu, norm_in=(sums, g, 1e-6))
    want = skinny_gemm.skinny_triton(normed, wgu, None, True, cfg_gu)
    assert (got != want).float().mean().item() < 0.02        # the mean square's sum order
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    plain = skinny_gemm.skinny_triton(h, wgu[:inter], None, False, cfg_gu,
                                      norm_in=(sums, g, 1e-6))
    want = skinny_gemm.skinny_triton(normed, wgu[:inter], None, False, cfg_gu)
    assert (plain != want).float().mean().item() < 0.02


@needs_interpreter
@pytest.mark.parametrize("M,cfg", [(4, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2}),
                                   (19, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64})])
def test_norm_out_is_the_add_and_norm_of_the_sum(M, cfg):
    """``norm_out``: the GEMM adds the residual and the last column tile of each row block
    norms the sums (the next layer's input) against ``rmsnorm`` of the same sum; twice (the
    row-block counters are re-armed). fp16, as above."""
    from flash_dllm.kernels import rmsnorm
    dt = torch.float16
    d, K = 80, 96
    x = _rand(M, K, seed=21, dtype=dt)
    w = _rand(d, K, seed=22, dtype=dt, scale=0.1)
    r = _rand(M, d, seed=23, dtype=dt)
    g = (1 + 0.1 * _rand(d, seed=24)).to(dt)
    for _ in range(2):
        h, sums, normed = skinny_gemm.skinny_triton(x, w, None, False, cfg, residual=r,
                                                    norm_out=(g, 1e-6))
        want, h_ref = rmsnorm.rmsnorm_reference(skinny_gemm.skinny_triton(x, w, None, False,
                                                                          cfg), g, 1e-6, r)
        assert torch.equal(h, h_ref)
        assert (normed != want).float().mean().item() < 0.02
        torch.testing.assert_close(normed.float(), want.float(), rtol=2e-3, atol=2e-3)


@needs_interpreter
def test_residual_and_norm_in_refuse_bad_shapes():
    x = _rand(4, 64, seed=1, dtype=torch.bfloat16)
    w = _rand(32, 64, seed=2, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual must be"):
        skinny_gemm.skinny_triton(x, w, residual=torch.zeros(4, 31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="norm_in must be"):
        skinny_gemm.skinny_triton(x, w, norm_in=(torch.zeros(4, 2), torch.ones(63), 1e-6))
    with pytest.raises(ValueError, match="norm_out must be"):
        skinny_gemm.skinny_triton(x, w, norm_out=(torch.ones(32, dtype=torch.bfloat16), 1e-6))


@needs_interpreter
def test_model_takes_the_fused_add_norm_where_both_gemms_are_skinny(monkeypatch):
    """A tiny SDAR model's hidden states with the adds and norms inside the GEMMs around them
    (``layers/mlp.add_norm_mlp``: o_proj + residual, gate/up norming its input, down + add +
    the next layer's norm; every GEMM given skinny tiles) against the same model with the add +
    norm kernel between them (fp16: see above). Once per layer."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from family_checkpoints import tiny_sdar_config

    from flash_dllm.layers import mlp as mlp_mod
    from flash_dllm.layers.attention import DenseContext
    from flash_dllm.models.loader import build_model
    model = build_model(tiny_sdar_config(), "cpu", torch.float16, seed=3)
    for layer in model.layers:
        layer.attn.fuse()
        layer.mlp.fuse()
    monkeypatch.setattr(skinny_gemm, "tuned_config",
                        lambda x, n, silu: {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2})
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(8)[None]
    calls = []
    fused_fn = mlp_mod.add_norm_mlp

    def counted(*a):
        out = fused_fn(*a)
        calls.append(out is not None)
        return out
    monkeypatch.setattr("flash_dllm.models.transformer.add_norm_mlp", counted)
    kernel, norm_outs = skinny_gemm.skinny_triton, []

    def counted_kernel(*a, **kw):
        norm_outs.append(kw.get("norm_out") is not None)
        return kernel(*a, **kw)
    monkeypatch.setattr(skinny_gemm, "skinny_triton", counted_kernel)
    with torch.no_grad():
        fused = model.hidden(ids, pos, DenseContext())
        assert calls == [True] * len(model.layers)
        assert sum(norm_outs) == len(model.layers) - 1      # the last layer has no next norm
        monkeypatch.setattr("flash_dllm.models.transformer.add_norm_mlp", lambda *a: None)
        plain = model.hidden(ids, pos, DenseContext())
    torch.testing.assert_close(fused.float(), plain.float(), rtol=1e-2, atol=1e-2)
