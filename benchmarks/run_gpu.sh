#!/usr/bin/env bash
# Reruns the GPU test suite and every GPU figure flash-dllm publishes (benchmarks/README.md) on one
# CUDA GPU (the published figures come from one H200), in sequence.
#
#   benchmarks/run_gpu.sh [OUTDIR [GROUP ...]]
#
# OUTDIR  where reports go, in one subfolder per topic as under benchmarks/results (default:
#         benchmarks/results, i.e. replace the committed reports);
#         command logs and a summary go to OUTDIR/logs/ (git ignores benchmarks/results/logs/).
# GROUP   any of the groups below (default: all of them, ~35 min). Each group fits in 10 minutes
#         on an H200, so a machine that limits a command to 10 minutes runs one or two at a time:
#           tests    GPU tests: tests/gpu and benchmarks/studies                 ~4 min
#           step     bench step, LLaDA-8B shape and demo model                    ~6 min
#           profile  kernel-by-kernel profile of batch 1 and 64                   ~2 min
#           sweep    fused QKV + RoPE + page-write tile sweep                     ~2 min
#           kernels  kernel microbenchmarks                                       ~2 min
#           gemm     skinny-GEMM study (cuBLAS vs TunableOp vs Triton)            ~3 min
#           serve    serving at c1, 8, 32, 64; first 64 after ready (demo, 8B)   ~6 min
#           eval     accuracy matrix, exact-sampler accuracy, batch-1 verify      ~6 min
#           ab       fused step on/off end to end (eval batch 1, serve c8)        ~5 min
#           pd       disaggregation on one GPU: tests, pack/unpack, bench pd       ~7 min
#           quant    weight-only GEMM tile sweep (writes $OUT/kernel-configs), then bench step
#                    of bf16 / fp8 / int4 with those tiles (batch 1; fp8 / int4 also with the
#                    LM head quantized, MODE+head), bf16 / fp8 at batch 64; LLaDA2-mini int4
#                    experts (and int4+head); the int4 words' study (JOIN = 3); fp8_skinny's tiles ~12 min
#           skinny   few-row bf16 GEMM: GPU test, sweep vs cuBLAS (writes $OUT/kernel-configs),
#                    SDAR-4B batch 1 without / with its tiles                          ~6 min
#           pdl      programmatic dependent launch (opt-in: FLASH_DLLM_PDL=1 or 2): its GPU test,
#                    SDAR-4B batch 1 and LLaDA-8B batch-1 bf16 / fp8 / int4, PDL 0 / 1 / 2  ~6 min
#           kvfp8    bench step with fp8 KV pages against the model dtype; its profile  ~2 min
#           families bench step of sdar-4b (block 4, batch 1 / 128), sdar-30b-a3b, llada-moe-7b,
#                    llada2-mini with its random router                                 ~1.5 min
#           llada2   the LLaDA2 proxy: GPU graph test and its accuracy, both suites; serving
#                    the mini shape at c1 / 32 / 64 (needs the server extras)       ~6 min
#           deterministic  the batch-invariance GPU tests, then bench step with and without
#                    --deterministic, batch 1 and 64 (issue 44: its cost)             ~3 min
#           rope     the RoPE kernels' arithmetic against torch's (kernel tests, printing the
#                    share of values that differ), the LLaDA2 proxy's answers with the kernel's
#                    rotary against the PyTorch rotary (findings/moe.md)          ~2 min
#           host     the host's share of a fused batch-1 step (benchmarks/step/host_time.py):
#                    SDAR-4B block 4 and LLaDA-8B dual, the block summary in Python rows (main)
#                    against numpy, alternating                                     ~3 min
#           multistep  several fused steps per engine step (engine/multi_step.py): its GPU
#                    test, SDAR-4B block 4 batch 1 / 128 and LLaDA-8B dual batch 1 bf16 / int4,
#                    --multi-step 1 against the default, alternating                 ~5 min
#           firststeps  block-start steps of the block cache as fused steps (off by default):
#                    their GPU test, SDAR-4B batch 1 / 128 and LLaDA2-mini batch 1 / 64 with
#                    --fused-first-steps against without                            ~4 min
#           attnfp8  paged attention's key tile and fp8 pages' fp16 dots (the defaults since
#                    this A/B): the attention GPU tests (defaults, then the old kernel), the
#                    kernel study at batch 64 (bf16 / fp8 / fp8 fp16 dots by tile), bench step
#                    batch 64 bf16 / fp8 pages with 64- and 128-key tiles (FLASH_DLLM_ATTN_BLOCK_N,
#                    fp8 with FLASH_DLLM_ATTN_FP8_F16=0), fp8 pages with fp16 dots; the fp8
#                    write's codes rounded by the cast (the default since this A/B): its
#                    bit-exact tests and the step with the software round
#                    (FLASH_DLLM_KV_FP8_HW_ROUND=0)                                 ~3 min
#
# A failing command is recorded and the run goes on; the exit status is non-zero if any failed.
# Needs the package importable from this checkout with its server and plot extras
# (pip install -e ".[dev]"), a CUDA build of torch and triton.
set -euo pipefail
export PYTHONUNBUFFERED=1

ALL_GROUPS=(tests step profile sweep kernels gemm serve eval ab pd quant kvfp8 families skinny pdl llada2 deterministic rope host multistep firststeps attnfp8)
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then usage; exit 0; fi
OUT=${1:-$ROOT/benchmarks/results}
[[ $# -ge 1 ]] && shift
for g in "${ALL_GROUPS[@]}"; do
  if [[ "$OUT" == "$g" ]]; then
    echo "run_gpu.sh: the first argument is the output directory, got the group '$g'" >&2
    echo "            (e.g. benchmarks/run_gpu.sh benchmarks/results $g)" >&2
    exit 2
  fi
done
GROUPS_TO_RUN=("$@")
[[ ${#GROUPS_TO_RUN[@]} -eq 0 ]] && GROUPS_TO_RUN=("${ALL_GROUPS[@]}")
for g in "${GROUPS_TO_RUN[@]}"; do
  if [[ " ${ALL_GROUPS[*]} " != *" $g "* ]]; then
    echo "run_gpu.sh: unknown group '$g' (groups: ${ALL_GROUPS[*]})" >&2
    exit 2
  fi
done

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)            # absolute: the commands run from the repository root
mkdir -p "$OUT"/{step,serving,accuracy,cache-modes,verify,disagg}   # one folder per topic
LOGS=$OUT/logs
mkdir -p "$LOGS"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
FD=(python3 -m flash_dllm.cli)     # = the flash-dllm console script

NAMES=() STATUS=() SECS=() REPORTS=()
FAILED=0

# run NAME LIMIT_S REPORT CMD...: run CMD with a time limit, output to the screen and
# LOGS/NAME.log; a failure (or a report the command did not write) is recorded, never fatal.
run() {
  local name=$1 limit=$2 report=$3
  shift 3
  local t0=$SECONDS rc=0 marker=$LOGS/.start_$name
  echo
  echo "=== $name: $*"
  touch "$marker"
  timeout --signal=TERM --kill-after=30 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" || rc=$?
  if [[ $rc -eq 0 && "$report" != "-" && ! ( -s "$report" && "$report" -nt "$marker" ) ]]; then
    echo "run_gpu.sh: $name exited 0 but did not write $report" | tee -a "$LOGS/$name.log"
    rc=1
  fi
  rm -f "$marker"
  local status=ok
  if [[ $rc -ne 0 ]]; then
    status="FAIL($rc)"
    [[ $rc -eq 124 || $rc -eq 137 ]] && status="TIMEOUT"
    FAILED=$((FAILED + 1))
  fi
  NAMES+=("$name") STATUS+=("$status") SECS+=($((SECONDS - t0)))
  REPORTS+=("${report#"$OUT"/}")
  echo "=== $name: $status in $((SECONDS - t0)) s"
}

group_tests() {
  run gpu_tests 420 - python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider
  run gpu_tests_studies 90 - python3 -m pytest -m gpu benchmarks/studies -q -p no:cacheprovider
}

card() {     # the card's short name for report names: h100 / h200 (gpu otherwise)
  python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h100' if 'H100' in n else 'h200' if 'H200' in n else 'gpu')"
}

group_host() {
  local C
  C=$(card)
  # issue 41: the host's part of a batch-1 step (pre / replay to result / post), and the small
  # steps' block summary in plain Python (main) against numpy, two runs each, alternating
  # (one forward per engine step: a multi-step call overlaps the three parts)
  local SD=(bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 --steps 200
            --multi-step 1)
  local LL=(bench step --quantization none --cache dual --batch 1 --steps 60 --multi-step 1)
  for i in 1 2; do
    for arm in rows numpy; do
      local flag=()
      if [[ $arm == numpy ]]; then flag=(--numpy-summary); fi
      run host_sdar4b_${arm}_$i 120 "$OUT/step/host_time_sdar4b_b1_${arm}_${i}_$C.json" \
        python3 benchmarks/step/host_time.py "${flag[@]}" \
        --json-host "$OUT/step/host_time_sdar4b_b1_${arm}_${i}_$C.json" -- "${SD[@]}" \
        --json "$OUT/step/step_sdar4b_block4_b1_host_${arm}_${i}_$C.json"
    done
  done
  for arm in rows numpy; do
    local flag=()
    if [[ $arm == numpy ]]; then flag=(--numpy-summary); fi
    run host_llada8b_${arm} 120 "$OUT/step/host_time_llada8b_b1_${arm}_$C.json" \
      python3 benchmarks/step/host_time.py "${flag[@]}" \
      --json-host "$OUT/step/host_time_llada8b_b1_${arm}_$C.json" -- "${LL[@]}" \
      --json "$OUT/step/step_quant_b1_host_${arm}_$C.json"
  done
}

group_multistep() {
  # issue 41: the host's work on step i overlapping the device's step i + 1; reports named by
  # the card (h100 / h200)
  local C
  C=$(card)
  run multistep_gpu_test 180 - python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu/test_multi_step_gpu.py
  local SD=(bench step --model-shape sdar-4b --cache block --block-length 4 --steps 200)
  for i in 1 2; do
    for n in 1 4; do
      run sdar4b_ms${n}_$i 150 "$OUT/step/step_sdar4b_block4_ms${n}_${i}_$C.json" \
        "${FD[@]}" "${SD[@]}" --batch 1 --multi-step $n \
        --json "$OUT/step/step_sdar4b_block4_ms${n}_${i}_$C.json"
    done
  done
  for n in 1 4; do
    run sdar4b_b128_ms$n 120 "$OUT/step/step_sdar4b_block4_b128_ms${n}_$C.json" \
      "${FD[@]}" "${SD[@]}" --batch 128 --multi-step $n \
      --json "$OUT/step/step_sdar4b_block4_b128_ms${n}_$C.json"
    run llada8b_ms$n 150 "$OUT/step/step_quant_b1_ms${n}_$C.json" \
      "${FD[@]}" bench step --quantization none int4 --cache dual --batch 1 --multi-step $n \
      --json "$OUT/step/step_quant_b1_ms${n}_$C.json"
  done
}

group_firststeps() {
  local C
  C=$(card)
  run firststeps_gpu_test 180 - python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu/test_multi_step_gpu.py -k block_starts
  for arm in general fused; do
    local flag=()
    if [[ $arm == fused ]]; then flag=(--fused-first-steps); fi
    run sdar4b_first_$arm 150 "$OUT/step/step_sdar4b_block4_first_${arm}_$C.json" \
      "${FD[@]}" bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 128 \
      --steps 200 "${flag[@]}" --json "$OUT/step/step_sdar4b_block4_first_${arm}_$C.json"
    run llada2_mini_first_$arm 150 "$OUT/step/step_llada2_mini_first_${arm}_$C.json" \
      "${FD[@]}" bench step --model-shape llada2-mini --cache block --batch 1 64 \
      --routing uniform "${flag[@]}" --json "$OUT/step/step_llada2_mini_first_${arm}_$C.json"
  done
}

group_rope() {
  run rope_gpu_tests 180 - python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_kernels_gpu.py tests/gpu/test_qkv_rope_cache_gpu.py -k rope
  run rope_engine_gpu_test 180 - python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_engine_gpu.py -k partial_rotary
}

group_step() {
  run step_h200 420 "$OUT/step/step_h200.json" \
    "${FD[@]}" bench step --cache prefix dual flash --json "$OUT/step/step_h200.json"
  run step_demo_h200 120 "$OUT/step/step_demo_h200.json" \
    "${FD[@]}" bench step --model-shape demo --prompt-len 256 --gen-len 256 --batch 1 8 64 \
    --cache dual --json "$OUT/step/step_demo_h200.json"
}

group_quant() {
  # issue 40: first the weight-only GEMMs' tile sweep (timed in CUDA graphs), whose winners are
  # written as this card's tuned config under $OUT/kernel-configs (commit it to
  # flash_dllm/kernels/configs/ once the steps below confirm it); then one random-init model per
  # weight mode, dual steps side by side, with those tiles (each row's floor is from its mode's
  # stored bytes); then LLaDA2-mini's int4 experts against bf16
  run sweep_quant_gemm_h200 300 "$OUT/step/sweep_quant_gemm_h200.json" \
    python3 benchmarks/step/sweep_quant_gemm.py --codes fp8 int4 --rows 32 --buckets 32 1 8 64 \
    --keep 4 --budget-s 110 --write-config "$OUT/kernel-configs" \
    --out "$OUT/step/sweep_quant_gemm_h200.json"
  # fp8's small calls (fp8_skinny: x quantized in blocks inside an FP8 x FP8 GEMM): its tiles at
  # 32 rows against the W8A16 read of the same codes, written beside the sweep's
  run study_fp8_skinny_h200 200 "$OUT/step/study_fp8_skinny_h200.json" \
    python3 benchmarks/step/study_fp8_skinny.py --rows 32 --configs-out "$OUT/kernel-configs" \
    --out "$OUT/step/study_fp8_skinny_h200.json"
  # the int4 words (JOIN = 3, int4's GPU layout): their GPU test, then timed against the byte read
  run int4_words_gpu_test 120 - python3 -m pytest -m gpu -q -s tests/gpu/test_quant_gpu.py \
    -k int4_words
  run study_int4_words_h200 180 "$OUT/step/study_int4_words_h200.json" \
    python3 benchmarks/step/study_int4_words.py --out "$OUT/step/study_int4_words_h200.json"
  run step_quant_h200 330 "$OUT/step/step_quant_h200.json" \
    env FLASH_DLLM_KERNEL_CONFIGS="$OUT/kernel-configs" \
    "${FD[@]}" bench step --quantization none fp8 fp8+head int4 int4+head --cache dual \
    --batch 1 --json "$OUT/step/step_quant_h200.json"
  # the byte layout in the same call (FLASH_DLLM_INT4_WORDS=0): the words' gain in the step
  run step_quant_bytes_h200 180 "$OUT/step/step_quant_bytes_h200.json" \
    env FLASH_DLLM_KERNEL_CONFIGS="$OUT/kernel-configs" FLASH_DLLM_INT4_WORDS=0 \
    "${FD[@]}" bench step --quantization none int4 --cache dual --batch 1 \
    --json "$OUT/step/step_quant_bytes_h200.json"
  run step_quant_b64_h200 240 "$OUT/step/step_quant_b64_h200.json" \
    "${FD[@]}" bench step --quantization none fp8 int4 --cache dual --batch 64 \
    --json "$OUT/step/step_quant_b64_h200.json"
  run step_quant_llada2_mini_h200 180 "$OUT/step/step_quant_llada2_mini_h200.json" \
    "${FD[@]}" bench step --model-shape llada2-mini --cache block \
    --quantization none int4 int4+head --batch 1 --routing uniform \
    --json "$OUT/step/step_quant_llada2_mini_h200.json"
  # the many-row path's dequantize kernel and fp8's per-token quantization, by variant
  run sweep_dequant_h200 90 "$OUT/step/sweep_dequant_h200.json" python3 benchmarks/step/sweep_dequant.py \
    "$OUT/step/sweep_dequant_h200.json"
  run sweep_quant_rows_h200 60 "$OUT/step/sweep_quant_rows_h200.json" \
    python3 benchmarks/step/sweep_quant_rows.py \
    "$OUT/step/sweep_quant_rows_h200.json"
}

group_kvfp8() {
  # issue 40: fp8 K/V pages must not slow the batch-64 step (same card, same call)
  for dt in auto fp8; do
    run step_kv_${dt}_h200 240 "$OUT/step/step_kv_${dt}_h200.json" \
      "${FD[@]}" bench step --kv-cache-dtype $dt --cache dual --batch 1 64 \
      --json "$OUT/step/step_kv_${dt}_h200.json"
  done
  for dt in fp8 auto; do
    run profile_kv${dt}_h200 120 "$OUT/step/profile_kv${dt}_h200.json" \
      python3 benchmarks/step/profile_step.py --kv-cache-dtype $dt --batch 1 64 --steps 4 \
      --out "$OUT/step/profile_kv${dt}_h200.json"
  done
}

group_attnfp8() {
  # issue 40: fp8 K/V pages must not slow the batch-64 step; the kernel's fp8 read was bound by
  # neither HBM nor issue in the static count (benchmarks/step/sass_attention_loop.py): its
  # tiles and fp16 dots, timed (MANY_KEYS_BLOCK_N / FP8_F16 in kernels/paged_attention were
  # set from this A/B: findings/quantization.md)
  local C
  C=$(card)
  # the attention tests with the defaults (128-key tiles, fp16 dots on fp8 pages), then with
  # the old kernel (64 keys, bf16 dots), which the switches keep for A/B
  local T=(tests/gpu/test_kernels_gpu.py tests/gpu/test_quant_gpu.py
           tests/gpu/test_deterministic_gpu.py -k "paged or fp8_pages or rope_cache_fp8")
  run attn_gpu_tests 150 - python3 -m pytest -m gpu -q -p no:cacheprovider "${T[@]}"
  run attn_gpu_tests_switches 150 - env FLASH_DLLM_ATTN_BLOCK_N=64 FLASH_DLLM_ATTN_FP8_F16=0 \
    python3 -m pytest -m gpu -q -p no:cacheprovider "${T[@]}"
  run study_attn_fp8_$C 180 "$OUT/step/study_attn_fp8_$C.json" \
    python3 benchmarks/step/study_attn_fp8.py --out "$OUT/step/study_attn_fp8_$C.json"
  local bn dt
  for bn in 128 64; do
    for dt in auto fp8; do
      run step_kv_${dt}_bn${bn}_$C 120 "$OUT/step/step_kv_${dt}_bn${bn}_b64_$C.json" \
        env FLASH_DLLM_ATTN_BLOCK_N=$bn FLASH_DLLM_ATTN_FP8_F16=0 "${FD[@]}" bench step \
        --kv-cache-dtype $dt \
        --cache dual --batch 64 --steps 20 --json "$OUT/step/step_kv_${dt}_bn${bn}_b64_$C.json"
    done
  done
  run step_kv_fp8_f16_$C 120 "$OUT/step/step_kv_fp8_f16_b64_$C.json" \
    env FLASH_DLLM_ATTN_BLOCK_N=128 FLASH_DLLM_ATTN_FP8_F16=1 "${FD[@]}" bench step \
    --kv-cache-dtype fp8 --cache dual --batch 64 --steps 20 \
    --json "$OUT/step/step_kv_fp8_f16_b64_$C.json"
  # the fp8 write's codes rounded by the e4m3 cast alone (FLASH_DLLM_KV_FP8_HW_ROUND, the
  # default since this A/B): its bit-exact GPU tests, then the step with the software round
  # beside the default's (the row above)
  run kv_fp8_hw_round_tests 120 - python3 -m pytest -m gpu -q -p no:cacheprovider \
    tests/gpu/test_quant_gpu.py -k rope_cache_fp8
  run step_kv_fp8_sw_round_$C 120 "$OUT/step/step_kv_fp8_sw_round_b64_$C.json" \
    env FLASH_DLLM_KV_FP8_HW_ROUND=0 "${FD[@]}" bench step --kv-cache-dtype fp8 --cache dual \
    --batch 64 --steps 20 --json "$OUT/step/step_kv_fp8_sw_round_b64_$C.json"
}

group_families() {
  # issue 41 (and 39's re-check of the CUDA-graph fix at batch 64 with the random router)
  run step_sdar4b_h200 240 "$OUT/step/step_sdar4b_block4_h200.json" \
    "${FD[@]}" bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 128 \
    --json "$OUT/step/step_sdar4b_block4_h200.json"
  run step_sdar30b_h200 240 "$OUT/step/step_sdar30b_block4_uniform_h200.json" \
    "${FD[@]}" bench step --model-shape sdar-30b-a3b --cache block --block-length 4 --batch 1 \
    --routing uniform --json "$OUT/step/step_sdar30b_block4_uniform_h200.json"
  run step_lladamoe_h200 240 "$OUT/step/step_llada_moe_7b_h200.json" \
    "${FD[@]}" bench step --model-shape llada-moe-7b --cache prefix dual --batch 1 \
    --routing uniform --json "$OUT/step/step_llada_moe_7b_h200.json"
  run step_llada2_mini_h200 240 "$OUT/step/step_llada2_mini_block_h200.json" \
    "${FD[@]}" bench step --model-shape llada2-mini --cache block --batch 1 8 64 \
    --json "$OUT/step/step_llada2_mini_block_h200.json"
}

group_skinny() {
  # issue 41: the few-row bf16 GEMM (off unless tuned): its GPU test, the sweep against cuBLAS
  # with weights from HBM (writes $OUT/kernel-configs), then SDAR-4B batch 1 without / with it
  run skinny_gpu_test 120 - python3 -m pytest -m gpu -q tests/gpu/test_skinny_gemm_gpu.py
  run sweep_skinny_gemm_h200 300 "$OUT/step/sweep_skinny_gemm_h200.json" \
    python3 benchmarks/step/sweep_skinny_gemm.py --budget-s 200 \
    --write-config "$OUT/kernel-configs" --out "$OUT/step/sweep_skinny_gemm_h200.json"
  # the baseline: empty entries for SDAR-4B's shapes (cuBLAS), whatever the package holds
  python3 -c "import sys, torch
from flash_dllm.kernels import tuned_configs as t
name = torch.cuda.get_device_name(0)
keys = ['N6144_K2560', 'N2560_K4096', 'silu_N9728_K2560', 'N2560_K9728']
t.write(t.config_path('skinny_gemm', name, sys.argv[1]), 'skinny_gemm', name,
        {k: {'4': {}, '8': {}} for k in keys}, 'run_gpu.sh: cuBLAS baseline')" \
    "$OUT/kernel-configs-cublas"
  run step_sdar4b_b1_cublas_h200 120 "$OUT/step/step_sdar4b_block4_b1_cublas_h200.json" \
    env FLASH_DLLM_KERNEL_CONFIGS="$OUT/kernel-configs-cublas" "${FD[@]}" bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 \
    --json "$OUT/step/step_sdar4b_block4_b1_cublas_h200.json"
  run step_sdar4b_b1_skinny_h200 120 "$OUT/step/step_sdar4b_block4_b1_skinny_h200.json" \
    env FLASH_DLLM_KERNEL_CONFIGS="$OUT/kernel-configs" \
    "${FD[@]}" bench step --model-shape sdar-4b --cache block --block-length 4 --batch 1 \
    --json "$OUT/step/step_sdar4b_block4_b1_skinny_h200.json"
}

group_pdl() {
  # issues 40, 41: the step's kernels launched with PDL (FLASH_DLLM_PDL=1) against plain
  # launches, same card, same call
  run pdl_gpu_test 120 - python3 -m pytest -m gpu -q tests/gpu/test_pdl_gpu.py
  for p in 0 1 2; do
    run step_sdar4b_b1_pdl${p}_h200 120 "$OUT/step/step_sdar4b_block4_b1_pdl${p}_h200.json" \
      env FLASH_DLLM_PDL=$p "${FD[@]}" bench step --model-shape sdar-4b --cache block \
      --block-length 4 --batch 1 --json "$OUT/step/step_sdar4b_block4_b1_pdl${p}_h200.json"
    run step_quant_b1_pdl${p}_h200 180 "$OUT/step/step_quant_b1_pdl${p}_h200.json" \
      env FLASH_DLLM_PDL=$p "${FD[@]}" bench step --quantization none fp8 int4 --cache dual \
      --batch 1 --json "$OUT/step/step_quant_b1_pdl${p}_h200.json"
  done
}

group_llada2() {
  # issue 39: the trained LLaDA2 proxy under CUDA graphs, then its accuracy (exact / threshold)
  run llada2_gpu_test 240 - python3 -m pytest -m gpu -q tests/gpu/test_engine_gpu.py -k block_causal_moe
  # the half-head rotary in the RoPE kernel against the PyTorch rotary path, answers on the proxy
  run llada2_rope_gpu_test 120 - python3 -m pytest -m gpu -q -s tests/gpu/test_engine_gpu.py \
    -k partial_rotary
  for S in chain code-long; do
    run llada2_exact_$S 120 "$OUT/accuracy/eval_exact_llada2_${S}_h200.json" \
      "${FD[@]}" eval --model proxy-llada2 --suite $S --n 200 --device cuda --dtype float32 \
      --decode vanilla --cache block --no-progress --json "$OUT/accuracy/eval_exact_llada2_${S}_h200.json"
    run llada2_threshold_$S 120 "$OUT/accuracy/eval_threshold_llada2_${S}_h200.json" \
      "${FD[@]}" eval --model proxy-llada2 --suite $S --n 200 --device cuda --dtype float32 \
      --decode threshold --threshold 0.9 --cache block --no-progress \
      --json "$OUT/accuracy/eval_threshold_llada2_${S}_h200.json"
  done
  # serving the mini shape (random weights) at concurrency 1 / 32 / 64: 0 compiles after ready
  run serve_llada2_mini_h200 360 "$OUT/serving/serve_llada2_mini_h200.json" \
    "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --warmup full \
    --model-shape llada2-mini --max-tokens 64 --concurrency 1 32 64 --requests 16 128 256 \
    --json "$OUT/serving/serve_llada2_mini_h200.json"
}

group_deterministic() {
  # issue 44: fixed-tile GEMMs and batch-invariant launches: bitwise checks, then their cost
  run deterministic_gpu_tests 240 - python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/gpu/test_deterministic_gpu.py
  run step_deterministic_off_h200 150 "$OUT/step/step_deterministic_off_h200.json" \
    "${FD[@]}" bench step --cache dual --batch 1 64 --json "$OUT/step/step_deterministic_off_h200.json"
  run step_deterministic_on_h200 150 "$OUT/step/step_deterministic_on_h200.json" \
    "${FD[@]}" bench step --cache dual --batch 1 64 --deterministic \
    --json "$OUT/step/step_deterministic_on_h200.json"
}

group_profile() {
  run profile_step_h200 240 "$OUT/step/profile_step_h200.json" \
    python3 benchmarks/step/profile_step.py --batch 1 64 --out "$OUT/step/profile_step_h200.json"
}

group_sweep() {
  run sweep_qkv_rope_h200 240 "$OUT/step/sweep_qkv_rope_h200.json" \
    python3 benchmarks/step/sweep_qkv_rope.py --shape llada-8b \
    --out "$OUT/step/sweep_qkv_rope_h200.json"
}

group_kernels() {
  run kernels_h200 240 "$OUT/step/kernels_h200.json" \
    python3 benchmarks/step/bench_kernels.py --quick --out "$OUT/step/kernels_h200.json"
}

group_gemm() {
  run gemm_h200 420 "$OUT/step/gemm_h200.json" \
    python3 benchmarks/step/bench_gemm.py --out "$OUT/step/gemm_h200.json"
}

group_serve() {
  # one server (warmed up before ready) serves every concurrency in turn (issue 21)
  run serve_warmup_h200 300 "$OUT/serving/serve_warmup_h200.json" \
    "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --warmup full \
    --concurrency 1 8 32 64 --requests 512 --json "$OUT/serving/serve_warmup_h200.json"
  # the first 64 requests after ready against the next 64 (a fresh server each)
  run serve_first64_h200 200 "$OUT/serving/serve_first64_h200.json" \
    "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --warmup full \
    --concurrency 32 32 --requests 64 --json "$OUT/serving/serve_first64_h200.json"
  run serve_steady_llada8b_h200 360 "$OUT/serving/serve_steady_llada8b_h200.json" \
    "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --warmup full \
    --model-shape llada-8b --max-tokens 64 --concurrency 1 32 64 --requests 32 256 512 \
    --json "$OUT/serving/serve_steady_llada8b_h200.json"
  run serve_first64_llada8b_h200 300 "$OUT/serving/serve_first64_llada8b_h200.json" \
    "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --warmup full \
    --model-shape llada-8b --max-tokens 64 --concurrency 32 32 --requests 64 \
    --json "$OUT/serving/serve_first64_llada8b_h200.json"
}

group_pd() {
  # prefill and decode workers sharing the GPU (CUDA IPC) must equal colocated serving
  run pd_gpu_tests 300 - env FLASH_DLLM_PD_DEVICE=cuda python3 -m pytest tests/test_disagg.py \
    -q -p no:cacheprovider -k "colocated or abort_in_every"
  run kv_pages_h200 240 "$OUT/disagg/kv_pages_h200.json" \
    python3 benchmarks/disagg/bench_kv_pages.py --json "$OUT/disagg/kv_pages_h200.json"
  run pd_h200 420 "$OUT/disagg/pd_h200.json" \
    "${FD[@]}" bench pd --parts serve --device cuda --dtype bfloat16 --model-shape llada-8b \
    --kv-cache-gb 24 --pd-staging-gb 8 --long-prompt 3072 --short-prompt 64 --long-frac 0.25 \
    --requests 48 --rate 6 --max-tokens 64 --block-length 32 --json "$OUT/disagg/pd_h200.json"
}

group_eval() {
  local s d
  run eval_matrix_arith_h200 240 "$OUT/cache-modes/eval_matrix_arith_h200.json" \
    "${FD[@]}" eval --suite arith --n 200 --device cuda --dtype bfloat16 --matrix --no-progress \
    --json "$OUT/cache-modes/eval_matrix_arith_h200.json"
  for s in arith code; do
    run "eval_exact_${s}_h200" 120 "$OUT/accuracy/eval_exact_${s}_h200.json" \
      "${FD[@]}" eval --suite "$s" --n 500 --device cuda --max-num-seqs 512 --no-progress \
      --json "$OUT/accuracy/eval_exact_${s}_h200.json"
  done
  for s in arith code; do
    for d in threshold verify; do
      run "eval_${s}_${d}_dual_b1_h200" 60 "$OUT/verify/eval_${s}_${d}_dual_b1_h200.json" \
        "${FD[@]}" eval --suite "$s" --n 100 --device cuda --max-num-seqs 1 --decode "$d" \
        --cache dual --no-progress --json "$OUT/verify/eval_${s}_${d}_dual_b1_h200.json"
    done
  done
}

group_ab() {
  local ab=$OUT/step/fused_step_ab_h200 name flag
  mkdir -p "$ab"
  # batch-1 eval: general path first and last (the first process also fills Triton's cache)
  for name in general_1 fused general_2; do
    flag=(--no-fused-step); [[ $name == fused ]] && flag=(--fused-step)
    run "ab_eval_b1_$name" 90 "$ab/eval_b1_$name.json" \
      "${FD[@]}" eval --suite arith --n 100 --device cuda --max-num-seqs 1 --decode threshold \
      --cache dual --no-progress ${flag[@]+"${flag[@]}"} --json "$ab/eval_b1_$name.json"
  done
  # serving at concurrency 8: fused first and last
  for name in fused_1 general fused_2; do
    flag=(--no-fused-step); [[ $name == fused_* ]] && flag=(--fused-step)
    run "ab_serve_c8_$name" 90 "$ab/serve_c8_$name.json" \
      "${FD[@]}" bench serve --device cuda --max-num-seqs 64 --concurrency 8 --requests 64 \
      ${flag[@]+"${flag[@]}"} --json "$ab/serve_c8_$name.json"
  done
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1 || true
  echo "groups: ${GROUPS_TO_RUN[*]}"
} | tee "$LOGS/env.txt"

for g in "${GROUPS_TO_RUN[@]}"; do
  "group_$g"
done

{
  echo
  printf '%-34s %-10s %6s  %s\n' "command" "status" "secs" "report (under $OUT)"
  for i in "${!NAMES[@]}"; do
    printf '%-34s %-10s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${REPORTS[$i]}"
  done
  echo "$((${#NAMES[@]} - FAILED)) of ${#NAMES[@]} commands ok; logs in $LOGS"
} | tee "$LOGS/summary.txt"
[[ $FAILED -eq 0 ]]
