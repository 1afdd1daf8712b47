"""Each option whose values change what the engine does has one table of traits beside the code
that reads them (the warm-up levels, the KV pool dtypes, the overflow placements, the lazy-load
predictors, the verify rules); the step path and the server read the traits, never a name. The
config's choice lists (kept free of the heavier modules) name exactly those tables' keys."""
from __future__ import annotations

import pytest
import torch

from flash_dllm import config
from flash_dllm.cache.io.lazy_load import KEY_SUMMARIES, LAZY_PREDICTORS
from flash_dllm.cache.io.overflow_placement import OVERFLOW_PLACEMENTS, PLACEMENTS, ResidentSet
from flash_dllm.cache.paged import KV_POOL_DTYPES, kv_pool, kv_pool_dtype
from flash_dllm.decoding.verify import CUMULATIVE_RULES
from flash_dllm.knobs import knob_of
from flash_dllm.worker.warmup import LEVELS, WARMUP_LEVELS, batch_sizes, level_of


def test_config_choices_are_the_trait_tables_keys():
    assert config.VERIFY_RULES == tuple(CUMULATIVE_RULES)
    assert config.KV_CACHE_DTYPES == tuple(KV_POOL_DTYPES)
    assert tuple(knob_of(config.EngineConfig, "kv_placement").choices) == OVERFLOW_PLACEMENTS \
        == tuple(PLACEMENTS)
    assert tuple(knob_of(config.EngineConfig, "lazy_load_predictor").choices) \
        == LAZY_PREDICTORS == tuple(KEY_SUMMARIES)
    assert WARMUP_LEVELS == tuple(LEVELS)


def test_traits_say_what_each_value_does():
    assert kv_pool_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_pool_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn and kv_pool("fp8").quantized
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, got 'int4'"):
        kv_pool("int4")
    assert [ResidentSet(p, 4).active for p in OVERFLOW_PLACEMENTS] == [False, True, True]
    assert [ResidentSet(p, 4).graph is not None for p in OVERFLOW_PLACEMENTS] \
        == [False, False, True]
    assert not level_of("none").runs and level_of("minimal").runs
    assert batch_sizes("minimal", 8) == [1, 8] and batch_sizes("full", 8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="warmup must be one of"):
        level_of("some")
