"""A new decode policy and a new cache mode are one file each plus one registration line: the toy
ones in ``tests/toy_policy.py`` and ``tests/toy_cache_mode.py`` are registered here and run
through the real engine (general and fused steps), ``SamplingParams``, the HTTP server and the
CLI's choices, with nothing else changed. (The toy KV tier: ``tests/test_toy_tier.py``.)"""
from __future__ import annotations

import pytest
import torch
from dense_oracle import use_dense_oracle
from test_sampler import MASK, PROMPTS, dense_logits, run_engine, tiny
from toy_cache_mode import TwoBlocks
from toy_policy import Leftmost

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.engine.engine import Engine


@pytest.fixture
def toys():
    with DECODE_POLICIES.registered(Leftmost()), CACHE_MODES.registered(TwoBlocks()):
        yield
    assert "leftmost" not in DECODE_POLICIES and "two_blocks" not in CACHE_MODES


@torch.no_grad()
def reference_leftmost(model, prompt, gen_length, block_length):
    """Autoregressive order inside each block, on the dense full-canvas forward: every step
    commits the argmax (never MASK) at the block's leftmost masked slot."""
    P = len(prompt)
    x = torch.full((1, P + gen_length), MASK, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    for p in range(P, P + gen_length):
        logits = dense_logits(model, x)[0, p]
        logits[MASK] = float("-inf")
        x[0, p] = logits.argmax()
    return x[0]


def test_unknown_names_are_refused_until_registered():
    with pytest.raises(ValueError, match="decode must be one of"):
        SamplingParams(decode="leftmost", cache="none")
    with DECODE_POLICIES.registered(Leftmost()):
        assert SamplingParams(decode="leftmost", cache="none").decode == "leftmost"
    with pytest.raises(ValueError, match="cache mode must be one of|cache must be one of"):
        SamplingParams(cache="two_blocks", decode="vanilla")


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_toy_policy_equals_its_reference_loop(toys, family):
    model = tiny(family, seed=2)
    params = SamplingParams(max_tokens=16, block_length=8, decode="leftmost", cache="none",
                            early_stop=False)
    reqs, outs = run_engine(model, PROMPTS[:3], params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        assert torch.equal(req.canvas, reference_leftmost(model, prompt, 16, 8))
        assert out.num_forwards == 16                      # one commit per forward


@pytest.mark.parametrize("cache", ["dual", "prefix", "two_blocks"])
def test_toy_policy_runs_fused_like_the_general_path(toys, cache):
    """The policy's graph-safe rule (``fused_keep``) in the fused step (run eagerly on the CPU)
    commits what its general ``select`` commits, also under the toy cache mode."""
    model = tiny("llada", seed=3)
    params = SamplingParams(max_tokens=16, block_length=8, decode="leftmost", cache=cache,
                            early_stop=False)
    ref, _ = run_engine(model, PROMPTS[:3], params, config=EngineConfig(fused_step=False))
    eng = Engine(model, model.cfg, EngineConfig(fused_step=True))
    got = [eng.add_request(p, params) for p in PROMPTS[:3]]
    while eng.has_unfinished():
        eng.step()
    assert eng.runner.fused.stats["fused_steps"] > 0
    for a, b in zip(ref, got):
        assert torch.equal(a.canvas, b.canvas)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_toy_cache_mode_windows_and_dense_oracle(toys, family):
    """The engine recomputes exactly the toy mode's windows (whole canvas at the first step,
    then the previous and the active block), and the paged path equals the dense oracle's
    (an independent attention over a canvas-sized cache) token for token."""
    model = tiny(family, seed=4)
    params = SamplingParams(max_tokens=24, block_length=8, decode="threshold", threshold=0.3,
                            cache="two_blocks", early_stop=False)
    _, outs = run_engine(model, PROMPTS[:3], params, config=EngineConfig(fused_step=False))
    shift = model.cfg.logit_shift
    for prompt, out in zip(PROMPTS, outs):
        P, L = len(prompt), len(prompt) + 24

        def window(b):                         # previous + active block (one row more: Dream)
            start = P + 8 * b
            return start + 8 - max(0, start - 8 - shift)
        expect = L - window(0)                 # the first step refreshes the whole canvas
        for b, n in enumerate(out.metrics["block_forwards"]):
            expect += n * window(b)
        assert out.metrics["positions_computed"] == expect
    eng = use_dense_oracle(Engine(model, model.cfg, EngineConfig(fused_step=False)))
    dense = [eng.add_request(p, params) for p in PROMPTS[:3]]
    while eng.has_unfinished():
        eng.step()
    paged, _ = run_engine(model, PROMPTS[:3], params, config=EngineConfig(fused_step=False))
    for a, b in zip(paged, dense):
        assert torch.equal(a.canvas, b.canvas)


def test_toys_through_the_http_server_and_the_cli(toys, tmp_path):
    """A registered name is a valid HTTP body value and CLI choice with no other change."""
    import argparse
    import asyncio

    import httpx
    from conftest import write_tiny_checkpoint

    from flash_dllm.entrypoints.args import add_sampling_flags, sampling_from_args
    from flash_dllm.entrypoints.serve import load_async_engine
    from flash_dllm.server.app import build_app
    parser = argparse.ArgumentParser()
    add_sampling_flags(parser)
    args = parser.parse_args(["--decode", "leftmost", "--cache", "two_blocks",
                              "--max-tokens", "16"])
    params = sampling_from_args(args)
    assert (params.decode, params.cache) == ("leftmost", "two_blocks")
    aeng, tok, _ = load_async_engine(write_tiny_checkpoint(tmp_path / "tiny", "llada"),
                                     config=EngineConfig(num_kv_pages=64))
    app = build_app(aeng, tok, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as c:
            return await c.post("/v1/completions", json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 16, "decode": "leftmost",
                "cache": "two_blocks"})
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
