#!/usr/bin/env bash
# Fourth session, run 14 (part A): GPU tests at HEAD, the step with the masked-row LM head and the
# fused SiLU-mul, and a kernel-by-kernel profile of batch 1 and 64 (dual).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 200 python3 -m pytest -m gpu tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py -q -x 2>&1 | tail -n 4
B="python3 -m flash_dllm.cli bench step"
timeout 120 $B --cache dual --batch 1 64 --json $OUT/r/step_dual_fused.json 2>&1 | grep -E "batch" | tail -n 2
timeout 100 $B --cache dual --batch 64 --no-fused-step --json $OUT/r/step_dual_b64_general.json 2>&1 | grep -E "batch" | tail -n 1
timeout 120 python3 benchmarks/profile_step.py --batch 1 64 --out $OUT/r/profile_fused.json 2>&1 | tail -n 3
timeout 120 python3 benchmarks/profile_step.py --batch 1 64 --no-cuda-graphs --out $OUT/r/profile_eager.json 2>&1 | tail -n 3
