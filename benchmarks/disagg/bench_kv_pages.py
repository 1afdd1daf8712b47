"""KV page pack / unpack bandwidth: the page-first kernels against a plain copy of the same bytes
and against the per-fragment copy loop other engines use.

The KV of a 10K-token prompt (LLaDA-8B: 625 pages of 16 tokens, 5.37 GB in bf16; Dream-7B:
0.57 GB) is gathered from random, non-contiguous pages of a pool twice its size. Device rows
(baseline: ``dst.copy_(src)`` of the same bytes, contiguous): pack, unpack, pack / unpack in fp8
and int8, pack in 4 layer groups (the disaggregation pipeline's granularity), and one ``copy_`` per
(page, layer, k/v) fragment. Host rows (baseline: one pinned-memory copy of the same bytes, each
way): pack to a device staging buffer + one copy to pinned memory (bf16 and fp8), the fragment
loop straight to pinned memory, and the load direction (pinned -> staging + unpack, fragment
loop). ``GB/s`` is payload (the pages' bf16 bytes) per second: a device copy reads and writes
them, so its HBM traffic is twice that; fp8/int8 rows move half the bytes for the same payload.
``vs_copy`` = time / the baseline's time (1.0 = as fast as a plain copy). On CUDA the pack
kernel is also swept over bytes per program, and every kernel checked against the reference once.

    python benchmarks/disagg/bench_kv_pages.py --json out/kv_pages.json
    python benchmarks/disagg/bench_kv_pages.py --smoke          # tiny shapes; runs on the CPU

Times: CUDA events, median of ``--reps`` (>= 10) after ``--warmup`` calls.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flash_dllm.kernels import kv_pages  # noqa: E402
from flash_dllm.kernels._triton import HAS_TRITON  # noqa: E402

MODELS = {"llada8b": dict(layers=32, kv_heads=32, head_dim=128),
          "dream7b": dict(layers=28, kv_heads=4, head_dim=128)}
SMOKE = {"llada8b": dict(layers=2, kv_heads=4, head_dim=16),
         "dream7b": dict(layers=3, kv_heads=1, head_dim=16)}
FP8 = torch.float8_e4m3fn


class Timer:
    def __init__(self, cuda: bool, reps: int, warmup: int) -> None:
        self.cuda, self.reps, self.warmup = cuda, reps, warmup

    def __call__(self, fn) -> float:
        """Median milliseconds of ``fn()``."""
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = []
        for _ in range(self.reps):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def _fragment_loop(pages, pool, ids: list[int], layers: int, pack: bool):
    """One ``copy_`` per (page, layer, k/v): what a layer-major offload does without a kernel.
    The views are made up front, so only the copies (their launches) are timed."""
    pairs = [(pages[i, layer, h], pool[layer, h, p]) for i, p in enumerate(ids)
             for layer in range(layers) for h in range(2)]
    if not pack:
        pairs = [(dst, src) for src, dst in pairs]

    def run():
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    return run


def bench_model(name: str, shape: dict, args, timer: Timer, dev: torch.device) -> dict:
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n = -(-args.tokens // args.page_size)
    pool_pages = args.pool_pages or 2 * n
    L, H, D, S = shape["layers"], shape["kv_heads"], shape["head_dim"], args.page_size
    kv = torch.empty((L, 2, pool_pages, S, H, D), dtype=dtype, device=dev).normal_()
    g = torch.Generator().manual_seed(0)
    ids_host = torch.randperm(pool_pages, generator=g)[:n]              # random, non-contiguous
    ids = ids_host.to(dev)
    ids_list = ids_host.tolist()
    shape_buf = kv_pages.packed_shape(kv, n)
    payload = kv_pages.packed_bytes(kv, n)
    buf = torch.empty(shape_buf, dtype=dtype, device=dev)
    src = torch.empty_like(buf).normal_()
    q8 = {q: torch.empty(shape_buf, dtype=q, device=dev) for q in (FP8, torch.int8)}
    sc = {q: torch.empty((n, L, 2, H), dtype=torch.float32, device=dev) for q in q8}
    rows: list[dict] = []

    def add(row_name: str, fn, base: str | None, moved: int | None = None) -> None:
        try:
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001 (a failing row is reported, the run goes on)
            rows.append(dict(name=row_name, error=f"{type(e).__name__}: {e}"))
            print(f"  {name} {row_name:26s} FAILED {rows[-1]['error'][:120]}", flush=True)
            return
        base_ms = next((r["ms"] for r in rows if r["name"] == base and "ms" in r), None)
        rows.append(dict(name=row_name, ms=round(ms, 4), gbps=round(payload / ms / 1e6, 1),
                         moved_bytes=moved if moved is not None else payload,
                         vs_copy=round(ms / base_ms, 3) if base_ms else None, baseline=base))
        print(f"  {name} {row_name:26s} {ms:10.3f} ms {payload / ms / 1e6:9.1f} GB/s", flush=True)

    def quant_bytes(q):
        return kv_pages.packed_bytes(kv, n, q)

    # ---- device -------------------------------------------------------------------------------
    add("d2d_copy", lambda: buf.copy_(src), None)
    add("pack", lambda: kv_pages.pack_pages(kv, ids, out=buf), "d2d_copy")
    add("unpack", lambda: kv_pages.unpack_pages(buf, ids, kv), "d2d_copy")
    for q, tag in ((FP8, "fp8"), (torch.int8, "int8")):
        add(f"pack_{tag}", lambda q=q: kv_pages.pack_pages(kv, ids, out=q8[q], out_scales=sc[q]),
            "d2d_copy", quant_bytes(q))
        add(f"unpack_{tag}", lambda q=q: kv_pages.unpack_pages(q8[q], ids, kv, sc[q]),
            "d2d_copy", quant_bytes(q))
    groups = [(g0, min(L, g0 + -(-L // 4))) for g0 in range(0, L, -(-L // 4))]
    views = [torch.empty(kv_pages.packed_shape(kv, n, grp), dtype=dtype, device=dev)
             for grp in groups]

    def pack_groups():
        for grp, out in zip(groups, views):
            kv_pages.pack_pages(kv, ids, out=out, layers=grp)
    add(f"pack_{len(groups)}_layer_groups", pack_groups, "d2d_copy")
    del views
    add("fragment_loop_pack", _fragment_loop(buf, kv, ids_list, L, True), "d2d_copy")
    if cuda and HAS_TRITON:
        for nbytes in args.block_bytes:
            blk = nbytes // kv.element_size()
            add(f"pack[{nbytes // 1024}KiB/program]",
                lambda blk=blk: kv_pages.pack_pages_triton(kv, ids, out=buf, block=blk),
                "d2d_copy")
    # ---- host ---------------------------------------------------------------------------------
    if not args.no_host:
        def host(t):
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        host_buf, host_q, host_sc = host(buf), host(q8[FP8]), host(sc[FP8])

        def pack_d2h():
            kv_pages.pack_pages(kv, ids, out=buf)
            host_buf.copy_(buf, non_blocking=True)

        def pack_fp8_d2h():
            kv_pages.pack_pages(kv, ids, out=q8[FP8], out_scales=sc[FP8])
            host_q.copy_(q8[FP8], non_blocking=True)
            host_sc.copy_(sc[FP8], non_blocking=True)

        def h2d_unpack():
            buf.copy_(host_buf, non_blocking=True)
            kv_pages.unpack_pages(buf, ids, kv)
        add("d2h_copy", lambda: host_buf.copy_(src, non_blocking=True), None)
        add("pack+d2h", pack_d2h, "d2h_copy")
        add("pack_fp8+d2h", pack_fp8_d2h, "d2h_copy", quant_bytes(FP8))
        add("fragment_loop_d2h", _fragment_loop(host_buf, kv, ids_list, L, True), "d2h_copy")
        add("h2d_copy", lambda: src.copy_(host_buf, non_blocking=True), None)
        add("h2d+unpack", h2d_unpack, "h2d_copy")
        add("fragment_loop_h2d", _fragment_loop(host_buf, kv, ids_list, L, False), "h2d_copy")
        del host_buf, host_q, host_sc
    checks = check_against_reference(kv, ids, dev) if cuda and HAS_TRITON else {}
    return dict(model=name, pages=n, page_size=S, pool_pages=pool_pages, layers=L, kv_heads=H,
                head_dim=D, dtype=str(dtype), payload_bytes=payload, rows=rows, checks=checks)


def check_against_reference(kv: torch.Tensor, ids: torch.Tensor, dev: torch.device) -> dict:
    """Kernel == reference on a few pages: bit-exact copies, identical quantised bytes/scales and
    dequantised pool values."""
    sub = ids[:8]
    out = {}
    got, _ = kv_pages.pack_pages_triton(kv, sub)
    ref, _ = kv_pages.pack_pages_reference(kv, sub)
    out["pack_bit_exact"] = bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
    spare = kv.new_zeros(kv.shape[0], 2, 8, *kv.shape[3:])
    dst = torch.arange(8, device=dev)
    kv_pages.unpack_pages_triton(got, dst, spare)
    out["round_trip_bit_exact"] = bool(torch.equal(spare.permute(2, 0, 1, 3, 4, 5)
                                                   .view(torch.int16), ref.view(torch.int16)))
    for q, tag in ((FP8, "fp8"), (torch.int8, "int8")):
        got_q, got_s = kv_pages.pack_pages_triton(kv, sub, out_dtype=q)
        ref_q, ref_s = kv_pages.pack_pages_reference(kv, sub, out_dtype=q)
        out[f"pack_{tag}_equal"] = bool(torch.equal(got_q.view(torch.uint8),
                                                    ref_q.view(torch.uint8))
                                        and torch.equal(got_s, ref_s))
        a, b = spare.clone(), spare.clone()
        kv_pages.unpack_pages_triton(ref_q, dst, a, ref_s)
        kv_pages.unpack_pages_reference(ref_q, dst, b, ref_s)
        out[f"unpack_{tag}_equal"] = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
        x, deq = ref.float(), a.permute(2, 0, 1, 3, 4, 5).float()
        out[f"{tag}_max_rel_err"] = float((x - deq).abs().max() / x.abs().max())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--tokens", type=int, default=10000, help="prompt tokens to move")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-pages", type=int, default=0, help="pool size (default: 2x the pages)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-bytes", type=int, nargs="*", default=[4096, 8192, 16384, 32768],
                   help="pack kernel sweep: bytes per program (CUDA only)")
    p.add_argument("--no-host", action="store_true", help="skip the pinned-memory rows")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and reps (CPU test)")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    if a.smoke:
        a.tokens, a.page_size, a.reps, a.warmup = 32, 4, 2, 1
    elif cuda:
        a.reps = max(a.reps, 10)
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA (or --smoke): the PyTorch references at tiny shapes (a smoke test)")
    timer = Timer(cuda, a.reps, a.warmup)
    t0 = time.time()
    models = []
    with torch.no_grad():
        for name in a.models:
            models.append(bench_model(name, (SMOKE if not cuda else MODELS)[name], a, timer, dev))
            if cuda:
                torch.cuda.empty_cache()
    import importlib.metadata as md
    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    report = dict(device=torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                  torch=torch.__version__, triton=triton_version, smoke=a.smoke,
                  reps=a.reps, warmup=a.warmup, wall_s=round(time.time() - t0, 1),
                  models=models)
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}  "
          f"({report['wall_s']} s){'  -> ' + a.json if a.json else ''}")
    hdr = f"{'model':8s} {'op':26s} {'ms':>10s} {'GB/s':>9s} {'vs copy':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for m in models:
        for r in m["rows"]:
            if "ms" not in r:
                print(f"{m['model']:8s} {r['name']:26s} ERROR {r['error'][:60]}")
                continue
            vs = f"{r['vs_copy']:.2f}x" if r["vs_copy"] else "base"
            print(f"{m['model']:8s} {r['name']:26s} {r['ms']:10.3f} {r['gbps']:9.1f} {vs:>8s}")
        if m["checks"]:
            print(f"{m['model']:8s} checks: {m['checks']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
