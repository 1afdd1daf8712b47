"""Experiment (superseded by ``sweep_skinny_gemm.py``): a minimal Triton skinny bf16 GEMM (split-K
summed in-kernel) against cuBLAS ``F.linear`` at SDAR-4B's batch-1 block-4 shapes (4 rows) and
LLaDA-8B's (32 rows), timed in CUDA graphs that replay ONE weight: weights of up to ~40 MB stay
in the H100's L2, so the figures flatter both sides for the small shapes (the sweep cycles
through copies). Usage: ``python3 benchmarks/step/skinny_bf16_l2warm.py OUT.json BUDGET_S``."""
import itertools, json, sys, time
import torch, torch.nn.functional as F
import triton, triton.language as tl

@triton.jit
def _k(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, KPS, SPLIT: tl.constexpr,
       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BM); cols = pid_n * BN + tl.arange(0, BN)
    rok, cok = rows < M, cols < N
    acc = tl.zeros((BM, BN), tl.float32)
    k0 = pid_k * KPS
    for k in range(k0, k0 + KPS, BK):
        ks = k + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rok[:, None], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=cok[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(w))
    om = rok[:, None] & cok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=om)
    else:
        part = part_ptr + rows[:, None] * N + cols[None, :]
        tl.store(part + pid_k * M * N, acc, mask=om)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:
            acc = tl.zeros((BM, BN), tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(part + s * M * N, mask=om, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=om)
            tl.atomic_xchg(cnt, 0)

CNT = None
def run(x, w, out, part, BN, BK, SPLIT, warps, stages):
    M, K = x.shape; N = w.shape[0]
    _k[(triton.cdiv(N, BN), SPLIT)](x, w, out, part, CNT, M, N, K, K // SPLIT, SPLIT=SPLIT,
        BM=16 if M <= 16 else 32, BN=BN, BK=BK, num_warps=warps, num_stages=stages)

def gtime(fn, reps=20):
    fn(); s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3): g.replay()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / (3 * reps) * 1e3

def main():
    global CNT
    dev = torch.device("cuda"); CNT = torch.zeros(65536, dtype=torch.int32, device=dev)
    shapes = [("sdar_qkv", 4, 6144, 2560), ("sdar_o", 4, 2560, 4096), ("sdar_gate_up", 4, 19456, 2560),
              ("sdar_down", 4, 2560, 9728), ("llada_qkv", 32, 12288, 4096), ("llada_down", 32, 4096, 12288)]
    res = []; t_end = time.monotonic() + float(sys.argv[2])
    for name, M, N, K in shapes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16); w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
        ref = F.linear(x, w); cub = gtime(lambda: F.linear(x, w))
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16); part = torch.empty(8, M, N, device=dev)
        best = None
        for BN, BK, SPLIT, warps, stages in itertools.product([32, 64, 128], [64, 128, 256], [1, 2, 4, 8], [4], [3, 4]):
            if time.monotonic() > t_end or K % (SPLIT * BK): continue
            try:
                run(x, w, out, part, BN, BK, SPLIT, warps, stages)
                err = (out.float() - ref.float()).abs().max().item()
                us = gtime(lambda: run(x, w, out, part, BN, BK, SPLIT, warps, stages))
            except Exception as e:
                print(name, BN, BK, SPLIT, stages, type(e).__name__, str(e)[:80]); continue
            if best is None or us < best[0]: best = (us, dict(BN=BN, BK=BK, SPLIT=SPLIT, warps=warps, stages=stages), err)
        gb = N * K * 2 / 1e3
        row = dict(shape=name, M=M, N=N, K=K, cublas_us=cub, cublas_GBps=gb / cub,
                   triton_us=best and best[0], triton_GBps=best and gb / best[0], triton_cfg=best and best[1], max_err=best and best[2])
        print(json.dumps(row), flush=True); res.append(row)
    json.dump(res, open(sys.argv[1], "w"), indent=1)

main()
