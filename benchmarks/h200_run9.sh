#!/usr/bin/env bash
# Third session, run 3 (final): GPU tests; the full step table (vanilla, every cache mode); the
# threshold rows (fused whole-step graph up to 256 block rows); demo-model rows.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 200 python3 -m pytest -m gpu tests/gpu -q -s 2>&1 | grep -E "passed|failed|FAIL|Error|fused vs" | tail -n 20
B="python3 -m flash_dllm.cli bench step"
timeout 45 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 --cache dual --decode threshold --json $OUT/r/step_demo_threshold.json 2>&1 | grep batch
timeout 30 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 64 --cache dual --decode threshold --json $OUT/r/step_demo_threshold_b64.json 2>&1 | grep batch
timeout 45 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --json $OUT/r/step_demo_vanilla.json 2>&1 | grep batch
timeout 280 $B --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch|floor"
timeout 100 $B --batch 1 8 32 64 --cache dual --decode threshold --json $OUT/r/step_h200_threshold.json 2>&1 | grep batch
