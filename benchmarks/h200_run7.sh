#!/usr/bin/env bash
# Third session, run 1: skinny GEMM study; two independent, less-trained checkpoints (issue 5).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 200 python3 benchmarks/bench_gemm.py --out $OUT/r/gemm_h200.json 2>&1 | tail -n 40
timeout 150 python3 tools/train_demo.py --out $OUT/ckpt_s1 --seed 1 --minutes 1.5 --pool 100000 \
    --eval-n 100 --log-every 1000 2>&1 | tail -n 25
timeout 150 python3 tools/train_demo.py --out $OUT/ckpt_s2 --seed 2 --minutes 1.5 --pool 100000 \
    --d-model 128 --n-layers 4 --n-heads 4 --mlp 256 --eval-n 100 --log-every 1000 2>&1 | tail -n 25
cd $OUT && tar czf ckpts.tgz ckpt_s1 ckpt_s2 && rm -rf ckpt_s1 ckpt_s2
