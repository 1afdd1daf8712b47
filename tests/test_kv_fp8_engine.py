"""``--kv-cache-dtype fp8`` end to end on the demo model (CPU): the pool holds fp8 pages and
about twice the tokens, answers stay those of the model's own dtype, every cache mode and the
fused step run on it, the tiers move its pages exactly, and what cannot carry the scales yet
refuses clearly."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import LLM, SamplingParams
from flash_dllm.cache.disk_format import check_record, encode_record
from flash_dllm.config import EngineConfig
from flash_dllm.disagg.migrate import refuse_fp8_kv
from conftest import EXACT

PROMPTS = ["Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?",
           "Write a Python function calc(s) that reverses the string s.",
           "A jar has 2 cookies. Amy adds 22 more, then takes 5. How many cookies are in the jar?",
           "Write a Python function calc(a, b) that returns the larger of a and b."]
FP8 = EngineConfig(kv_cache_dtype="fp8", num_kv_pages=64)


def _texts(llm: LLM, **params) -> list[str]:
    p = SamplingParams(max_tokens=64, **params)
    return [o.text for o in llm.generate(PROMPTS, p, use_tqdm=False)]


@pytest.fixture(scope="module")
def auto_llm():
    return LLM(engine_config=EngineConfig(num_kv_pages=64))


@pytest.fixture(scope="module")
def fp8_llm():
    return LLM(engine_config=FP8)


@pytest.mark.parametrize("params", [EXACT, {"decode": "threshold", "threshold": 0.9,
                                            "cache": "dual"},
                                    {"decode": "threshold", "cache": "prefix"},
                                    {"decode": "threshold", "cache": "flash"},
                                    {"decode": "verify", "cache": "dual"}],
                         ids=["exact", "dual", "prefix", "flash", "verify"])
def test_fp8_pages_give_the_answers_of_the_model_dtype(auto_llm, fp8_llm, params):
    runner = fp8_llm.engine.runner
    assert runner.kv.dtype == torch.float8_e4m3fn and runner.kv_scales is not None
    assert _texts(fp8_llm, **params) == _texts(auto_llm, **params)
    assert runner.kv_scales.amax() > 0            # pages were written through the scales


@pytest.mark.parametrize("decode", ["threshold", "verify"])
def test_fused_step_on_fp8_pages_equals_the_general_path(fp8_llm, decode):
    params = {"decode": decode, "threshold": 0.9, "cache": "dual"}
    fused = LLM(engine_config=EngineConfig(kv_cache_dtype="fp8", num_kv_pages=64,
                                           fused_step=True))
    assert _texts(fused, **params) == _texts(fp8_llm, **params)
    assert fused.engine.runner.fused is not None


def test_pool_of_fp8_pages_holds_twice_the_tokens_of_bf16():
    sizes = {}
    for dt in ("auto", "fp8"):
        llm = LLM(dtype="bfloat16", engine_config=EngineConfig(kv_cache_dtype=dt,
                                                               kv_cache_gb=0.01))
        sizes[dt] = llm.engine.runner.num_pages
    assert 1.9 < sizes["fp8"] / sizes["auto"] <= 2.0


def test_tier_round_trips_and_prefix_reuse_keep_fp8_pages_exact(fp8_llm):
    params = {"decode": "threshold", "threshold": 0.9, "cache": "dual"}
    stress = LLM(engine_config=EngineConfig(kv_cache_dtype="fp8", num_kv_pages=64,
                                            kv_tier_stress=True))
    assert _texts(stress, **params) == _texts(fp8_llm, **params)   # down and back every step
    reuse = LLM(engine_config=EngineConfig(kv_cache_dtype="fp8", num_kv_pages=64,
                                           prefix_reuse=True, kv_cpu_gb=0.01))
    p = SamplingParams(max_tokens=32, **params)
    first = reuse.generate(PROMPTS[:2], p, use_tqdm=False)
    follow = [q + o.text + " And then?" for q, o in zip(PROMPTS[:2], first)]
    reuse.generate(follow, p, use_tqdm=False)
    assert sum(reuse.engine.kv_manager.stats["hit_tokens"]) > 0


def test_a_cached_page_of_another_kv_dtype_is_a_miss(auto_llm, fp8_llm):
    """The KV dtype is part of a cached page's compatibility bytes (prefix-tree namespace, disk
    record header): a record written under auto is never served to an fp8 pool."""
    auto, fp8 = auto_llm.engine.runner.compat, fp8_llm.engine.runner.compat
    assert auto != fp8
    buf, nonce, key = bytearray(8192), b"n" * 16, b"k" * 16
    got = encode_record(buf, nonce, auto, key, 3, b"x" * 100)
    assert check_record(buf, got, nonce, fp8, key, 3, 4096)[0] == "compat_mismatch"
    got = encode_record(buf, nonce, fp8, key, 3, b"x" * 100)
    assert check_record(buf, got, nonce, fp8, key, 3, 4096) == (None, 100)


def test_bad_kv_cache_dtype_and_what_cannot_carry_scales_are_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'\], "
                                         r"got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' does not support kv_overflow_gb"):
        EngineConfig(kv_cache_dtype="fp8", kv_overflow_gb=0.1)
    with pytest.raises(ValueError, match="kv_offload_dtype must be bf16 or fp8 with it"):
        EngineConfig(kv_cache_dtype="fp8", kv_offload_dtype="int8")
    with pytest.raises(ValueError, match="not supported with prefill/decode disaggregation"):
        refuse_fp8_kv(FP8)
    refuse_fp8_kv(EngineConfig())                  # auto: fine
