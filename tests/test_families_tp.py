"""Tensor and expert parallelism for issue 41's mixture-of-experts families on the CPU (real gloo
process groups, real worker processes): ``tensor_parallel_size=2`` splits a tiny LLaDA-MoE and a
tiny SDAR-MoE checkpoint (real layouts) by head for attention and by expert for the routed
experts, and gives the same tokens as one process at fp32 and the same logits up to the order of
the ranks' sums."""
from __future__ import annotations

import os

import pytest
import torch
from family_checkpoints import one_torch_thread  # noqa: F401 (autouse)
from family_checkpoints import tiny_llada_moe_config, tiny_sdar_moe_config, write_family_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.config import EngineConfig

DEVICE = os.environ.get("FLASH_DLLM_TP_DEVICE", "cpu")      # as tests/test_tensor_parallel.py
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 30)), [40, 41]]
CONFIG = EngineConfig(max_num_seqs=2, num_kv_pages=64)          # 3 requests: one waits
CASES = {"llada_moe": (tiny_llada_moe_config, [("threshold", "dual", 8), ("vanilla", "none", 8)]),
         "sdar_moe": (tiny_sdar_moe_config, [("llada2", "block", 4), ("threshold", "block", 4)])}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_ep2_equals_one_process(tmp_path, monkeypatch, name):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")         # the worker process too: one thread
    make, rules = CASES[name]
    folder = write_family_checkpoint(tmp_path / name, make(), seed=13)
    params = [SamplingParams(max_tokens=16, block_length=bl, decode=d, cache=c, threshold=0.3,
                             early_stop=False) for d, c, bl in rules]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))] + [PROMPTS[2]]
    params = params + params[:1]
    canvases = [list(range(5, 25)), list(range(50, 70))]
    with LLM(str(folder), device=DEVICE, dtype="float32", engine_config=CONFIG) as ref_llm:
        ref = [o.token_ids for o in ref_llm.generate(prompts, params)]
        ref_logits = ref_llm.logits(canvases)
    with LLM(str(folder), device=DEVICE, dtype="float32", engine_config=CONFIG,
             tensor_parallel_size=2) as llm:
        moe = llm.engine.model.layers[0].mlp
        assert tuple(moe.w_gate_up.shape[:1]) == (llm.cfg.moe.num_experts // 2,)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        logits = llm.logits(canvases)
    assert got == ref
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
