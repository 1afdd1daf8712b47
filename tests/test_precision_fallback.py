"""The precision-fallback sentinel (issue 40): a model quantized to int4 keeps an int8 copy; a
threshold step's slot whose entropy is above ``precision_fallback`` is held back and the
request's next forward runs on the int8 copy. The copy equals a plain int8 quantization, the
switch is exact, the sentinel counts, never stalls a request, runs on block-causal models, and
what cannot run refuses in one line."""
from __future__ import annotations

import pytest
import torch

from conftest import tiny_llada2_config, tiny_model, write_tiny_llada2_checkpoint
from flash_dllm import LLM, SamplingParams
from flash_dllm.config import QUANT_FALLBACK_MODES, EngineConfig
from flash_dllm.layers import quant
from flash_dllm.layers.quant import QuantError, fallback_precision, quantize_model

PROMPT = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"
ANSWER = "23-12=11. 23+11=34. #### 34"


def _ids():
    return torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("config", [None, tiny_llada2_config()], ids=["llada", "llada2-moe"])
def test_the_fallback_copy_is_the_finer_quantization_and_the_switch_is_exact(config):
    """Under ``fallback_precision`` the model computes as a plain int8 quantization of the same
    weights, outside it as the plain int4 one (dense projections and MoE experts alike)."""
    kw = {"config": config} if config else {"family": "llada"}
    both = tiny_model(seed=3, **kw)
    info = quantize_model(both, "int4", 32, fallback="int8")
    m4, m8 = tiny_model(seed=3, **kw), tiny_model(seed=3, **kw)
    quantize_model(m4, "int4", 32)
    quantize_model(m8, "int8", 32)
    with torch.no_grad():
        lo, want_lo = both(_ids()), m4(_ids())
        with fallback_precision():
            hi = both(_ids())
        want_hi = m8(_ids())
        after = both(_ids())                      # the switch is undone on exit
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi) and torch.equal(after, lo)
    assert not torch.equal(lo, hi)
    # the bytes: the copy is counted; a forward reads the main copy or the fallback one
    assert info["fallback"] == "int8" and info["fallback_bytes"] > 0
    assert info["weight_bytes"] == quant.weight_bytes(both)
    rb = info["read_bytes"]
    assert rb["main"] == info["weight_bytes"] - info["fallback_bytes"]
    assert rb["main"] < rb["fallback"] < info["weight_bytes"]


def test_bad_fallbacks_are_one_line_errors():
    m = tiny_model("llada", seed=0)
    for fb, msg in (("int4", "must be one of"), ("int8", "not finer than quantization='int8'")):
        mode = "int8" if fb == "int8" else "int4"
        with pytest.raises(QuantError, match=msg) as e:
            quantize_model(m, mode, 32, fallback=fb)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="quantization_fallback is a second copy"):
        EngineConfig(quantization_fallback="int8")
    with pytest.raises(ValueError, match=r"quantization_fallback must be one of"):
        EngineConfig(quantization="int4", quantization_fallback="int4")
    assert QUANT_FALLBACK_MODES == quant.FALLBACK_MODES


@pytest.fixture(scope="module")
def fb_llm():
    return LLM(quantization="int4", quantization_fallback="int8", quantization_group_size=32)


def _run(llm, prompts, **params):
    runner = llm.engine.runner
    before = runner.fallback_forwards
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, **params), use_tqdm=False)
    return outs, runner.fallback_forwards - before


def test_off_or_never_triggered_is_the_int4_model(fb_llm):
    """No sentinel, or one whose limit no slot reaches: the answer and the forwards of the plain
    int4 model; every slot it checks is counted, none triggers."""
    plain = LLM(quantization="int4", quantization_group_size=32)
    want = plain.generate([PROMPT], SamplingParams(max_tokens=32), use_tqdm=False)[0]
    (off,), n_off = _run(fb_llm, [PROMPT])
    (high,), n_high = _run(fb_llm, [PROMPT], precision_fallback=1e9)
    assert off.text == high.text == want.text == ANSWER
    assert off.num_forwards == high.num_forwards == want.num_forwards
    assert n_off == n_high == 0
    assert high.metrics["sentinel_checks"]["precision"] >= 1
    assert high.metrics["sentinel_triggers"]["precision"] == 0
    assert off.metrics["sentinel_checks"]["precision"] == 0


def test_triggered_slots_wait_for_a_fallback_forward_and_requests_finish(fb_llm):
    """A limit every uncertain slot exceeds: flagged slots are recomputed on the int8 copy (each
    trigger is followed by a fallback forward), the answer stays right, and a request without
    the sentinel in the same batch finishes too."""
    (out,), n = _run(fb_llm, [PROMPT], precision_fallback=1e-6)
    trig = out.metrics["sentinel_triggers"]["precision"]
    assert out.text == ANSWER
    assert trig >= 1 and 1 <= n < out.num_forwards
    # at most one step in two is held back: progress is never stalled
    assert out.num_forwards <= 2 * 32
    prompts = [PROMPT, "Write a Python function calc(s) that reverses the string s."]
    p_fb = SamplingParams(max_tokens=32, precision_fallback=1e-6)
    p_plain = SamplingParams(max_tokens=32)
    outs = fb_llm.generate(prompts, [p_fb, p_plain], use_tqdm=False)
    assert all(o.finished for o in outs) and outs[0].text == ANSWER
    assert outs[1].metrics["sentinel_checks"]["precision"] == 0


def test_refused_where_it_cannot_run(fb_llm):
    plain = LLM(quantization="int4", quantization_group_size=32)
    with pytest.raises(ValueError, match=r"precision_fallback needs a model loaded with a "
                                         r"fallback copy .*--quantization-fallback int8"):
        plain.generate([PROMPT], SamplingParams(max_tokens=32, precision_fallback=0.5))
    with pytest.raises(ValueError, match=r"precision_fallback runs with decode \['threshold'\], "
                                         r"got decode='vanilla'"):
        fb_llm.generate([PROMPT], SamplingParams(max_tokens=32, decode="vanilla",
                                                 precision_fallback=0.5))
    with pytest.raises(ValueError, match="precision_fallback must be a finite number > 0"):
        SamplingParams(precision_fallback=0)


def test_runs_on_a_block_causal_moe_model(tmp_path):
    folder = write_tiny_llada2_checkpoint(tmp_path / "llada2")
    llm = LLM(folder, quantization="int4", quantization_fallback="int8",
              quantization_group_size=32)
    block = llm.cfg.attention.block_size
    runner = llm.engine.runner
    before = runner.fallback_forwards
    out = llm.generate(["hello there"], SamplingParams(max_tokens=2 * block, block_length=block,
                                                       precision_fallback=1e-6),
                       use_tqdm=False)[0]
    assert out.finished and runner.fallback_forwards > before
    assert out.metrics["sentinel_triggers"]["precision"] >= 1
