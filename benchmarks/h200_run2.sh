#!/usr/bin/env bash
# Second H200 run: GPU tests (kernels + engine), the paged/graph step benchmark for LLaDA-8B and the
# demo model, serving at concurrency 1/8/32/64, decode wall time. Reports go to $OUT.
set -u
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
t() { local s=$1; shift; echo "=== $*"; timeout $s "$@" ; echo "rc=$?"; }
t 200 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider
t 240 python3 -m flash_dllm.cli bench step --cache prefix dual --json $R/step_h200.json
t 60 python3 -m flash_dllm.cli bench step --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache none dual --json $R/step_demo_h200.json
for c in 1 8 32 64; do
  n=$(( c * 2 > 16 ? c * 2 : 16 ))
  t 60 python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64 --concurrency $c --requests $n --json $R/serve_h200_c$c.json > /dev/null
done
for s in arith code; do for d in threshold verify; do
  t 60 python3 -m flash_dllm.cli eval --suite $s --n 100 --device cuda --max-num-seqs 1 --decode $d --cache dual --no-progress --json $R/eval_${s}_${d}_dual_b1_h200.json
done; done
tar czf $OUT/run2.tgz -C /tmp r
