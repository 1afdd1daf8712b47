"""Lazy loading and its sentinel on the GPU (copy stream, Triton paged attention with mass on a
compacted block table), demo model: a sentinel that never fires changes no answer of a lazy run,
a firing one forces measuring steps, and every request finishes without error.

Run on the GPU box: ``python -m pytest -m gpu tests/gpu/test_lazy_load_gpu.py -q``.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import flash_dllm.cache.io.kv_overflow as ko
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.evals.tasks import get_suite

PROMPTS = [p.prompt for p in get_suite("arith").test_problems(8, seed=0)]
PARAMS = SamplingParams(max_tokens=64, block_length=32, cache="dual", decode="vanilla")
LAZY = dict(page_size=4, num_kv_pages=9, kv_overflow_gb=0.01, lazy_load_budget=0.5)


def _run(**cfg):
    llm = LLM(device="cuda", dtype="bfloat16", engine_config=EngineConfig(**LAZY, **cfg))
    outs = llm.generate(PROMPTS, PARAMS)
    assert all(o.finish_reason in ("stop", "length") for o in outs)
    return llm.engine, [o.text for o in outs]


def test_lazy_sentinel_on_the_gpu(monkeypatch):
    plain, ref = _run()
    monkeypatch.setattr(ko, "sentinel_overlap", lambda *a: 1.0)
    quiet, got = _run(lazy_load_sentinel=0.5)
    assert got == ref
    assert quiet.runner.overflow.stats["sentinel_checks"] > 0
    monkeypatch.setattr(ko, "sentinel_overlap", lambda *a: 0.0)
    loud, _ = _run(lazy_load_sentinel=0.5)
    st, st0 = loud.runner.overflow.stats, plain.runner.overflow.stats
    assert st["sentinel_triggers"] == st["sentinel_checks"] > 0
    assert st["measuring_steps"] > st0["measuring_steps"]
    assert loud.stats["sentinel_triggers"]["lazy_load"] == st["sentinel_triggers"]
    monkeypatch.undo()
    real, _ = _run(lazy_load_sentinel=1.0)
    assert 0 < real.runner.overflow.stats["sentinel_checks"]
