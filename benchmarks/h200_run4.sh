#!/usr/bin/env bash
# Final H200 run of the session: GPU tests, step benchmark (LLaDA-8B shape, every cache mode; demo
# model), serving at concurrency 1/8/32/64 and decode wall time at batch 1. Reports under $OUT.
set -u
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t() { local s=$1; shift; echo "=== $*"; timeout $s "$@" ; echo "rc=$?"; }
t 150 python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
t 260 python3 -m flash_dllm.cli bench step --cache prefix dual flash --json $R/step_h200.json
t 40 python3 -m flash_dllm.cli bench step --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual flash --json $R/step_demo_h200.json
tar czf $OUT/run4.tgz -C /tmp r
for c in 1 8 32 64; do
  n=$(( c * 2 > 16 ? c * 2 : 16 ))
  t 40 python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64 --concurrency $c --requests $n --json $R/serve_h200_c$c.json > /dev/null
done
for s in arith code; do for d in threshold verify; do
  t 40 python3 -m flash_dllm.cli eval --suite $s --n 100 --device cuda --max-num-seqs 1 --decode $d --cache dual --no-progress --json $R/eval_${s}_${d}_dual_b1_h200.json
done; done
tar czf $OUT/run4.tgz -C /tmp r
