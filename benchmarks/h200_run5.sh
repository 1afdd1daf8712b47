#!/usr/bin/env bash
# Step benchmark after the asynchronous host->device copies (same cases as h200_run4.sh).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 300 python3 -m flash_dllm.cli bench step --cache prefix dual flash --json $OUT/r/step_h200.json
timeout 60 python3 -m flash_dllm.cli bench step --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual flash --json $OUT/r/step_demo_h200.json
