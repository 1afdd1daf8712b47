"""Kernel micro-benchmarks: each Triton op against its PyTorch reference and torch equivalents.

Times with CUDA events through ``triton.testing.do_bench`` (median; it flushes L2 between runs, so
GB/s are HBM figures), counts the minimum bytes each op must move and reports achieved GB/s against
the measured device-to-device copy bandwidth (and TFLOP/s where the op has matmuls). Also checks
each Triton result against the reference once (max relative error). Writes a JSON report
(``--out``) and prints a table last. LLaDA-8B / Dream-7B shapes, bf16; < 3 minutes on an H200.

    python benchmarks/step/bench_kernels.py --out out/kernels.json
    python benchmarks/step/bench_kernels.py --quick --only confidence paged_attention

``confidence`` is the fused LM-head study kernel of ``benchmarks/studies/confidence.py`` (not used
by the engine). Without CUDA it runs the references only at tiny shapes (a smoke test of this
script).
"""
# ruff: noqa: B023 - every lambda below is timed inside the loop iteration that builds it
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import confidence  # noqa: E402 - benchmarks/studies/confidence.py: the fused LM-head study kernel
import paged_reference as paged  # noqa: E402 - tests/paged_reference.py: layout helpers
from flash_dllm.kernels import paged_attention, rmsnorm, rope_cache
from flash_dllm.kernels._triton import HAS_TRITON

LLADA = dict(name="llada8b", d=4096, H=32, Hkv=32, D=128, V=126464, mask=126336, theta=500000.0)
DREAM = dict(name="dream7b", d=3584, H=28, Hkv=4, D=128, V=152064, mask=151666, theta=1e6)
KERNELS = ("rmsnorm", "confidence", "rope_cache", "paged_attention")


class Bench:
    def __init__(self, cuda: bool, quick: bool) -> None:
        self.cuda, self.quick, self.rows = cuda, quick, []
        self.dev = torch.device("cuda" if cuda else "cpu")
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.copy_gbps = None

    def time_ms(self, fn) -> float:
        if self.cuda:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=10 if self.quick else 25,
                                                 rep=25 if self.quick else 50,
                                                 return_mode="median"))
        fn()
        t0 = time.perf_counter()
        n = 3
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    def copy_bandwidth(self) -> float:
        n = (1 << 28) if self.cuda else (1 << 22)                 # 512 MiB bf16 on the GPU
        src = torch.empty(n, dtype=self.dtype, device=self.dev).normal_()
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        self.copy_gbps = 2 * src.numel() * src.element_size() / ms / 1e6
        return self.copy_gbps

    def add(self, kernel: str, case: str, impl: str, fn, nbytes: int, flops: float = 0.0,
            err: float | None = None, extra: dict | None = None) -> dict:
        try:
            ms = self.time_ms(fn)
        except Exception as e:  # noqa: BLE001 (a failing impl is reported, the run goes on)
            row = dict(kernel=kernel, case=case, impl=impl, error=f"{type(e).__name__}: {e}")
            self.rows.append(row)
            print(f"  {kernel:16s} {case:28s} {impl:22s} FAILED {row['error'][:120]}", flush=True)
            return row
        gbps = nbytes / ms / 1e6
        row = dict(kernel=kernel, case=case, impl=impl, ms=round(ms, 5), bytes=int(nbytes),
                   gbps=round(gbps, 1),
                   pct_copy_bw=round(100 * gbps / self.copy_gbps, 1) if self.copy_gbps else None,
                   tflops=round(flops / ms / 1e9, 2) if flops else None,
                   max_rel_err=err, **(extra or {}))
        self.rows.append(row)
        print(f"  {kernel:16s} {case:28s} {impl:22s} {ms:9.4f} ms {gbps:8.0f} GB/s", flush=True)
        return row

    def finish_speedups(self) -> None:
        ref = {(r["kernel"], r["case"]): r["ms"] for r in self.rows
               if r.get("impl") == "reference" and "ms" in r}
        for r in self.rows:
            base = ref.get((r["kernel"], r["case"]))
            if base and "ms" in r:
                r["speedup_vs_reference"] = round(base / r["ms"], 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _randn(shape, b: Bench, scale=1.0, seed=0):
    g = torch.Generator(device=b.dev).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=b.dev) * scale).to(b.dtype)


# ---- per kernel ----------------------------------------------------------------------------------
def bench_rmsnorm(b: Bench) -> None:
    d = LLADA["d"] if b.cuda else 256
    sizes = (32, 2048) if b.quick else (32, 256, 2048, 16384)
    sizes = sizes if b.cuda else (8,)
    w = (1 + 0.1 * _randn(d, b)).to(b.dtype)
    for T in sizes:
        x, r = _randn((T, d), b, seed=1), _randn((T, d), b, seed=2)
        case = f"T={T} d={d}"
        es = x.element_size()
        nbytes = 4 * T * d * es + d * w.element_size()           # read x, r; write out, residual
        b.add("rmsnorm", case, "reference", lambda: rmsnorm.rmsnorm_reference(x, w, 1e-5, r),
              nbytes)
        if b.cuda and HAS_TRITON:
            got = rmsnorm.rmsnorm_triton(x, w, 1e-5, r)
            ref = rmsnorm.rmsnorm_reference(x, w, 1e-5, r)
            b.add("rmsnorm", case, "triton", lambda: rmsnorm.rmsnorm_triton(x, w, 1e-5, r),
                  nbytes, err=_rel(got[0], ref[0]))


def _torch_confidence(h, w, exclude):
    """What careful PyTorch does: bf16 cuBLAS logits [N, V] in HBM, then fp32 reductions."""
    logits = (h @ w.t()).float()                                  # [N, V]
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)
    logits[:, exclude] = float("-inf")
    tok = logits.argmax(-1)
    return tok, logp.gather(1, tok[:, None]).exp()[:, 0], ent


def bench_confidence(b: Bench) -> None:
    cfg = LLADA
    d, V, mask = (cfg["d"], cfg["V"], cfg["mask"]) if b.cuda else (128, 1000, 7)
    w = _randn((V, d), b, scale=0.05, seed=3)
    sizes = ((32, 2048) if b.quick else (32, 256, 2048)) if b.cuda else (8,)
    for N in sizes:
        h = _randn((N, d), b, seed=4)
        case = f"N={N} V={V} d={d}"
        nbytes = V * d * w.element_size() + N * d * h.element_size() + N * 16
        flops = 2.0 * N * V * d
        b.add("confidence", case, "reference",
              lambda: confidence.confidence_reference(h, w, mask), nbytes, flops)
        if not b.cuda:
            continue
        b.add("confidence", case, "torch_bf16_logits", lambda: _torch_confidence(h, w, mask),
              nbytes, flops)
        if not HAS_TRITON:
            continue
        ref = confidence.confidence_reference(h, w, mask)
        got = confidence.confidence_triton(h, w, mask)
        err = max(_rel(got[1], ref[1]), _rel(got[2], ref[2]))
        b.add("confidence", case, "triton", lambda: confidence.confidence_triton(h, w, mask),
              nbytes, flops, err=err, extra=dict(token_agree=float((got[0] == ref[0]).float()
                                                                    .mean())))
        if N <= 256 and not b.quick:                 # small sweep of tilings, for tuning
            for bv, bk, st, nw in ((128, 64, 3, 4), (128, 128, 3, 4), (128, 128, 4, 8),
                                   (64, 128, 4, 4), (256, 64, 3, 8)):
                kw = dict(block_v=bv, block_k=bk, num_stages=st, num_warps=nw)
                b.add("confidence", case, f"triton v{bv}k{bk}s{st}w{nw}",
                      lambda: confidence.confidence_triton(h, w, mask, **kw), nbytes, flops,
                      extra=dict(config=kw))


def bench_rope_cache(b: Bench) -> None:
    models = (LLADA, DREAM) if b.cuda else (dict(LLADA, H=4, Hkv=2, D=16),)
    sizes = ((32, 16384) if b.quick else (32, 2048, 16384)) if b.cuda else (8,)
    S = paged.DEFAULT_PAGE_SIZE
    for cfg in models:
        H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
        inv = rope_cache.inv_freq(D, cfg["theta"], b.dev)
        for T in sizes:
            P = paged.pages_needed(T, S) + 1
            cache = torch.zeros((1, 2, P, S, Hkv, D), dtype=b.dtype, device=b.dev)
            kc, vc = paged.layer_kv(cache, 0)
            qkv = _randn((T, (H + 2 * Hkv) * D), b, seed=5)
            q, k, v = rope_cache.split_qkv(qkv, H, Hkv, D)
            positions = torch.arange(T, device=b.dev)
            slots = torch.randperm(P * S, device=b.dev)[:T]
            es = qkv.element_size()
            nbytes = (T * (H + 2 * Hkv) * D * es          # read q, k, v
                      + T * H * D * es                    # write rotated q
                      + 2 * T * Hkv * D * es              # write k, v slots
                      + T * 16)                           # positions, slots
            case = f"{cfg['name']} T={T}"
            b.add("rope_cache", case, "reference",
                  lambda: rope_cache.rope_cache_reference(q, k, v, positions, kc, vc, slots, inv),
                  nbytes)
            if b.cuda and HAS_TRITON:
                ref_cache = cache.clone()
                rk, rv = paged.layer_kv(ref_cache, 0)
                ref = rope_cache.rope_cache_reference(q, k, v, positions, rk, rv, slots, inv)
                got = rope_cache.rope_cache_triton(q, k, v, positions, kc, vc, slots, inv)
                b.add("rope_cache", case, "triton",
                      lambda: rope_cache.rope_cache_triton(q, k, v, positions, kc, vc, slots,
                                                           inv),
                      nbytes, err=max(_rel(got, ref), _rel(cache, ref_cache)))


def bench_paged_attention(b: Bench) -> None:
    S = paged.DEFAULT_PAGE_SIZE
    if b.cuda:
        cases = [(LLADA, 1, 32, 1024), (LLADA, 8, 32, 1024), (LLADA, 32, 32, 1024),
                 (LLADA, 1, 1024, 1024), (DREAM, 8, 32, 1024), (DREAM, 32, 32, 1024)]
        if not b.quick:
            cases.insert(3, (LLADA, 64, 32, 1024))
    else:
        cases = [(dict(LLADA, H=4, Hkv=2, D=16), 2, 4, 40)]
    for cfg, B, qn, L in cases:
        H, Hkv, D = cfg["H"], cfg["Hkv"], cfg["D"]
        need = paged.pages_needed(L, S)
        perm = torch.randperm(B * need).tolist()                  # scattered pages
        table = paged.block_table([perm[i * need:(i + 1) * need] for i in range(B)], b.dev)
        cache = _randn((1, 2, B * need, S, Hkv, D), b, seed=6)
        kc, vc = paged.layer_kv(cache, 0)
        q = _randn((B * qn, H, D), b, seed=7)
        cu = torch.arange(0, B * qn + 1, qn, dtype=torch.int32, device=b.dev)
        lens = torch.full((B,), L, dtype=torch.int32, device=b.dev)
        es = q.element_size()
        nbytes = B * L * Hkv * D * es * 2 + 2 * B * qn * H * D * es     # K, V once; q, out
        flops = 4.0 * B * qn * L * H * D
        case = f"{cfg['name']} B={B} q={qn} L={L}"
        args = (q, kc, vc, cu, lens, table)
        b.add("paged_attention", case, "reference",
              lambda: paged_attention.paged_attention_reference(*args), nbytes, flops)
        if not b.cuda:
            continue
        # the torch equivalent without paging: dense [B, Hkv, L, D] K/V, SDPA (flash when it can)
        kd = torch.stack([paged.gather_kv(cache, 0, table[i], L)[0] for i in range(B)])
        vd = torch.stack([paged.gather_kv(cache, 0, table[i], L)[1] for i in range(B)])
        kd, vd = kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()
        qd = q.view(B, qn, H, D).transpose(1, 2)
        b.add("paged_attention", case, "sdpa_dense",
              lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=H != Hkv), nbytes,
              flops)
        if not HAS_TRITON:
            continue
        ref, ref_mass = paged_attention.paged_attention_reference(*args, return_mass=True)
        got, mass = paged_attention.paged_attention_triton(*args, qn, return_mass=True)
        b.add("paged_attention", case, "triton",
              lambda: paged_attention.paged_attention_triton(*args, qn), nbytes, flops,
              err=_rel(got, ref))
        b.add("paged_attention", case, "triton+mass",
              lambda: paged_attention.paged_attention_triton(*args, qn, return_mass=True),
              nbytes + B * L * 4, flops * 1.5, err=_rel(mass, ref_mass))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out/kernels.json", help="JSON report path")
    p.add_argument("--only", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--quick", action="store_true", help="fewer shapes, shorter timing")
    a = p.parse_args(argv)
    t0 = time.time()
    cuda = torch.cuda.is_available()
    b = Bench(cuda, a.quick)
    torch.manual_seed(0)
    if not cuda:
        print("no CUDA: timing the references only, at tiny shapes (script smoke test)")
    print(f"copy bandwidth: {b.copy_bandwidth():.0f} GB/s", flush=True)
    for name in a.only:
        with torch.no_grad():
            globals()[f"bench_{name}"](b)
        if cuda:
            torch.cuda.empty_cache()
    b.finish_speedups()
    import importlib.metadata as md
    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    report = dict(
        device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        torch=torch.__version__, triton=triton_version, dtype=str(b.dtype),
        copy_gbps=round(b.copy_gbps, 1), quick=a.quick, wall_s=round(time.time() - t0, 1),
        results=b.rows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}  "
          f"copy {report['copy_gbps']:.0f} GB/s  ({report['wall_s']} s) -> {out}")
    hdr = (f"{'kernel':16s} {'case':28s} {'impl':22s} {'ms':>9s} {'GB/s':>7s} {'%copy':>6s} "
           f"{'TFLOP/s':>8s} {'x ref':>6s} {'rel err':>8s}")
    print(hdr)
    print("-" * len(hdr))
    for r in b.rows:
        if "ms" not in r:
            print(f"{r['kernel']:16s} {r['case']:28s} {r['impl']:22s} ERROR {r['error'][:60]}")
            continue
        fmt = lambda v, f: (f % v) if v is not None else "-"
        print(f"{r['kernel']:16s} {r['case']:28s} {r['impl']:22s} {r['ms']:9.4f} "
              f"{r['gbps']:7.0f} {fmt(r['pct_copy_bw'], '%5.1f%%'):>6s} "
              f"{fmt(r['tflops'], '%8.1f'):>8s} {fmt(r.get('speedup_vs_reference'), '%6.2f'):>6s} "
              f"{fmt(r['max_rel_err'], '%8.1e'):>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
