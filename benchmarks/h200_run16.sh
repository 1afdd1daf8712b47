#!/usr/bin/env bash
# Fourth session, run 16: all GPU tests (output kept), the fused QKV kernel's tile sweep, and the
# end-to-end A/B of the fused step (run 14 part B: general path first and last).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r /tmp/e2e
timeout 240 python3 -m pytest -m gpu tests/gpu -q --tb=short -rf > $OUT/r/gpu_tests.txt 2>&1
tail -n 3 $OUT/r/gpu_tests.txt
timeout 150 python3 benchmarks/sweep_qkv_rope.py --out $OUT/r/sweep_qkv_rope.json 2>&1 | grep -v Warn
E="python3 -m flash_dllm.cli eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode threshold --cache dual --no-progress"
timeout 60 $E --json /tmp/e2e/eval_b1_general_1.json | tail -n 1
timeout 60 $E --fused-step --json /tmp/e2e/eval_b1_fused.json | tail -n 1
timeout 60 $E --json /tmp/e2e/eval_b1_general_2.json | tail -n 1
S="python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64"
for c in 8 32; do
  n=$(( c * 8 ))
  timeout 60 $S --concurrency $c --requests $n --json /tmp/e2e/serve_c${c}_general.json | tail -n 1
  timeout 60 $S --concurrency $c --requests $n --fused-step --json /tmp/e2e/serve_c${c}_fused.json | tail -n 1
done
tar -C /tmp -czf $OUT/r/e2e.tar.gz e2e
