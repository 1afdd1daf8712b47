"""benchmarks/verify/cross_block_verify_study.py's loop, written without engine code, equals the
engine: in-block verification alone is ``decode="verify", cache="none"`` token for token and forward
for forward (both model families), no verification is threshold decoding; cross-block drafts are
only ever the next block's slots."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from test_sampler import PROMPTS, run_engine, tiny

from flash_dllm.config import SamplingParams

_PATH = (Path(__file__).resolve().parents[1] / "benchmarks" / "verify"
         / "cross_block_verify_study.py")
_spec = importlib.util.spec_from_file_location("cross_block_verify_study", _PATH)
cbv = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cross_block_verify_study", cbv)
_spec.loader.exec_module(cbv)


def _ours(model, prompt, gamma, inblock, tau_next, tau=0.7):
    c = model.cfg
    return cbv.decode(model, prompt, 16, 8, tau, gamma, inblock, tau_next, c.mask_token_id,
                      set(c.eos_token_ids), c.logit_shift, early_stop=False)


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("gamma", [None, 0.3, 0.05])
def test_in_block_verification_equals_the_engine(family, gamma):
    model = tiny(family)
    kw = dict(max_tokens=16, block_length=8, threshold=0.7, cache="none", early_stop=False)
    params = (SamplingParams(decode="threshold", **kw) if gamma is None else
              SamplingParams(decode="verify", gamma=gamma, **kw))
    accepted = 0
    reqs, outs = run_engine(model, PROMPTS, params)
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        r = _ours(model, prompt, gamma, gamma is not None, None)
        assert r["canvas"] == req.canvas[len(prompt):].tolist()
        assert r["forwards"] == out.num_forwards
        accepted += r["accepted"]
    assert gamma is None or accepted > 0       # the case exercises acceptance


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_cross_block_drafts_are_the_next_blocks_confident_slots_checked_at_its_start(family):
    """Three blocks: at each boundary the drafts are the next block's slots whose confidence is
    >= tau_next in the forward that completed the block, most confident first (recomputed here
    from that forward's input with a plain dense forward), and the next block's first forward
    checks them (the loop asserts where and when); some pass; a rule nothing passes leaves
    threshold decoding's tokens and forwards."""
    model = tiny(family)
    c = model.cfg
    shift, eos, accepted = c.logit_shift, set(c.eos_token_ids), 0
    for prompt in PROMPTS:
        r = cbv.decode(model, prompt, 24, 8, 0.7, 0.05, False, 0.3, c.mask_token_id, eos, shift,
                       early_stop=False)
        P = len(prompt)
        assert r["checked"] == 0 and r["accepted"] == 0              # no in-block drafts
        assert [b for b, _, _ in r["cross_drafts"]] == [P + 8, P + 16]
        assert r["cross_checked"] == sum(len(d) for _, d, _ in r["cross_drafts"])
        accepted += r["cross_accepted"]
        for b1, slots, seen in r["cross_drafts"]:
            with torch.no_grad():
                logits = model(torch.tensor(seen)[None])[0].float()
            tok = logits.index_fill(1, torch.tensor([c.mask_token_id]), float("-inf")).argmax(-1)
            p_tok = torch.softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
            want = [s for s in range(b1, b1 + 8) if float(p_tok[s - shift]) >= 0.3]
            want.sort(key=lambda s: (-float(p_tok[s - shift]), s))
            assert slots == want and slots
        base = cbv.decode(model, prompt, 24, 8, 0.7, None, False, None, c.mask_token_id, eos,
                          shift, early_stop=False)
        no = cbv.decode(model, prompt, 24, 8, 0.7, 2.0, False, 0.3, c.mask_token_id, eos, shift,
                        early_stop=False)
        assert (no["canvas"], no["forwards"]) == (base["canvas"], base["forwards"])
    assert accepted > 0
