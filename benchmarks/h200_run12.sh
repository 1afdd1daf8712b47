#!/usr/bin/env bash
# Third session, run 6 (final table): fused steps up to 2048 block rows by default (run 11:
# batch 32/64 fused were as fast or faster on LLaDA-8B, 3x faster on the demo model).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
B="python3 -m flash_dllm.cli bench step"
timeout 300 $B --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch|floor" | tail -n 13
timeout 40 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --json $OUT/r/step_demo_vanilla.json 2>&1 | grep batch | tail -n 3
