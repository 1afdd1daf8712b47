"""benchmarks/verify/cross_block_study.py's decoding loop: without lookahead it is the engine's
threshold decoding (cache none) token for token, and forward for forward; with lookahead it commits
early only slots of the block after the one just completed (and, on these prompts, takes no more
forwards)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from flash_dllm.config import SamplingParams
from flash_dllm.entrypoints.llm import LLM

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "verify" / "cross_block_study.py"
_spec = importlib.util.spec_from_file_location("cross_block_study", _PATH)
cb = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("cross_block_study", cb)
_spec.loader.exec_module(cb)

PROMPTS = ["Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?",
           "What is 7 + 8?", "Tom had 40 apples and gave away 15. How many are left?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo")


def _ours(llm, prompt, tau_next, block=32):
    m = llm.engine.model
    return cb.decode(m, llm.tokenizer.encode(prompt), 64, block, 0.9, tau_next,
                     m.cfg.mask_token_id, set(m.cfg.eos_token_ids), m.cfg.logit_shift)


def test_without_lookahead_equals_the_engine_threshold_decoding(llm):
    params = SamplingParams(max_tokens=64, block_length=32, decode="threshold", threshold=0.9,
                            cache="none")
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        r = _ours(llm, prompt, None)
        assert r["tokens"] == out.token_ids
        assert r["forwards"] == out.num_forwards
        assert r["early"] == {}


def test_lookahead_commits_only_the_next_block_early(llm):
    base_f = la_f = early = 0
    for prompt in PROMPTS:         # blocks of 16: the demo's answers end in the second
        base, la = _ours(llm, prompt, None, 16), _ours(llm, prompt, 0.5, 16)
        P = len(llm.tokenizer.encode(prompt))
        # only into a block that was then decoded (an early stop drops the next block's)
        assert all(P + 16 <= s < P + 16 * len(la["per_block"]) for s in la["early"])
        assert all(la["canvas"][s] == t for s, t in la["early"].items())
        base_f, la_f = base_f + base["forwards"], la_f + la["forwards"]
        early += len(la["early"])
    assert early > 0 and la_f <= base_f
