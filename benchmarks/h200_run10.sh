#!/usr/bin/env bash
# Third session, run 4 (final step table): after the engine<->fused-step cycle fix (run 9's peaks
# carried the previous case's engine).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
B="python3 -m flash_dllm.cli bench step"
timeout 280 $B --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch|floor" | tail -n 13
timeout 100 $B --batch 1 8 32 64 --cache dual --decode threshold --json $OUT/r/step_h200_threshold.json 2>&1 | grep batch | tail -n 4
timeout 45 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --decode threshold --json $OUT/r/step_demo_threshold.json 2>&1 | grep batch | tail -n 3
