"""Tensor parallelism on the CPU: real gloo process groups, real worker processes.

TP=2 must give the same tokens as TP=1 at fp32 (issue 16), for every cache mode x decode policy,
with continuous batching (more requests than ``max_num_seqs``), a seeded sampled request and
prefix reuse, on the shipped demo model (LLaDA layout, untied LM head) and on a tiny Dream model
(GQA, q/k/v biases, tied embeddings). One worker spawn per model keeps this affordable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import EXACT, write_tiny_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, EngineConfig
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.loader import load_engine
from flash_dllm.models.loader import default_model_path

# FLASH_DLLM_TP_DEVICE=cuda runs the equality tests on 2 GPUs (NCCL, CUDA graphs capturing the
# collectives); the default is the CPU with gloo
DEVICE = os.environ.get("FLASH_DLLM_TP_DEVICE", "cpu")

PROMPTS = ["Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?",
           "What is 3+4?", "Tom has 5 apples and eats 2. How many are left?"]


def _params() -> list[SamplingParams]:
    ps = [SamplingParams(max_tokens=16, block_length=8, cache=c, decode=d, early_stop=False)
          for c in CACHE_MODES for d in DECODE_POLICIES
          if not CACHE_MODES[c].needs_block_causal]  # (block: block-causal models)
    ps.append(SamplingParams(max_tokens=16, block_length=8, temperature=0.8, seed=7,
                             decode="threshold", cache="dual"))
    # the drift trigger ranks keys by the attention mass summed over the ranks' heads
    ps.append(SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.5,
                             cache="dual", drift_min=0.999, kv_top_k=3, early_stop=False))
    return ps


def _run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of a batch of every config, then of follow-up turns that reuse its prefixes."""
    ps = _params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ps))]
    first = llm.generate(prompts, ps)
    follow = [p + o.text + " And then?" for p, o in zip(prompts[:4], first[:4])]
    second = llm.generate(follow, ps[:4])
    return [o.token_ids for o in first], [o.token_ids for o in second]


CONFIG = EngineConfig(max_num_seqs=4, prefix_reuse=True, num_kv_pages=256)


@pytest.fixture(scope="module")
def dream_folder(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dream_tp"), "dream",
                                 tie_word_embeddings=True)


@pytest.mark.parametrize("which", ["demo", "dream"])
def test_tp2_equals_tp1_token_for_token(which, request):
    folder = default_model_path() if which == "demo" else request.getfixturevalue("dream_folder")
    ref = _run(LLM(folder, device=DEVICE, dtype="float32", engine_config=CONFIG))
    with LLM(folder, device=DEVICE, dtype="float32", engine_config=CONFIG,
             tensor_parallel_size=2) as llm:
        assert llm.engine.runner.kv_heads == llm.cfg.num_kv_heads // 2
        got = _run(llm)
        hits = sum(llm.engine.kv_manager.stats["hit_tokens"])
        if which == "demo":
            _dead_worker_is_named(llm)
    for name, a, b in (("first", ref[0], got[0]), ("follow-up", ref[1], got[1])):
        for i, (x, y) in enumerate(zip(a, b)):
            assert x == y, f"{which} {name} request {i} ({_params()[i]}): TP=2 {y} != TP=1 {x}"
    assert hits > 0, "the follow-up turns should reuse cached prefixes"


def test_fused_verify_steps_under_tp2_equal_the_general_path(dream_folder):
    """Fused verify steps (decoding/policies/verify_fused.py) with heads and vocabulary sharded over two
    ranks: the same tokens, forwards and accepted drafts as one process on the general path."""
    from dataclasses import replace
    ps = [SamplingParams(max_tokens=32, block_length=16, cache=c, decode="verify", gamma=g,
                         threshold=t, max_verify=m, verify_rule=r, early_stop=False)
          for c, g, t, m, r in [("dual", 0.3, 0.9, 16, "agree"), ("prefix", 0.5, 0.7, 4,
                                                                 "cumprod"),
                                ("dual", 0.2, 0.9, 1, "agree")]]

    def run(llm):
        outs = llm.generate(PROMPTS, ps)
        return [(o.token_ids, o.num_forwards, o.metrics["verify_accepted"]) for o in outs]
    cfg = EngineConfig(max_num_seqs=4, num_kv_pages=256)
    ref = run(LLM(dream_folder, device=DEVICE, dtype="float32",
                  engine_config=replace(cfg, fused_step=False)))
    with LLM(dream_folder, device=DEVICE, dtype="float32",
             engine_config=replace(cfg, fused_step=True), tensor_parallel_size=2) as llm:
        got = run(llm)
        assert llm.engine.runner.fused.stats["fused_steps"] > 0
    assert got == ref


def _dead_worker_is_named(llm: LLM) -> None:
    """A worker that dies fails the next step with a message naming it (no hang)."""
    worker = llm.engine.workers[0]
    worker.kill()
    worker.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .* exited"):
        llm.generate("What is 3+4?", SamplingParams(max_tokens=8, block_length=8, **EXACT))
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------------------------------------- errors
def test_size_that_does_not_divide_the_heads_is_refused_before_spawning():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's "
                                         "num_heads \\(4\\)"):
        LLM(tensor_parallel_size=3)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 GPUs")
def test_more_gpus_than_visible_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs"):
        LLM(device="cuda", tensor_parallel_size=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tensor_parallel_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        load_engine(EngineArgs(tensor_parallel_size=bad))


def test_tiers_with_tensor_parallelism_are_refused(tmp_path):
    with pytest.raises(ValueError, match="KV tiers .* not supported with tensor_parallel_size"):
        LLM(tensor_parallel_size=2,
            engine_config=EngineConfig(prefix_reuse=True, kv_cpu_gb=0.01))
    with pytest.raises(ValueError, match="--kv-overflow-gb .* tensor_parallel_size > 1"):
        LLM(tensor_parallel_size=2, engine_config=EngineConfig(kv_overflow_gb=0.01))


def test_torchrun_world_size_must_agree(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 but torchrun started "
                                         "WORLD_SIZE=4"):
        load_engine(EngineArgs(tensor_parallel_size=2))


def test_random_shape_models_refuse_tensor_parallelism():
    from flash_dllm.entrypoints.loader import load_random_engine
    with pytest.raises(ValueError, match="bench step --tensor-parallel-size"):
        load_random_engine("demo", EngineArgs(tensor_parallel_size=2))


# ------------------------------------------------------------------- torchrun and bench step
def _cli(*args: str, timeout: int = 300, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    head = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(_port()), "-m", "flash_dllm.cli"] if torchrun
            else [sys.executable, "-m", "flash_dllm.cli"])
    return subprocess.run(head + list(args), capture_output=True, text=True, timeout=timeout,
                          env=env)


def _port() -> int:
    from flash_dllm.distributed.launch import free_port
    return free_port()


def test_torchrun_generate_matches_one_process():
    args = ("generate", "--max-tokens", "16", "--block-length", "8", "What is 3+4?")
    one = _cli(*args)
    assert one.returncode == 0, one.stderr
    two = _cli(*args, torchrun=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.strip() == one.stdout.strip()       # rank 0 prints; rank 1 follows


def test_bench_step_tensor_parallel_writes_report(tmp_path):
    out = tmp_path / "step_tp2.json"
    r = _cli("bench", "step", "--model-shape", "demo", "--device", "cpu", "--dtype", "float32",
             "--batch", "2", "--cache", "dual", "--prompt-len", "16", "--gen-len", "8",
             "--block-length", "8", "--steps", "3", "--warmup", "1",
             "--tensor-parallel-size", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 2
    assert report["rows"] and report["rows"][0]["ms"] > 0
