"""Sampler parity: the engine against short independent reference loops of the published algorithms.

The reference loops below are written from LLaDA's ``generate`` (low-confidence remasking) and
Fast-dLLM's threshold rule, on the dense full-canvas forward, with none of the engine's code.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.models.loader import build_model
from conftest import EXACT

MASK, EOS = 99, 98


def tiny(family: str = "llada", seed: int = 0):
    if family == "llada":
        cfg = {"architectures": ["LLaDAModelLM"], "d_model": 64, "n_layers": 2, "n_heads": 4,
               "mlp_hidden_size": 128, "vocab_size": 100, "max_sequence_length": 256,
               "mask_token_id": MASK, "eos_token_id": EOS}
    else:
        cfg = {"architectures": ["DreamModel"], "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
               "vocab_size": 100, "max_position_embeddings": 256, "mask_token_id": MASK,
               "eos_token_id": EOS}
    model = build_model(cfg, seed=seed)
    model.init_weights(std=0.3, seed=seed)   # peaked distributions: few near-ties
    return model


def run_engine(model, prompts, params, **engine_kw):
    eng = Engine(model, model.cfg, **engine_kw)
    reqs = [eng.add_request(p, params if isinstance(params, SamplingParams) else params[i])
            for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    return reqs, [eng.output(r) for r in reqs]


def dense_logits(model, x):
    """The model's logits for every slot. The one deviation from the published loops: MASK is never
    a proposal (a tiny random model may rank it first; the engine never commits MASK)."""
    logits = model(x)
    if model.cfg.logit_shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


@torch.no_grad()
def reference_vanilla(model, prompt, gen_length, block_length, steps):
    """LLaDA generate(): temperature 0, low_confidence remasking."""
    x = torch.full((1, len(prompt) + gen_length), MASK, dtype=torch.long)
    x[0, :len(prompt)] = torch.tensor(prompt)
    P = len(prompt)
    num_blocks = gen_length // block_length
    steps = steps // num_blocks
    nfe = 0
    for b in range(num_blocks):
        n_mask = int((x[:, P + b * block_length:P + (b + 1) * block_length] == MASK).sum())
        base, rem = n_mask // steps, n_mask % steps
        ntt = [base + (1 if i < rem else 0) for i in range(steps)]
        for i in range(steps):
            mask_index = x == MASK
            logits = dense_logits(model, x)
            nfe += 1
            x0 = torch.argmax(logits.index_fill(-1, torch.tensor([MASK]), -float("inf")), dim=-1)
            p = F.softmax(logits, dim=-1)
            x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            x0_p[:, P + (b + 1) * block_length:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-float("inf")))
            _, sel = torch.topk(confidence[0], k=ntt[i])
            x[0, sel] = x0[0, sel]
    return x[0, P:].tolist(), nfe


@torch.no_grad()
def reference_threshold(model, prompt, gen_length, block_length, tau):
    """Fast-dLLM generate() with threshold, no cache."""
    x = torch.full((1, len(prompt) + gen_length), MASK, dtype=torch.long)
    x[0, :len(prompt)] = torch.tensor(prompt)
    P = len(prompt)
    nfe = 0
    for b in range(gen_length // block_length):
        end = P + (b + 1) * block_length
        while (x[:, P + b * block_length:end] == MASK).any():
            mask_index = x == MASK
            mask_index[:, end:] = False
            logits = dense_logits(model, x)
            nfe += 1
            x0 = torch.argmax(logits.index_fill(-1, torch.tensor([MASK]), -float("inf")), dim=-1)
            p = F.softmax(logits.double(), dim=-1)
            x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-float("inf"), dtype=torch.double))
            n = int(mask_index.sum())
            _, sel = torch.topk(confidence[0], k=n)
            keep = [sel[0].item()] + [s.item() for s in sel[1:] if confidence[0, s] >= tau]
            x[0, keep] = x0[0, keep]
    return x[0, P:].tolist(), nfe


PROMPTS = [[5, 17, 3, 42, 8], [11, 2, 9, 33, 71, 64, 12, 7, 1, 90, 4], [60]]


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("gen,block,steps", [(16, 8, 16), (16, 8, 8), (24, 8, 6), (16, 16, 16)])
def test_vanilla_matches_reference(family, gen, block, steps):
    model = tiny(family)
    params = SamplingParams(max_tokens=gen, block_length=block, steps=steps, early_stop=False,
                            **EXACT)
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref, nfe = reference_vanilla(model, prompt, gen, block, steps)
        assert req.canvas[len(prompt):].tolist() == ref
        assert out.num_forwards == nfe == steps


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("tau", [0.5, 0.9, 1.0])
def test_threshold_matches_reference(family, tau):
    model = tiny(family)
    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=tau,
                            early_stop=False, cache="none")
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref, nfe = reference_threshold(model, prompt, 16, 8, tau)
        assert req.canvas[len(prompt):].tolist() == ref
        assert out.num_forwards == nfe
    if tau == 1.0:   # only the single best slot can pass: one token per forward
        assert all(o.num_forwards == 16 for o in outs)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_cached_modes_first_step_is_exact(family, cache):
    """With one step per block every step is a block's first step (a full refresh): the cached
    modes must then equal the exact mode token for token."""
    model = tiny(family)
    exact = SamplingParams(max_tokens=24, block_length=8, steps=3, early_stop=False, **EXACT)
    cached = SamplingParams(max_tokens=24, block_length=8, steps=3, cache=cache, early_stop=False,
                            decode="vanilla")
    r1, _ = run_engine(model, PROMPTS, exact)
    r2, _ = run_engine(model, PROMPTS, cached)
    for a, b in zip(r1, r2):
        assert torch.equal(a.canvas, b.canvas)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("decode", ["vanilla", "threshold"])
def test_cached_modes_run_to_completion(family, cache, decode):
    model = tiny(family)
    params = SamplingParams(max_tokens=24, block_length=8, cache=cache, decode=decode,
                            threshold=0.7, early_stop=False)
    eng = Engine(model, model.cfg)
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    for req in reqs:
        out = eng.output(req)
        assert out.finished and out.finish_reason in ("stop", "length")
        assert not (req.canvas == MASK).any()
        if decode == "vanilla":
            assert out.num_forwards == 24
        # the cache was released
        assert eng.kv_manager.pages(req.request_id) is None
        assert req.request_id not in eng.runner._states


def test_cached_mode_reuses_cache_between_steps():
    """Later steps of a block really read cached K/V: dual differs from exact somewhere when a
    block takes several steps (else the cache would be a no-op)."""
    model = tiny("llada", seed=3)
    outs = {}
    for cache in ("none", "dual"):
        reqs, _ = run_engine(model, PROMPTS * 3, SamplingParams(max_tokens=32, block_length=16,
                                                                 cache=cache, early_stop=False,
                                                                decode="vanilla"))
        outs[cache] = [r.canvas.tolist() for r in reqs]
    assert outs["none"] != outs["dual"]


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("decode", ["vanilla", "threshold"])
def test_batched_equals_solo(cache, decode):
    model = tiny("dream")
    params = SamplingParams(max_tokens=16, block_length=8, cache=cache, decode=decode,
                            threshold=0.6, early_stop=False)
    batched, _ = run_engine(model, PROMPTS, params)
    for prompt, b in zip(PROMPTS, batched):
        solo, _ = run_engine(model, [prompt], params)
        assert torch.equal(solo[0].canvas, b.canvas)


def test_mixed_params_in_one_batch_equal_solo():
    model = tiny("llada")
    plist = [SamplingParams(max_tokens=16, block_length=8, early_stop=False, **EXACT),
             SamplingParams(max_tokens=8, block_length=8, decode="threshold", cache="dual"),
             SamplingParams(max_tokens=24, block_length=8, steps=12, cache="prefix",
                            decode="vanilla")]
    batched, _ = run_engine(model, PROMPTS, plist)
    for prompt, p, b in zip(PROMPTS, plist, batched):
        solo, _ = run_engine(model, [prompt], p)
        assert torch.equal(solo[0].canvas, b.canvas)


def test_continuous_batching_small_max_num_seqs_equals_solo():
    from flash_dllm.config import EngineConfig
    model = tiny("llada")
    params = SamplingParams(max_tokens=16, block_length=8, early_stop=False, **EXACT)
    batched, _ = run_engine(model, PROMPTS * 2, params, config=EngineConfig(max_num_seqs=2))
    for prompt, b in zip(PROMPTS * 2, batched):
        solo, _ = run_engine(model, [prompt], params)
        assert torch.equal(solo[0].canvas, b.canvas)


def test_seeded_sampling_is_reproducible():
    model = tiny("llada")
    p = dict(max_tokens=16, block_length=8, temperature=1.0, top_k=20, top_p=0.9, early_stop=False)
    a, _ = run_engine(model, PROMPTS, SamplingParams(seed=1, **p))
    b, _ = run_engine(model, PROMPTS, SamplingParams(seed=1, **p))
    c, _ = run_engine(model, PROMPTS, SamplingParams(seed=2, **p))
    assert all(torch.equal(x.canvas, y.canvas) for x, y in zip(a, b))
    assert any(not torch.equal(x.canvas, z.canvas) for x, z in zip(a, c))
    # the batch does not change a seeded request's sample
    solo, _ = run_engine(model, [PROMPTS[1]], SamplingParams(seed=1, **p))
    assert torch.equal(solo[0].canvas, a[1].canvas)


def test_early_stop_after_block_with_eos():
    """A completed block holding EOS ends the request; the answer equals the full run's answer."""
    model = tiny("llada")
    with torch.no_grad():   # make EOS the argmax everywhere: every block completes with EOS
        model.lm_head.weight[EOS] = model.lm_head.weight.abs().max() * 5
        model.layers[-1].mlp.down_proj.weight.zero_()
    full, fo = run_engine(model, PROMPTS, SamplingParams(max_tokens=24, block_length=8,
                                                         early_stop=False, **EXACT))
    early, eo = run_engine(model, PROMPTS, SamplingParams(max_tokens=24, block_length=8, **EXACT))
    for f, e in zip(fo, eo):
        assert e.token_ids == f.token_ids
        assert e.finish_reason == "stop" and e.early_stopped
        assert e.num_forwards == 8 < f.num_forwards == 24


@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_abort_frees_request(layout):
    from dense_oracle import use_dense_oracle
    model = tiny("llada")
    eng = Engine(model, model.cfg)
    if layout == "dense":
        use_dense_oracle(eng)
    r = eng.add_request([1, 2, 3], SamplingParams(max_tokens=16, block_length=8, cache="dual",
                                                  decode="vanilla"))
    eng.step()
    held = (eng.runner._states.get(r.request_id) if layout == "paged"
            else eng.runner.backend.caches.get(r.request_id))
    assert held is not None and eng.pool.num_used > 0
    assert eng.abort(r.request_id)
    released = (eng.runner._states.get(r.request_id) if layout == "paged"
                else eng.runner.backend.caches.get(r.request_id))
    assert released is None and eng.kv_manager.pages(r.request_id) is None
    assert r.finish_reason == "abort"
    assert eng.pool.num_used == 0
    eng.step()
    assert not eng.has_unfinished()


def test_abort_of_a_waiting_request_leaves_the_queue():
    """A request aborted while queued (the engine full) leaves ``waiting`` at once: no request
    object is kept, the counts drop, and the running one goes on to its answer."""
    model = tiny("llada")
    eng = Engine(model, model.cfg, EngineConfig(max_num_seqs=1))
    p = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="vanilla")
    first = eng.add_request([1, 2, 3], p)
    queued = [eng.add_request([4, 5, 6 + i], p) for i in range(3)]
    eng.step()
    assert eng.counts() == (1, 3)
    assert eng.abort(queued[1].request_id) and queued[1].finish_reason == "abort"
    assert eng.counts() == (1, 2) and queued[1] not in eng.scheduler.waiting
    assert not eng.abort(queued[1].request_id)             # gone: nothing to abort twice
    while not first.finished:
        eng.step()
    assert first.finish_reason in ("stop", "length")
    while eng.has_unfinished():
        eng.step()
    assert all(r.finished and r.finish_reason != "abort" for r in (queued[0], queued[2]))


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=48, block_length=32), "multiple of block_length"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(decode="greedy"), "decode must be one of"),
    (dict(cache="paged"), "cache must be one of"),
    (dict(max_tokens=64, block_length=32, steps=33), "multiple of the number of blocks"),
    (dict(steps=1000), "steps"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_invalid_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_unknown_param_rejected():
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"max_tokens": 8, "temprature": 0.5})


def test_prompt_too_long_rejected():
    model = tiny("llada")
    eng = Engine(model, model.cfg)
    with pytest.raises(ValueError, match="maximum length 256"):
        eng.add_request([1] * 250, SamplingParams(max_tokens=16, **EXACT))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams(max_tokens=16, **EXACT))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request([1, 500], SamplingParams(max_tokens=16, **EXACT))
