#!/usr/bin/env bash
# Third session, run 2: GPU tests (new kernels, fused step); step benchmarks with the fused
# argmax-confidence proposal and the fused whole-step graph (threshold), LLaDA-8B and demo shapes.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
timeout 240 python3 -m pytest -m gpu tests/gpu -q -x -s 2>&1 | grep -v "^$" | tail -n 25
B="python3 -m flash_dllm.cli bench step"
timeout 60 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --decode threshold --json $OUT/r/step_demo_threshold.json 2>&1 | grep -v Warn
timeout 60 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --decode threshold --no-fused-step --json $OUT/r/step_demo_threshold_nofuse.json 2>&1 | grep -v Warn
timeout 60 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --json $OUT/r/step_demo_vanilla.json 2>&1 | grep -v Warn
timeout 200 $B --batch 1 8 64 --cache dual --decode threshold --json $OUT/r/step_h200_threshold.json 2>&1 | grep -v Warn
timeout 150 $B --batch 1 64 --cache dual --json $OUT/r/step_h200_vanilla.json 2>&1 | grep -v Warn
