"""Fused block-start steps (``EngineConfig.fused_first_steps``, ``CacheMode.fusable_first``): on the
exact block cache a block's first step (the block before with its final tokens, and the new
block's first proposal) runs as a fused step too, its attention cut at block bounds
(``layers/paged_index.split_blocks``) as the general path cuts it. Run eagerly on the CPU against
the general path: the same canvases, forwards and block forwards, with requests in different
phases of their blocks sharing a fused step (some at a block start, some steady), every decode
policy that has a fused form, and multi-step on top. tests/gpu checks the captured graphs."""
from __future__ import annotations

import pytest
from conftest import write_tiny_llada2_checkpoint
from family_checkpoints import one_torch_thread  # noqa: F401 (autouse)
from family_checkpoints import tiny_sdar_config, write_family_checkpoint

from flash_dllm import LLM
from flash_dllm.config import EngineConfig, SamplingParams

# prompt lengths of different phases mod 4 (SDAR's block): blocks end at different steps
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 24)), [40, 41], [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module", params=["sdar", "llada2"])
def folder(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "ckpt"
    if request.param == "sdar":
        return write_family_checkpoint(d, tiny_sdar_config(), seed=12), 4
    return write_tiny_llada2_checkpoint(d, seed=11), 32


def _run(folder, params, prompts=PROMPTS, **cfg):
    llm = LLM(str(folder), dtype="float32", engine_config=EngineConfig(**cfg))
    eng = llm.engine
    eng.multi_step_seconds = float("inf")
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return reqs, eng


@pytest.mark.parametrize("decode", ["vanilla", "threshold", "llada2"])
def test_fused_block_starts_equal_the_general_path(folder, decode):
    path, bl = folder
    params = SamplingParams(max_tokens=3 * bl, block_length=bl, decode=decode, cache="block",
                            threshold=0.3, early_stop=False)
    ref, _ = _run(path, params, fused_step=False)
    steady, seng = _run(path, params, fused_step=True)
    got, eng = _run(path, params, fused_step=True, fused_first_steps=True)
    for a, b, c in zip(ref, steady, got):
        assert a.canvas.tolist() == b.canvas.tolist() == c.canvas.tolist()
        assert a.num_forwards == c.num_forwards and a.block_forwards == c.block_forwards
    # with the block starts fused, only the requests' first blocks (prefill) take the general
    # path: more fused steps than with steady steps alone
    assert eng.runner.fused.stats["fused_steps"] > seng.runner.fused.stats["fused_steps"]
    assert eng.runner.fused.stats["fused_block_starts"] > 0
    assert seng.runner.fused.stats["fused_block_starts"] == 0


def test_many_requests_queued_and_early_stop(folder):
    """More requests than running slots (admissions mid-way, so requests in every phase share
    steps), more than 8 a step (the one-pass block split) and early stop."""
    path, bl = folder
    prompts = [[(7 * i + j) % 90 + 5 for j in range(2 + i % 11)] for i in range(14)]
    params = SamplingParams(max_tokens=2 * bl, block_length=bl, decode="vanilla", cache="block")
    ref, _ = _run(path, params, prompts, fused_step=False, max_num_seqs=10)
    got, eng = _run(path, params, prompts, fused_step=True, fused_first_steps=True,
                    max_num_seqs=10)
    assert [r.canvas.tolist() for r in ref] == [r.canvas.tolist() for r in got]
    assert [r.finish_reason for r in ref] == [r.finish_reason for r in got]
    assert eng.runner.fused.stats["fused_block_starts"] > 0


def test_with_multi_step(folder):
    path, bl = folder
    params = SamplingParams(max_tokens=3 * bl, block_length=bl, decode="vanilla", cache="block",
                            early_stop=False)
    # (prompts of one length mod 32: every request's blocks end at the same steps, so the steady
    # steps between block starts run as multi-step calls)
    aligned = [list(range(5, 12)), list(range(20, 59)), [7 + i % 90 for i in range(71)]]
    ref, _ = _run(path, params, aligned, fused_step=False)
    got, eng = _run(path, params, aligned, fused_step=True, fused_first_steps=True, multi_step=4)
    assert [r.canvas.tolist() for r in ref] == [r.canvas.tolist() for r in got]
    assert eng.stats["multi_step_calls"] > 0


def test_off_by_default():
    assert EngineConfig().fused_first_steps is False
