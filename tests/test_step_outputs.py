"""``Engine.step``'s host outputs against the canvas they summarise: after every step, each
request's committed answer prefix is the left-contiguous run of committed ids cut at the first
end-of-answer id, ``new_token_ids`` are exactly what it grew by, and the prefix never shrinks."""
from __future__ import annotations

import pytest
import torch

from flash_dllm.config import SamplingParams
from flash_dllm.engine.engine import Engine
from test_paged_engine import LONG
from test_sampler import EOS, MASK, tiny


def _reference_prefix(req) -> list[int]:
    gen = req.canvas[req.prompt_len:].tolist()
    out = []
    for t in gen:
        if t == MASK or t == EOS:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("decode,threshold", [("threshold", 0.3), ("vanilla", 0.9),
                                              ("verify", 0.5)])
@pytest.mark.parametrize("eos_bias", [False, True])
def test_step_outputs_track_the_committed_prefix(decode, threshold, eos_bias):
    model = tiny("llada", seed=11)
    if eos_bias:                        # answers that end early (early stop, stop ids mid-block)
        with torch.no_grad():
            model.lm_head.weight[EOS] *= 3
    eng = Engine(model, model.cfg)
    params = [SamplingParams(max_tokens=m, block_length=8, decode=decode, threshold=threshold,
                             cache=c, steps=m // 2 if decode == "vanilla" else None)
              for m, c in [(16, "dual"), (24, "none"), (8, "prefix"), (16, "flash")]]
    reqs = [eng.add_request(p, sp) for p, sp in zip(LONG, params)]
    grown = {r.request_id: [] for r in reqs}
    seen_finished = set()
    while eng.has_unfinished():
        for out in eng.step():
            req = next(r for r in reqs if r.request_id == out.request_id)
            assert out.request_id not in seen_finished
            grown[out.request_id] += out.new_token_ids
            ref = _reference_prefix(req)
            assert out.num_tokens == len(ref) == len(grown[out.request_id])
            assert grown[out.request_id] == ref
            assert eng.output(req).token_ids == ref
            if out.finished:
                seen_finished.add(out.request_id)
    assert seen_finished == {r.request_id for r in reqs}
    for r in reqs:
        o = eng.output(r)
        assert o.finished and o.token_ids == _reference_prefix(r)
        assert o.finish_reason == ("stop" if EOS in r.canvas[r.prompt_len:].tolist() else "length")
