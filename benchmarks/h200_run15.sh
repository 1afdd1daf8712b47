#!/usr/bin/env bash
# Fourth session, run 15: GPU tests (split-KV attention, fused QKV + RoPE + page write, SiLU-mul),
# the batch-1/64 kernel profile with and without the fused QKV kernel, and the dual step table.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 240 python3 -m pytest -m gpu tests/gpu -q --tb=line -rf 2>&1 | grep -vE "^\s*$|warn" | tail -n 12
P="python3 benchmarks/profile_step.py"
timeout 100 $P --batch 1 64 --out $OUT/r/profile_fused.json 2>&1 | grep batch
FLASH_DLLM_FUSED_QKV=0 timeout 60 $P --batch 1 --out $OUT/r/profile_fused_noqkv.json 2>&1 | grep batch
timeout 200 python3 -m flash_dllm.cli bench step --cache dual --json $OUT/r/step_dual.json 2>&1 | grep -E "batch" | tail -n 4
