#!/usr/bin/env bash
# Fourth session, run 14 (part B): end-to-end with and without the fused step (demo model), more
# requests than run 13 so that captured graphs are replayed; the general path runs first and
# last (the first run also fills the Triton compile cache).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
E="python3 -m flash_dllm.cli eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode threshold --cache dual --no-progress"
timeout 60 $E --json $OUT/r/eval_b1_general_1.json | tail -n 1
timeout 60 $E --fused-step --json $OUT/r/eval_b1_fused.json | tail -n 1
timeout 60 $E --json $OUT/r/eval_b1_general_2.json | tail -n 1
S="python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64"
for c in 8 32; do
  n=$(( c * 8 ))
  timeout 60 $S --concurrency $c --requests $n --json $OUT/r/serve_c${c}_general.json | tail -n 1
  timeout 60 $S --concurrency $c --requests $n --fused-step --json $OUT/r/serve_c${c}_fused.json | tail -n 1
done
