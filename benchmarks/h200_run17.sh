#!/usr/bin/env bash
# Fourth session, run 17 (final tables): the step table (prefix/dual/flash x batch 1/8/32/64,
# LLaDA-8B shape), the demo model's step, the batch-1/64 kernel profile, the fused QKV tile sweep
# inside CUDA graphs, host profiles of batch-1 eval with and without the fused step, and a serve
# A/B in the other order than run 16 (fused first).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
B="python3 -m flash_dllm.cli bench step"
timeout 280 $B --cache prefix dual flash --json $OUT/r/step_h200.json 2>&1 | grep -E "batch" | tail -n 12
timeout 60 $B --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 --cache dual --json $OUT/r/step_demo_h200.json 2>&1 | grep batch | tail -n 3
timeout 90 python3 benchmarks/profile_step.py --batch 1 64 --out $OUT/r/profile_h200.json 2>&1 | grep batch
timeout 100 python3 benchmarks/sweep_qkv_rope.py --shape llada-8b --out $OUT/r/sweep_qkv_rope.json 2>&1 | grep -E "T=|best"
E="python3 -m flash_dllm.cli eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode threshold --cache dual --no-progress"
for m in general fused; do
  f=""; [ $m = fused ] && f="--fused-step"
  timeout 60 python3 -m cProfile -o /tmp/p_$m.prof -m flash_dllm.cli eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode threshold --cache dual --no-progress $f | tail -n 1
  python3 -c "import pstats,sys; s=pstats.Stats('/tmp/p_$m.prof'); s.sort_stats('tottime').print_stats(25); s.sort_stats('cumulative').print_stats('engine|fused|packing|transfer', 30)" > $OUT/r/host_eval_b1_$m.txt 2>&1
done
S="python3 -m flash_dllm.cli bench serve --device cuda --max-num-seqs 64 --concurrency 8 --requests 64"
R='import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], "wall", r["wall_s"], "p50", r["latency_s"]["p50"], "p99", r["latency_s"]["p99"])'
timeout 60 $S --fused-step --json /tmp/s1.json > /dev/null 2>&1; python3 -c "$R" /tmp/s1.json fused-1
timeout 60 $S --json /tmp/s2.json > /dev/null 2>&1; python3 -c "$R" /tmp/s2.json general
timeout 60 $S --fused-step --json /tmp/s3.json > /dev/null 2>&1; python3 -c "$R" /tmp/s3.json fused-2
