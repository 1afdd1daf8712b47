"""One request's KV as one contiguous segment against per-(layer, page) fragments, in one run.

Why the segment is contiguous: on 2xH200 over NVLink (NCCL) 5.37 GB of LLaDA-8B KV took 14.7 ms as
one send and 188.6 ms as per-(layer, page) fragments; on this CPU with gloo 2,560 fragments were
2-2.8x slower than one send when batched and 3-76x when sent one at a time (shared/BENCH.md,
"Transfer"). ``run_transfer_bench`` measures the three in two processes of one host:

- ``contiguous``: ``TorchDistTransport.send`` of the whole segment, received into a slice of a
  staging buffer given by ``SegmentAllocator`` (the decode side's real path);
- ``fragments_batched``: one message per (layer, page), all posted at once with
  ``batch_isend_irecv`` (one NCCL group);
- ``fragments_each``: one message per (layer, page), each waited before the next.

Rank 0 sends, rank 1 receives; a rep is timed on the receiver from a barrier until its bytes have
landed (``cuda.synchronize`` on GPUs); the median of ``reps`` after ``warmup``. The received bytes
are checked bit-exact after each method. The same code runs on GPUs with ``device="cuda"``,
``backend="nccl"`` (rank i on cuda:i).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from flash_dllm.distributed.launch import free_port

METHODS = ("contiguous", "fragments_batched", "fragments_each")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of a model: one token holds ``layers * 2 * kv_heads * head_dim`` values."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def bytes_per_token(self) -> int:
        item = torch.empty(0, dtype=_DTYPES[self.dtype]).element_size()
        return self.layers * 2 * self.kv_heads * self.head_dim * item

    def segment_shape(self, pages: int) -> tuple[int, ...]:
        """Page-first: (pages, layers, 2, page_size, kv_heads, head_dim)."""
        return (pages, self.layers, 2, self.page_size, self.kv_heads, self.head_dim)


# The KV side of flash_dllm.bench.shapes.SHAPES: LLaDA-8B is 512 KiB per token in bf16.
KV_SHAPES: dict[str, KVShape] = {
    "llada-8b": KVShape(layers=32, kv_heads=32, head_dim=128),
    "dream-7b": KVShape(layers=28, kv_heads=4, head_dim=128),
}


def _median_entry(times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"median_s": med, "gbps": nbytes / med / 1e9, "times_s": times}


def _worker(rank: int, cfg: dict, port: int, out: str) -> None:
    import torch.distributed as dist

    from flash_dllm.distributed.segment_allocator import SegmentAllocator
    from flash_dllm.distributed.torch_transport import (TorchDistTransport, recv_fragments,
                                                        send_fragments)

    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    else:
        dev = torch.device("cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")     # one host: stay on loopback
    dist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg["world"],
                            timeout=datetime.timedelta(seconds=cfg["timeout_s"]))
    tr = TorchDistTransport()
    kv = KVShape(**cfg["kv"])
    shape, nbytes, dtype = kv.segment_shape(cfg["pages"]), cfg["bytes"], _DTYPES[kv.dtype]

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def random_bytes() -> torch.Tensor:
        g = torch.Generator(device=dev).manual_seed(cfg["seed"])
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=g)

    if rank == 0:
        seg = random_bytes().view(dtype).view(shape)
    elif rank == 1:
        align = 256
        alloc = SegmentAllocator(-(-nbytes // align) * align, align)
        staging = torch.empty(alloc.capacity, dtype=torch.uint8, device=dev)
        off = alloc.alloc(nbytes)
        slot = staging[off:off + nbytes]                     # [bytes]
        slot_kv = slot.view(dtype).view(shape)               # [pages, layers, 2, ps, H, D]
        expected = random_bytes()
    times: dict[str, list[float]] = {m: [] for m in cfg["methods"]}
    exact: dict[str, bool] = {}
    for m in cfg["methods"]:
        if rank == 1:
            slot.zero_()
        for rep in range(cfg["warmup"] + cfg["reps"]):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                if m == "contiguous":
                    tr.wait(tr.send(1, seg, 1), cfg["timeout_s"])
                else:
                    for w in send_fragments(seg, 1, batched=m == "fragments_batched",
                                            tag_base=1000):
                        w.wait()
            elif rank == 1:
                if m == "contiguous":
                    tr.wait(tr.recv(0, slot, 1), cfg["timeout_s"])
                else:
                    for w in recv_fragments(slot_kv, 0, batched=m == "fragments_batched",
                                            tag_base=1000):
                        w.wait()
            sync()
            if rep >= cfg["warmup"]:
                times[m].append(time.perf_counter() - t0)
        if rank == 1:
            exact[m] = bool(torch.equal(slot, expected))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        Path(out).write_text(json.dumps({"times": times, "exact": exact, "offset": off}))


def run_transfer_bench(shape: str | KVShape = "llada-8b", tokens: int = 512,
                       backend: str = "gloo", device: str = "cpu", world: int = 2, *,
                       reps: int = 5, warmup: int = 1, methods: tuple[str, ...] = METHODS,
                       seed: int = 0, timeout_s: float = 300.0) -> dict:
    """Time ``methods`` for the KV of a ``tokens``-token prompt (whole pages) of ``shape`` between
    two processes; returns a JSON-ready report (median seconds, GB/s and ratio to
    ``contiguous`` per method). ``timeout_s`` bounds the whole run (the workers are killed past
    it) and every transfer."""
    kv = KV_SHAPES.get(shape) if isinstance(shape, str) else shape
    if not isinstance(kv, KVShape):
        raise ValueError(f"shape must be one of {sorted(KV_SHAPES)} or a KVShape, got {shape!r}")
    for name, v, lo in (("tokens", tokens, 1), ("reps", reps, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if world != 2:
        raise ValueError(f"world must be 2 (one sender, one receiver), got {world!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"device='cuda' needs {world} GPUs, found {torch.cuda.device_count()}")
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"methods must be a non-empty subset of {list(METHODS)}, got {methods!r}")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    pages = -(-tokens // kv.page_size)
    nbytes = pages * kv.page_size * kv.bytes_per_token
    cfg = {"kv": asdict(kv), "pages": pages, "bytes": nbytes, "backend": backend,
           "device": device, "world": world, "reps": reps, "warmup": warmup,
           "methods": list(methods), "seed": seed, "timeout_s": timeout_s}

    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="flash-dllm-bench-") as tmp:
        out = os.path.join(tmp, "rank1.json")
        ctx = mp.start_processes(_worker, args=(cfg, free_port(), out), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"transfer bench workers still running after {timeout_s} s")
        got = json.loads(Path(out).read_text())

    results = {m: _median_entry(got["times"][m], nbytes) for m in methods}
    if "contiguous" in results:
        base = results["contiguous"]["median_s"]
        for r in results.values():
            r["ratio_to_contiguous"] = r["median_s"] / base
    return {
        "bench": "transfer", "shape": shape if isinstance(shape, str) else "custom",
        "kv": asdict(kv), "bytes_per_token": kv.bytes_per_token, "tokens": tokens,
        "pages": pages, "bytes": nbytes, "fragments": pages * kv.layers,
        "fragment_bytes": nbytes // (pages * kv.layers), "backend": backend, "device": device,
        "world": world, "reps": reps, "warmup": warmup, "torch": torch.__version__,
        "staging_offset": got["offset"], "bit_exact": got["exact"], "results": results,
    }


def format_table(report: dict) -> str:
    head = (f"{report['shape']} {report['tokens']} tokens = {report['bytes'] / 2**20:.1f} MiB, "
            f"{report['fragments']} fragments of {report['fragment_bytes'] / 1024:.0f} KiB, "
            f"{report['backend']} on {report['device']}")
    lines = [head, f"{'method':<20}{'median ms':>12}{'GB/s':>10}{'x contiguous':>14}{'exact':>7}"]
    for m, r in report["results"].items():
        ratio = r.get("ratio_to_contiguous")
        lines.append(f"{m:<20}{1e3 * r['median_s']:>12.2f}{r['gbps']:>10.2f}"
                     f"{(f'{ratio:.2f}' if ratio else '-'):>14}{str(report['bit_exact'][m]):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flash_dllm.distributed.bench_transfer",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llada-8b", choices=sorted(KV_SHAPES))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None, help="also write the report here")
    a = p.parse_args(argv)
    report = run_transfer_bench(a.shape, a.tokens, a.backend, a.device, reps=a.reps,
                                warmup=a.warmup, methods=tuple(a.methods.split(",")),
                                timeout_s=a.timeout)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
