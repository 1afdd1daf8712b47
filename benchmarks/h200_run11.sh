#!/usr/bin/env bash
# Third session, run 5: GPU tests with the fused vanilla step; the final step table (vanilla:
# fused at batch 1 and 8); demo vanilla rows; fused steps above the default 256-row cap.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 150 python3 -m pytest -m gpu tests/gpu -q -s 2>&1 | grep -E "passed|failed|FAIL|Error|fused vs" | tail -n 20
B="python3 -m flash_dllm.cli bench step"
timeout 40 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --json $OUT/r/step_demo_vanilla.json 2>&1 | grep batch | tail -n 3
timeout 40 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 64 --cache dual --fused-step-max-rows 4096 --json $OUT/r/step_demo_vanilla_b64_fused.json 2>&1 | grep batch | tail -n 1
timeout 230 $B --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch|floor" | tail -n 13
timeout 60 $B --batch 32 64 --cache dual --fused-step-max-rows 4096 --json $OUT/r/step_h200_fused_b32_b64.json 2>&1 | grep batch | tail -n 2
