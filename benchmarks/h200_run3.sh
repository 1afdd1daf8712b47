#!/usr/bin/env bash
# Third H200 run: GPU tests, the step benchmark for every cache mode (LLaDA-8B shape and the demo
# model), and the decode matrix (accuracy / forwards / wall time) of the demo model on the GPU.
set -u
R=/tmp/r; mkdir -p $R
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t() { local s=$1; shift; echo "=== $*"; timeout $s "$@" ; echo "rc=$?"; }
t 150 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
t 270 python3 -m flash_dllm.cli bench step --cache prefix dual flash --json $R/step_h200.json
t 40 python3 -m flash_dllm.cli bench step --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual flash --json $R/step_demo_h200.json
tar czf $OUT/run3.tgz -C /tmp r
t 100 python3 -m flash_dllm.cli eval --suite arith --n 200 --device cuda --dtype bfloat16 --matrix --no-progress --json $R/eval_matrix_arith_h200.json
tar czf $OUT/run3.tgz -C /tmp r
