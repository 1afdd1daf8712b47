"""``flash-dllm bench memory``: how fast KV pages move between the tiers, against a plain copy of
the same bytes measured in the same run.

- **GPU <-> pinned host** (L0 <-> L1): the offloader's stores (pack page-first, device checksums,
  device -> host copies) and loads (host -> device, verify, unpack) of ``pages`` pages of a pool
  of the model's shape, against one plain copy of the same number of bytes between a device
  tensor and a pinned host tensor (target: >= 80 % of it), for each offload dtype.
- **disk** (L1 <-> L2): page records written and read through the disk store against a plain
  sequential write / read of the same file (target: >= 70 %), when ``disk_path`` is given.

On the CPU the "device" is host memory too: the figures then only show the harness works.
"""
from __future__ import annotations

import statistics
import time

import torch

from flash_dllm.bench.shapes import shape_config
from flash_dllm.cache.io.kv_offload import MOVE_GROUP_PAGES, KVOffloader
from flash_dllm.cache.tiers import Block, Store
from flash_dllm.models.loader import parse_dtype
from flash_dllm.models.registry import resolve


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev: torch.device, reps: int) -> float:
    fn()
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run_memory_bench(shape: str = "demo", device: str = "cpu", dtype: str = "bfloat16",
                     pages: int = 64, page_size: int = 16, reps: int = 5,
                     offload_dtypes: tuple[str, ...] = ("bf16", "fp8", "int8"),
                     disk_path: str | None = None, disk_mb: int = 256,
                     group_pages: tuple[int, ...] | None = None, disk_reps: int = 5) -> dict:
    dev = torch.device(device)
    raw = shape_config(shape)
    cfg = resolve(raw).parse_config(raw)
    tdtype = parse_dtype(dtype)
    kv = torch.randn(cfg.num_layers, 2, pages + 1, page_size, cfg.num_kv_heads, cfg.head_dim,
                     device=dev).to(tdtype)
    page_bytes = kv[:, :, 0].numel() * kv.element_size()
    nbytes = page_bytes * pages
    pin = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    d2h = _time(lambda: host.copy_(src, non_blocking=True), dev, reps)
    h2d = _time(lambda: src.copy_(host, non_blocking=True), dev, reps)
    rows = []
    for od, group in ((od, g) for g in (group_pages or (MOVE_GROUP_PAGES,))
                      for od in offload_dtypes):
        off = KVOffloader(kv, pages, od, group_pages=group)
        blocks = [Block(i.to_bytes(16, "little")) for i in range(pages)]
        stores = [Store(b, i, i) for i, b in enumerate(blocks)]

        def store():
            off.run(stores)
            off.drain()
        t_store = _time(store, dev, reps)
        slots = list(range(pages))
        ids = list(range(1, pages + 1))
        keys = [b.key for b in blocks]
        t_load = _time(lambda: off.load(slots, ids, keys), dev, reps)
        ok = off.load(slots, ids, keys)
        rec = off.layout.nbytes * pages
        rows.append({"offload_dtype": od, "group_pages": group, "record_bytes": off.layout.nbytes,
                     "store_s": t_store, "load_s": t_load,
                     "store_GBps": nbytes / t_store / 1e9, "load_GBps": nbytes / t_load / 1e9,
                     "moved_bytes": rec,
                     # the pool bytes a page move delivers, over a plain copy of those bytes
                     "store_vs_plain_copy": d2h / t_store, "load_vs_plain_copy": h2d / t_load,
                     "verified": all(ok)})
    report = {"shape": shape, "device": str(dev), "dtype": dtype, "pages": pages,
              "page_size": page_size, "page_bytes": page_bytes,
              "plain_d2h_GBps": nbytes / d2h / 1e9, "plain_h2d_GBps": nbytes / h2d / 1e9,
              "pinned": pin, "tiers": rows}
    if disk_path is not None:
        from flash_dllm.bench.disk import bench_disk
        report["disk"] = bench_disk(disk_path, record_bytes=rows[0]["record_bytes"],
                                    nbytes=disk_mb << 20, reps=disk_reps)
    return report


def table(report: dict) -> str:
    lines = [f"{report['shape']} on {report['device']}: {report['pages']} pages of "
             f"{report['page_bytes'] / 2**20:.2f} MiB; plain copy D2H "
             f"{report['plain_d2h_GBps']:.1f} GB/s, H2D {report['plain_h2d_GBps']:.1f} GB/s",
             f"{'offload':8s} {'group':>5s} {'store GB/s':>11s} {'vs plain':>9s} {'load GB/s':>10s} "
             f"{'vs plain':>9s} {'verified':>9s}"]
    for r in report["tiers"]:
        lines.append(f"{r['offload_dtype']:8s} {r['group_pages']:5d} {r['store_GBps']:11.2f} "
                     f"{r['store_vs_plain_copy']:8.2f}x {r['load_GBps']:10.2f} "
                     f"{r['load_vs_plain_copy']:8.2f}x {str(r['verified']):>9s}")
    d = report.get("disk")
    if d:
        lines.append(f"disk: write {d.get('write_ratio', float('nan')):.2f}x, read "
                     f"{d.get('read_ratio', float('nan')):.2f}x of sequential")
    return "\n".join(lines)
