"""Multi-step on CUDA (``engine/multi_step.py``): steady fused steps queued as graph replays, each
output copied into pinned memory behind an event, the host applying step i while step i + 1 runs.
The same replays in the same order as one step per call: bitwise the same canvases.
``python -m pytest -m gpu tests/gpu/test_multi_step_gpu.py -q``."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from flash_dllm.bench.shapes import shape_config
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.models.loader import build_model

DEV = torch.device("cuda")


def _canvases(model, prompts, params, n, **cfg):
    eng = Engine(model, model.cfg, EngineConfig(multi_step=n, **cfg))
    eng.multi_step_seconds = float("inf")
    eng.runner.fused.first_capture = 1          # graphs at first sight: replayed at once
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    calls = []
    while eng.has_unfinished():
        before = eng.steps_run
        eng.step()
        calls.append(eng.steps_run - before)
    torch.cuda.synchronize()
    return [r.canvas.clone() for r in reqs], calls, eng


@pytest.mark.parametrize("cache,steps", [("dual", None), ("prefix", None), ("dual", 12)])
def test_multi_step_replays_equal_one_step_per_call(cache, steps):
    """A random model of the demo shape (vanilla commits one token a step: 32 steps a block,
    k > 1 with steps=12, an uneven schedule), four requests of different lengths."""
    model = build_model(shape_config("demo"), device=DEV, dtype="bfloat16", seed=0)
    prompts = [[(7 * i + j) % 90 + 5 for j in range(n)] for i, n in enumerate([5, 40, 17, 3])]
    params = [SamplingParams(max_tokens=m, block_length=32, cache=cache, decode="vanilla",
                             steps=m // 32 * (steps or 32), early_stop=False)
              for m in (64, 96, 64, 64)]
    ref, cref, _ = _canvases(model, prompts, params, 1, max_num_seqs=4)
    got, cgot, eng = _canvases(model, prompts, params, 4, max_num_seqs=4)
    assert max(cref) == 1 and max(cgot) == 4 and sum(cref) == sum(cgot)
    assert eng.stats["multi_step_calls"] > 0 and eng.runner.fused.stats["fused_replays"] > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_block_causal_multi_step(monkeypatch):
    """A random SDAR-shaped model cut to 4 layers, block 4, the exact block cache: each block's
    three steady steps in one call."""
    cfg = dict(shape_config("sdar-4b"), num_hidden_layers=4)
    model = build_model(cfg, device=DEV, dtype="bfloat16", seed=0)
    prompts = [[(5 * i + j) % 900 + 5 for j in range(n)] for i, n in enumerate([7, 11, 3])]
    params = [SamplingParams(max_tokens=32, block_length=4, cache="block", decode="vanilla",
                             steps=32, early_stop=False)] * 3
    ref, _, _ = _canvases(model, prompts, params, 1, max_num_seqs=4)
    got, cgot, _ = _canvases(model, prompts, params, 4, max_num_seqs=4)
    assert max(cgot) == 3
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [3, 12])
def test_fused_block_starts_on_cuda(batch):
    """``fused_first_steps`` (block-start steps of the block cache as fused graphs, their
    attention cut at block bounds), captured at first sight, against the general path's block
    starts: a random SDAR-shaped model cut to 4 layers in float32, requests in different phases
    of their blocks. The two paths' GEMMs run over different rows (last-bit differences can
    flip a near-tie of a random model): 95 % of the generated tokens equal at least."""
    cfg = dict(shape_config("sdar-4b"), num_hidden_layers=4)
    model = build_model(cfg, device=DEV, dtype="float32", seed=0)
    prompts = [[(5 * i + j) % 900 + 5 for j in range(5 + i)] for i in range(batch)]
    params = [SamplingParams(max_tokens=32, block_length=4, cache="block", decode="vanilla",
                             steps=32, early_stop=False)] * batch
    ref, _, _ = _canvases(model, prompts, params, 1, max_num_seqs=batch)
    got, _, eng = _canvases(model, prompts, params, 4, max_num_seqs=batch,
                            fused_first_steps=True)
    st = eng.runner.fused.stats
    assert st["fused_replays"] > 0 and st["fused_block_starts"] > 0, st
    same = sum(int((a == b).sum()) for a, b in zip(ref, got))
    total = sum(a.numel() for a in ref)
    assert same >= total - 0.05 * 32 * batch, (same, total)
