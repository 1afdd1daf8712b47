"""Block-causal models in the paged engine (issue 39): blocks on the model's grid, the attention
split at block bounds, per-head q/k norm and partial rotary in the paged path, and the exact
block KV cache (``cache="block"``), against an independent dense reference loop."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_sampler import EOS, MASK, dense_logits, run_engine, tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import Request
from flash_dllm.engine.engine import Engine
from flash_dllm.layers.attention import block_causal
from flash_dllm.models.transformer import DiffusionTransformer
from conftest import EXACT

BS = 8
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21, 22], [1, 2, 3, 4, 5, 6, 7, 9],
           [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45]]


def block_model(family: str = "llada", seed: int = 3, **extra):
    """A tiny model of ``family``'s layout made block-causal (block 8), with per-head q/k norm
    and half-rotary heads (what LLaDA2 does), random and peaked."""
    cfg = replace(tiny(family, seed).cfg, attention=block_causal(BS), qk_norm=True, rotary_dim=8,
                  **extra)
    model = DiffusionTransformer(cfg)
    model.init_weights(std=0.3, seed=seed)
    return model.eval()


@torch.no_grad()
def reference_grid(model, prompt, gen, rule, steps=None, tau=0.5):
    """Block diffusion as LLaDA2's published ``generate`` lays it out, on the dense forward:
    blocks of 8 counted from position 0, the first decoded block holds the prompt's end, each
    step runs the model over every position up to the active block's end and commits, among
    the block's masked slots, the ``k`` most confident (``vanilla``: k from the step schedule;
    ties as LLaDA's reference: topk over a row as long as the canvas), every one at or above
    ``tau`` and the best (``threshold``), or (``llada2``, its own ``generate``) every one strictly
    above ``tau`` when there are k of them, else the k most confident (topk over the block's
    row). MASK is never proposed. (Dream's shifted logits: a
    block's first slot is read from the previous block's last row, which cannot see it.)"""
    P = len(prompt)
    L = -(-(P + gen) // BS) * BS
    x = torch.full((1, L), MASK, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    per_block = (steps or gen) // (gen // BS)
    for start in range(P - P % BS, L, BS):
        masked_total = int((x[0, start:start + BS] == MASK).sum())
        base, rem = divmod(BS, per_block)
        schedule = [base + (1 if i < rem else 0) for i in range(per_block)]
        step = 0
        while (x[0, start:start + BS] == MASK).any():
            logits = dense_logits(model, x[:, :start + BS])[0]      # (Dream: shifted)
            p = F.softmax(logits.float(), dim=-1)          # (MASK's mass stays in the sum)
            p_ok = p.clone()
            p_ok[:, MASK] = -1.0                           # MASK is never proposed
            conf, tok = p_ok.max(-1)
            masked = torch.zeros(L, dtype=torch.bool)
            masked[start:start + BS] = x[0, start:start + BS] == MASK
            row = torch.full((L,), float("-inf"))
            row[:start + BS] = torch.where(masked[:start + BS], conf, float("-inf"))
            k = min(schedule[min(step, per_block - 1)], int(masked.sum()))
            if rule == "vanilla":
                keep = torch.zeros(L, dtype=torch.bool)
                keep[torch.topk(row, k).indices] = True
            elif rule == "llada2":           # LLaDA2's generate: > tau if k of them, else top-k
                block_row = row[start:start + BS]
                high = block_row > tau
                keep = torch.zeros(L, dtype=torch.bool)
                if int(high.sum()) >= k:
                    keep[start:start + BS] = high
                else:
                    keep[start + torch.topk(block_row, k).indices] = True
            else:
                keep = (row >= tau) & masked
                keep[int(row.argmax())] = True
            x[0, :start + BS] = torch.where(keep[:start + BS], tok, x[0, :start + BS])
            step += 1
        assert masked_total > 0
    return x[0]


def test_request_grid():
    p = SamplingParams(max_tokens=16, block_length=BS, **EXACT)
    r = Request("a", list(range(1, 12)), p, MASK, (EOS,), grid=BS)        # prompt 11
    assert (r.origin, r.canvas_len, r.num_blocks, r.block_start, r.lead) == (8, 32, 3, 8, 3)
    assert r.num_masked == 5 and (r.tokens[11:] == MASK).all()
    flat = Request("b", list(range(1, 12)), p, MASK, (EOS,))
    assert (flat.origin, flat.canvas_len, flat.num_blocks, flat.lead) == (11, 27, 2, 0)
    aligned = Request("c", list(range(1, 9)), p, MASK, (EOS,), grid=BS)   # prompt 8
    assert (aligned.origin, aligned.canvas_len, aligned.num_blocks) == (8, 24, 2)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("rule", ["vanilla", "threshold", "llada2"])
def test_exact_sampler_equals_the_dense_reference(family, rule):
    """cache="none" (every block up to the active one recomputed at every step, with the
    attention split at block bounds) token for token against the dense reference loop."""
    model = block_model(family)
    steps = 8 if rule == "llada2" else None           # 4 steps a block: k = 2 per step
    params = SamplingParams(max_tokens=16, block_length=BS, decode=rule, threshold=0.5,
                            cache="none", early_stop=False, steps=steps)
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref = reference_grid(model, prompt, 16, rule, steps=steps)
        assert torch.equal(req.canvas, ref), prompt
        assert out.token_ids == [t for t in ref[len(prompt):len(prompt) + 16].tolist()][
            :len(out.token_ids)]


@pytest.mark.parametrize("decode", ["vanilla", "threshold", "llada2"])
@pytest.mark.parametrize("fused", [False, True])
def test_exact_block_cache_equals_recomputing_everything(decode, fused):
    """The exact block cache recomputes only the active block (and the previous one once): the
    same tokens as recomputing every block at every step, and fewer positions."""
    model = block_model("llada", seed=5)
    kw = dict(max_tokens=24, block_length=BS, decode=decode, threshold=0.4, early_stop=False,
              steps=6 if decode == "llada2" else None)
    ref, oref = run_engine(model, PROMPTS, SamplingParams(cache="none", **kw),
                           config=EngineConfig(fused_step=False))
    eng = Engine(model, model.cfg, EngineConfig(fused_step=fused))
    got = [eng.add_request(p, SamplingParams(cache="block", **kw)) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    if fused:
        assert eng.runner.fused.stats["fused_steps"] > 0
    for a, b, o in zip(ref, got, oref):
        assert torch.equal(a.canvas, b.canvas)
        assert b.num_forwards == o.num_forwards
        assert b.counters["positions_computed"] < o.metrics["positions_computed"]


def test_answer_is_cut_at_max_tokens_and_stops():
    """The canvas runs to the end of the block holding the last answer slot; the answer is
    cut at max_tokens (finish "length") or at an end-of-answer id."""
    model = block_model("llada", seed=7)
    params = SamplingParams(max_tokens=8, block_length=BS, decode="threshold", threshold=0.3,
                            cache="block", early_stop=False)
    reqs, outs = run_engine(model, [PROMPTS[0]], params)
    r, o = reqs[0], outs[0]
    assert r.canvas_len == 24 and len(o.token_ids) <= 8
    if EOS not in r.tokens[11:19].tolist():
        assert len(o.token_ids) == 8 and o.finish_reason == "length"


@pytest.mark.parametrize("kw,match", [
    (dict(block_length=4, max_tokens=16), "block_length must be 8 for this model"),
    (dict(cache="flash"), "cache='flash' does not run on a block-causal model"),
    (dict(decode="verify"), "decode='verify' does not run on a block-causal model"),
    (dict(cache="dual", kv_jaccard_min=0.5), "kv_consistency step extension does not run"),
    (dict(cache="dual", drift_min=0.9, decode="threshold"), "drift step extension does not"),
])
def test_what_a_block_causal_model_refuses(kw, match):
    model = block_model("llada")
    eng = Engine(model, model.cfg)
    params = SamplingParams(**{"max_tokens": 16, "block_length": BS, **kw})
    with pytest.raises(ValueError, match=match):
        eng.add_request(PROMPTS[0], params)


def test_the_block_cache_needs_a_block_causal_model():
    model = tiny("llada")
    with pytest.raises(ValueError, match="cache='block' needs a block-causal model"):
        Engine(model, model.cfg).add_request([1, 2, 3], SamplingParams(max_tokens=8,
                                                                     cache="block",
                                                                       decode="vanilla"))


@pytest.mark.parametrize("cut", [0, 5, 12])
def test_prefix_reuse_is_exact_and_whole_blocks(cut):
    """A finished request publishes its complete blocks; a later prompt that starts with them
    reuses whole blocks only (a prefix matched to the middle of a block is recomputed: its K/V
    depend on the whole block) and gets exactly the tokens it gets without reuse."""
    model = block_model("llada", seed=9)
    params = SamplingParams(max_tokens=24, block_length=BS, decode="threshold", threshold=0.4,
                            cache="block", early_stop=False)
    first = PROMPTS[3]
    eng = Engine(model, model.cfg, EngineConfig(prefix_reuse=True, page_size=4))
    a = eng.add_request(first, params)
    while eng.has_unfinished():
        eng.step()
    follow = a.tokens[:len(first) + 24 - cut].tolist() + [60, 61, 62]
    b = eng.add_request(follow, params)
    while eng.has_unfinished():
        eng.step()
    assert b.reused_len > 0 and b.reused_len % BS == 0
    fresh, _ = run_engine(model, [follow], params, config=EngineConfig(page_size=4))
    assert torch.equal(b.canvas, fresh[0].canvas)


@torch.no_grad()
def reference_edit(model, prompt, gen, tau, edit_tau, max_post):
    """LLaDA2.1's joint threshold decoding (M2T + T2T, SGLang's ``JointThreshold``) on the dense
    forward, on the grid of blocks: each step, masked slots above ``tau`` (else the best one)
    take their prediction, decoded slots of the block (not the prompt's) whose prediction
    differs with probability above ``edit_tau`` are replaced; a block ends when a step changes
    nothing or after ``max_post`` steps without a mask. MASK is never a prediction (the
    engine's one deviation)."""
    P = len(prompt)
    L = -(-(P + gen) // BS) * BS
    x = torch.full((1, L), MASK, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    forwards = 0
    for start in range(P - P % BS, L, BS):
        prompt_slots = x[0, start:start + BS] != MASK
        post = 0
        while True:
            cur = x[0, start:start + BS]
            masked = cur == MASK
            if not masked.any():
                post += 1
                if post > max_post:
                    forwards += 1                  # (the engine's step that changes nothing)
                    break
            logits = dense_logits(model, x[:, :start + BS])[0, start:start + BS]
            forwards += 1
            p = F.softmax(logits.float(), dim=-1)
            p_ok = p.clone()
            p_ok[:, MASK] = -1.0
            conf, tok = p_ok.max(-1)
            m2t = masked & (conf > tau)
            if masked.any() and not m2t.any():
                m2t[int(torch.where(masked, conf, -1.0).argmax())] = True
            t2t = ~masked & ~prompt_slots & (tok != cur) & (conf > edit_tau)
            if not (m2t | t2t).any():
                break
            x[0, start:start + BS] = torch.where(m2t | t2t, tok, cur)
    return x[0], forwards


@pytest.mark.parametrize("edit_tau", [0.2, 0.6])
@pytest.mark.parametrize("cache", ["none", "block"])
def test_edit_policy_equals_its_reference_and_streams_final_text_only(edit_tau, cache):
    """decode="edit" token for token and forward for forward against the reference loop; the
    text streamed step by step is never taken back (a block's edits stay provisional until the
    block ends)."""
    model = block_model("llada", seed=3)
    params = SamplingParams(max_tokens=16, block_length=BS, decode="edit", threshold=0.5,
                            edit_threshold=edit_tau, max_post_edit_steps=3, cache=cache,
                            early_stop=False)
    eng = Engine(model, model.cfg)
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    streamed = {r.request_id: [] for r in reqs}
    provisional_seen = False
    while eng.has_unfinished():
        for out in eng.step():
            streamed[out.request_id] += out.new_token_ids
        provisional_seen |= any(eng.output(r).provisional_token_ids for r in reqs)
    assert provisional_seen
    for prompt, req in zip(PROMPTS, reqs):
        ref, forwards = reference_edit(model, prompt, 16, 0.5, edit_tau, 3)
        assert torch.equal(req.canvas, ref), prompt
        assert req.num_forwards == forwards
        assert streamed[req.request_id] == eng.output(req).token_ids
