"""``run_transfer_bench`` at a tiny size over gloo: two processes, three methods, bit-exact."""
from __future__ import annotations

import pytest

from flash_dllm.distributed.bench_transfer import (KV_SHAPES, KVShape, format_table,
                                                   run_transfer_bench)


def test_llada_kv_is_512_kib_per_token():
    assert KV_SHAPES["llada-8b"].bytes_per_token == 512 * 1024
    assert KV_SHAPES["llada-8b"].segment_shape(3) == (3, 32, 2, 16, 32, 128)


def test_transfer_bench_tiny_over_gloo():
    kv = KVShape(layers=4, kv_heads=2, head_dim=32, page_size=4)     # 1 KiB per token
    r = run_transfer_bench(kv, tokens=10, reps=2, warmup=1, timeout_s=120.0)
    assert r["pages"] == 3 and r["bytes"] == 3 * 4 * 1024 and r["fragments"] == 12
    assert r["fragment_bytes"] == 1024 and r["staging_offset"] == 0
    assert r["bit_exact"] == {"contiguous": True, "fragments_batched": True,
                              "fragments_each": True}
    for m, res in r["results"].items():
        assert len(res["times_s"]) == 2 and res["median_s"] > 0 and res["gbps"] > 0
    assert r["results"]["contiguous"]["ratio_to_contiguous"] == 1.0
    assert "fragments_each" in format_table(r)


def test_transfer_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="shape must be one of"):
        run_transfer_bench("gpt-2")
    with pytest.raises(ValueError, match="tokens must be an integer >= 1"):
        run_transfer_bench(tokens=0)
    with pytest.raises(ValueError, match="world must be 2"):
        run_transfer_bench(world=3)
    with pytest.raises(ValueError, match="methods must be a non-empty subset"):
        run_transfer_bench(methods=("scatter",))
    with pytest.raises(ValueError, match="page_size must be an integer >= 1"):
        KVShape(layers=1, kv_heads=1, head_dim=1, page_size=0)
