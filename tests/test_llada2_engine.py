"""LLaDA2 in the paged engine (issue 39): its published sampler (``decode="llada2"``) token for
token against a plain loop over the independent forward of ``test_llada2.reference_logits``; the
exact block cache equal to recomputing every block; the general and fused steps equal."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import write_tiny_llada2_checkpoint
from test_llada2 import reference_logits

from flash_dllm import LLM
from flash_dllm.config import EngineConfig, SamplingParams

BL = 32                                        # LLaDA2's block (the family's default)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 52)), [40, 41]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llada2_checkpoint(tmp_path_factory.mktemp("l2") / "ckpt", seed=11)


@torch.no_grad()
def reference_generate(folder, prompt, gen, steps_per_block, tau, mask_id):
    """LLaDA2's ``generate``, greedy, written against ``reference_logits``: blocks of 32 from
    position 0, each step a forward over every position up to the active block's end; at step s
    commit every masked slot of the block whose probability (of its best non-MASK token) is
    above ``tau`` when there are k_s of them, else the k_s most probable."""
    P = len(prompt)
    L = -(-(P + gen) // BL) * BL
    x = torch.full((1, L), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    base, rem = divmod(BL, steps_per_block)
    schedule = [base + (1 if i < rem else 0) for i in range(steps_per_block)]
    for start in range(P - P % BL, L, BL):
        step = 0
        while (x[0, start:start + BL] == mask_id).any():
            logits = reference_logits(folder, x[:, :start + BL], BL)[0, start:start + BL]
            p = F.softmax(logits.float(), -1)
            p_ok = p.clone()
            p_ok[:, mask_id] = -1.0
            conf, tok = p_ok.max(-1)
            masked = x[0, start:start + BL] == mask_id
            conf = torch.where(masked, conf, float("-inf"))
            k = min(schedule[min(step, steps_per_block - 1)], int(masked.sum()))
            high = conf > tau
            keep = high if int(high.sum()) >= k else torch.zeros_like(high)
            if int(high.sum()) < k:
                keep[torch.topk(conf, k).indices] = True
            x[0, start:start + BL] = torch.where(keep, tok, x[0, start:start + BL])
            step += 1
    return x[0]


def _run(folder, cache, decode="llada2", fused=False, **kw):
    llm = LLM(str(folder), dtype="float32", engine_config=EngineConfig(fused_step=fused))
    params = SamplingParams(max_tokens=32, block_length=BL, decode=decode, cache=cache,
                            threshold=0.3, early_stop=False, **kw)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    return llm, reqs, eng


def test_published_sampler_equals_the_reference_loop(folder):
    llm, reqs, _ = _run(folder, "none", steps=8)           # 8 steps a block: k = 4
    mask_id = llm.cfg.mask_token_id
    for prompt, req in zip(PROMPTS, reqs):
        ref = reference_generate(folder, prompt, 32, 8, 0.3, mask_id)
        assert req.canvas.tolist() == ref.tolist(), prompt


@pytest.mark.parametrize("decode", ["llada2", "threshold", "vanilla"])
def test_block_cache_equals_recomputing_everything(folder, decode):
    _, ref, _ = _run(folder, "none", decode)
    _, got, eng = _run(folder, "block", decode)
    _, fused, feng = _run(folder, "block", decode, fused=True)
    assert feng.runner.fused.stats["fused_steps"] > 0
    for a, b, c in zip(ref, got, fused):
        assert a.canvas.tolist() == b.canvas.tolist() == c.canvas.tolist()
        assert a.num_forwards == b.num_forwards == c.num_forwards
        assert b.counters["positions_computed"] < a.counters["positions_computed"]


def test_generate_and_chat_through_llm(folder):
    with LLM(str(folder), dtype="float32") as llm:
        params = SamplingParams(max_tokens=32, block_length=BL, decode="llada2", cache="block",
                                threshold=0.5)
        out = llm.generate(["hello"], params)[0]
        assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 32
        chat = llm.chat([{"role": "user", "content": "hi"}], params)[0]
        assert chat.finished


@pytest.mark.skipif(not __import__("flash_dllm.kernels.rope_cache", fromlist=["x"]).INTERPRET,
                    reason="needs triton under TRITON_INTERPRET=1")
def test_partial_rotary_in_the_rope_kernel_answers_as_pytorch(folder, monkeypatch):
    """The block cache with LLaDA2's q/k norms and half-head rotary inside the RoPE + page write
    kernel (``rope_cache``'s ``rotary_dim``; the interpreter, forced on CPU tensors: one short
    request) answers token for token as the PyTorch rotary path (``takes_rotary`` refusing
    partial heads)."""
    from flash_dllm.kernels import rope_cache

    def run():
        llm = LLM(str(folder), dtype="float32")
        params = SamplingParams(max_tokens=32, block_length=BL, decode="llada2", cache="block",
                                threshold=0.3, early_stop=False, steps=4)
        req = llm.engine.add_request(PROMPTS[2], params)
        while llm.engine.has_unfinished():
            llm.engine.step()
        return req.canvas.tolist()

    want = run()
    calls = []
    real = rope_cache.rope_cache_triton
    monkeypatch.setattr(rope_cache, "use_triton", lambda *t: True)
    monkeypatch.setattr(rope_cache, "rope_cache_triton",
                        lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    assert run() == want
    assert calls and all(r is not None for r in calls)          # partial: rotary_dim passed
    monkeypatch.setattr(rope_cache, "takes_rotary", lambda r, d: r == d)
    calls.clear()
    assert run() == want and not calls                            # the PyTorch rotary path
