#!/usr/bin/env bash
# Fourth session, run 18 (final step table): after chunked q/k/v projection for large steps, the
# embeddings no longer held through the layers, and the QKV kernel's swept tiles; then the GPU
# tests that exercise those paths.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 300 python3 -m flash_dllm.cli bench step --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch" | tail -n 12
timeout 90 python3 -m pytest -m gpu tests/gpu/test_qkv_rope_cache_gpu.py tests/gpu/test_engine_gpu.py -k "qkv or paged_triton_matches_dense" -q --tb=short 2>&1 | tail -n 3
