#!/usr/bin/env bash
# Third session, run 7: serving and batch-1 decode wall time with the fused step (compare with
# serve_h200_c{1,8,32}.json and eval_arith_{threshold,verify}_dual_b1_h200.json of session 2).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
for c in 1 8 32; do
  n=$(( c * 2 > 16 ? c * 2 : 16 ))
  timeout 40 python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64 --concurrency $c --requests $n --json $OUT/r/serve_h200_c${c}_fused.json | tail -n 2
done
for d in threshold vanilla; do
  timeout 60 python3 -m flash_dllm.cli eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode $d --cache dual --no-progress --json $OUT/r/eval_arith_${d}_dual_b1_h200_fused.json | tail -n 2
done
