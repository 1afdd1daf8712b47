"""Programmatic dependent launch (``kernels/_triton.pdl_args``) on CUDA: a chain of kernels, each
reading what the one before it wrote a moment earlier (RMSNorm with its residual, the skinny GEMM
split over K and with SwiGLU's fused activation, the W4A16 GEMM, ``silu_mul``), gives bitwise the
same answers launched with PDL as without, eagerly and replayed in a CUDA graph. A kernel that
read its input before waiting for the previous one would differ here (it would read the last
layer's values). PDL is opt-in (``FLASH_DLLM_PDL=1``) until this test and its A/B have run on
a GPU. ``python -m pytest -m gpu tests/gpu/test_pdl_gpu.py -q``."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines deselect or skip
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.evals.tasks import get_suite
from flash_dllm.kernels import _triton, quant_gemm, rmsnorm, silu_mul, skinny_gemm

DEV = torch.device("cuda")
D, I, LAYERS = 1024, 2048, 6


def _weights():
    g = torch.Generator(device=DEV).manual_seed(0)
    mk = lambda *s: (torch.randn(*s, device=DEV, generator=g) * 0.03).to(torch.bfloat16)
    layers = []
    for _ in range(LAYERS):
        down = mk(D, I)
        q, s = quant_gemm.quantize(mk(D, D), 4, 128)
        layers.append((mk(D, D), mk(2 * I, D), down, (q, s), torch.ones(D, device=DEV,
                                                                          dtype=torch.bfloat16)))
    return layers


def _chain(x, layers):
    h, res = x, torch.zeros_like(x)
    for w_o, w_gu, w_down, (q, s), norm in layers:
        y, res = rmsnorm.op(h, norm, 1e-6, res)
        y = skinny_gemm.skinny_triton(y, w_o, None, False, {"SPLIT_K": 4, "BLOCK_N": 32})
        a = skinny_gemm.skinny_triton(y, w_gu, None, True, {"SPLIT_K": 2, "BLOCK_N": 32})
        b = silu_mul.op(torch.cat([y, y], dim=-1))
        h = skinny_gemm.skinny_triton(a, w_down, None, False, {"SPLIT_K": 1, "BLOCK_N": 32})
        h = h + quant_gemm.weight_only_triton(b, q, s, None, 4)
    return h


def _run(monkeypatch, mode: int, layers, x):
    monkeypatch.setenv(_triton.PDL_ENV, str(mode))
    assert _triton.pdl_mode(x) == (mode if torch.cuda.get_device_capability()[0] >= 9 else 0)
    eager = _chain(x, layers)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(x, layers)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, layers)
    replays = []
    for _ in range(5):
        graph.replay()
        replays.append(out.clone())
    torch.cuda.synchronize()
    return eager, replays


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("rows", [4, 32])
def test_pdl_chain_is_bitwise_the_plain_launch(monkeypatch, rows, mode):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    layers = _weights()
    x = (torch.randn(rows, D, device=DEV) * 0.5).to(torch.bfloat16)
    plain, plain_replays = _run(monkeypatch, 0, layers, x)
    eager, replays = _run(monkeypatch, mode, layers, x)
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(eager, plain)
    for r in plain_replays + replays:
        assert torch.equal(r, plain)


def test_prefetch_off_is_bitwise_the_same(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL (and so the prefetch) needs sm_90+")
    layers = _weights()
    x = (torch.randn(4, D, device=DEV) * 0.5).to(torch.bfloat16)
    monkeypatch.setenv(_triton.PDL_ENV, "1")
    monkeypatch.setenv("FLASH_DLLM_PREFETCH_MB", "0")
    a = _chain(x, layers)
    monkeypatch.setenv("FLASH_DLLM_PREFETCH_MB", "64")
    assert torch.equal(_chain(x, layers), a)


def _answers(monkeypatch, pdl: str, env: dict, **cfg) -> list[str]:
    monkeypatch.setenv(_triton.PDL_ENV, pdl)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    llm = LLM(device="cuda", dtype="bfloat16", engine_config=EngineConfig(max_num_seqs=8, **cfg))
    if llm.engine.runner.fused is not None:            # (None: eager steps)
        llm.engine.runner.fused.first_capture = 1    # graphs captured at first sight
    prompts = [p.prompt for p in get_suite("arith").test_problems(24, seed=0)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, block_length=32))
    llm.close()
    return [o.text for o in outs]


@pytest.mark.parametrize("cfg,env", [({}, {}), ({"cuda_graphs": False}, {}),
                                     ({"kv_cache_dtype": "fp8"}, {})])
@pytest.mark.parametrize("mode", ["1", "2"])
def test_engine_answers_are_the_same_with_pdl(monkeypatch, cfg, env, mode):
    """The whole engine (the demo model: fused q/k/v + RoPE + page write, paged attention with
    its split merge, norms, SwiGLU; fp8 pages: the four quantising write kernels), CUDA graphs
    and fused steps or eager: the same answers with PDL as without."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    assert _answers(monkeypatch, mode, env, **cfg) == _answers(monkeypatch, "0", env, **cfg)
