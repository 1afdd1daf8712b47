#!/usr/bin/env bash
# First H200 run of the session: GPU kernel tests, kernel microbenchmarks, the plain-path step
# baseline, serving at concurrency 1/8/32/64, and decode (threshold vs verify) wall time.
# Usage on the device: bash benchmarks/h200_run1.sh  (reports go to $OUT)
set -u
R=/tmp/r; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
t() { local s=$1; shift; echo "=== $*"; timeout $s "$@" ; echo "rc=$?"; }
t 150 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider
t 120 python3 benchmarks/bench_kernels.py --quick --out $R/kernels.json
t 200 python3 -m flash_dllm.cli bench step --cache prefix dual --json $R/step_plain_h200.json
t 60 python3 -m flash_dllm.cli bench step --model-shape demo --batch 1 8 64 --cache none prefix dual --json $R/step_demo_plain_h200.json
for c in 1 8 32 64; do
  n=$(( c * 2 > 16 ? c * 2 : 16 ))
  t 60 python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64 --concurrency $c --requests $n --json $R/serve_h200_c$c.json > /dev/null
done
for s in arith code; do for d in threshold verify; do
  t 60 python3 -m flash_dllm.cli eval --suite $s --n 100 --device cuda --max-num-seqs 1 --decode $d --cache dual --no-progress --json $R/eval_${s}_${d}_dual_b1_h200.json
done; done
tar czf $OUT/run1.tgz -C /tmp r
