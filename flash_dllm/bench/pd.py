"""``flash-dllm bench pd``: prefill/decode disaggregation, one JSON report with up to four parts.

- ``transfer``: one request's KV as one contiguous segment against per-(layer, page) fragments
  between two processes (``distributed/bench_transfer.py``; gloo on the CPU, NCCL on 2 GPUs);
- ``fragmentation``: the decode side's staging allocator under a random mixed workload
  (``distributed/segment_sim.py``);
- ``roles``: role switching against static prefill/decode splits on a bursty trace, on a
  simulated clock (``disagg/roles.py``);
- ``serve``: a mixed workload of long and short prompts arriving as a Poisson stream, served
  colocated (one engine) and disaggregated (``--prefill-workers`` + ``--decode-workers`` worker
  processes); per prompt class: time to first token (first committed answer token) and latency
  p50/p99, throughput. The same requests, arrival times and sampling knobs in both runs.
"""
from __future__ import annotations

import datetime
import platform
import random
import statistics
import time

import torch

PARTS = ("transfer", "fragmentation", "roles", "serve")


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def mixed_trace(n: int, rate: float, long_frac: float, long_len: int, short_len: int,
                seed: int = 0) -> list[tuple[float, str, int]]:
    """``n`` requests ``(arrival s, "long"|"short", prompt tokens)``, Poisson at ``rate``/s."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        kind = "long" if rng.random() < long_frac else "short"
        out.append((t, kind, long_len if kind == "long" else short_len))
    return out


def drive(engine, trace, params, vocab: tuple[int, int], seed: int = 0,
          timeout_s: float = 600.0) -> dict:
    """Submit ``trace`` to ``engine`` (an ``Engine`` or a ``PDEngine``) at its arrival times and
    step it until every request finished; per-class TTFT and latency, throughput."""
    rng = random.Random(seed)
    lo, hi = vocab
    prompts = [[rng.randrange(lo, hi) for _ in range(n)] for _, _, n in trace]
    arrival, first, done, kind = {}, {}, {}, {}
    errors = 0
    tokens = 0
    t0 = time.monotonic()
    i = 0
    with torch.inference_mode():
        while i < len(trace) or engine.has_unfinished():
            now = time.monotonic() - t0
            if now > timeout_s:
                raise TimeoutError(f"bench pd: the workload did not finish in {timeout_s} s")
            while i < len(trace) and trace[i][0] <= now:
                rid = f"r{i}"
                engine.add_request(prompts[i], params, request_id=rid)
                arrival[rid], kind[rid] = time.monotonic(), trace[i][1]
                i += 1
            if not engine.has_unfinished():
                time.sleep(max(0.0, min(0.002, trace[i][0] - now)) if i < len(trace) else 0)
                continue
            for so in engine.step():
                t = time.monotonic()
                if so.num_tokens and so.request_id not in first:
                    first[so.request_id] = t
                if so.finished:
                    done[so.request_id] = t
                    tokens += so.num_tokens
                    errors += so.finish_reason == "error"
    wall = time.monotonic() - t0
    out = {"requests": len(trace), "errors": errors, "wall_s": round(wall, 3),
           "requests_per_s": round(len(trace) / wall, 3),
           "answer_tokens_per_s": round(tokens / wall, 1)}
    for cls in ("long", "short", "all"):
        ids = [r for r in arrival if cls == "all" or kind[r] == cls]
        ttft = [first[r] - arrival[r] for r in ids if r in first]
        lat = [done[r] - arrival[r] for r in ids if r in done]
        out[cls] = {"n": len(ids), "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                    "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
                    "ttft_mean_s": statistics.fmean(ttft) if ttft else None}
    return out


def run_serve_part(make_colocated, make_disaggregated, *, prefill_workers: int,
                   decode_workers: int, requests: int, rate: float, long_frac: float,
                   long_len: int, short_len: int, max_tokens: int, block_length: int,
                   log=print) -> dict:
    """``make_colocated()`` -> an ``Engine``; ``make_disaggregated()`` -> a ``PDEngine`` (not yet
    ready) of ``prefill_workers`` + ``decode_workers`` workers."""
    from flash_dllm.config import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, block_length=block_length,
                            decode="threshold", cache="dual")
    trace = mixed_trace(requests, rate, long_frac, long_len, short_len)
    warm = mixed_trace(4, 1e3, 0.5, long_len, short_len, seed=1)
    vocab = None
    # NOTE: disaggregated first: its worker processes give their GPU memory back when they exit
    log(f"bench pd serve: {prefill_workers} prefill + {decode_workers} decode workers")
    pd = make_disaggregated()
    try:
        pd.wait_ready(900)
        hi = max(6, min(pd.cfg.vocab_size, 30000, pd.cfg.mask_token_id))
        vocab = (5, hi)
        drive(pd, warm, params, vocab)
        disagg = drive(pd, trace, params, vocab)
        snap = pd.pd_snapshot()
        backend, pd_groups = pd.backend, pd.layer_groups
    finally:
        pd.close()
    log("bench pd serve: colocated (warm-up, then the workload)")
    eng = make_colocated()
    drive(eng, warm, params, vocab)
    colocated = drive(eng, trace, params, vocab)
    moved = max(1, snap["transfers"])
    return {"workload": {"requests": requests, "rate_per_s": rate, "long_frac": long_frac,
                         "long_prompt_tokens": long_len, "short_prompt_tokens": short_len,
                         "max_tokens": max_tokens, "block_length": block_length,
                         "decode": "threshold", "cache": "dual"},
            "prefill_workers": prefill_workers, "decode_workers": decode_workers,
            "transport": backend, "layer_groups": pd_groups,
            "colocated": colocated, "disaggregated": disagg,
            "transfers": snap["transfers"], "transfer_bytes": snap["transfer_bytes"],
            "transfer_seconds_mean": snap["transfer_seconds"] / moved,
            "failed_requests": snap["failed_requests"]}


def run_roles_part(seconds: float = 60.0, workers: int = 4) -> dict:
    from flash_dllm.disagg.roles import RoleController, bursty_trace, simulate

    trace = bursty_trace(0, seconds)
    out = {"trace": "bursty_trace(seed=0): 10 s quiet (12/s short prompts, 128-384 steps) / "
                    "10 s burst (8/s prompts of 8K-32K tokens, 8-64 steps)",
           "seconds": seconds, "workers": workers, "static": {}}
    for p in range(1, workers):
        out["static"][f"{p}p{workers - p}d"] = simulate(trace, workers, p, None).summary()
    c = RoleController(cooldown_s=1.0)
    res = simulate(trace, workers, workers // 2, c)
    out["switching"] = {**res.summary(), "start": f"{workers // 2}p{workers - workers // 2}d",
                        "switch_log": [(round(t, 2), r, to) for t, r, to in c.switches]}
    return out


def run_pd_bench(parts: tuple[str, ...], *, device: str = "cpu", transfer_tokens: int = 512,
                 transfer_backend: str = "gloo", log=print, make_colocated=None,
                 make_disaggregated=None, **serve_kw) -> dict:
    report = {"benchmark": "pd", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": platform.node(), "device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    if "transfer" in parts:
        from flash_dllm.distributed.bench_transfer import run_transfer_bench
        log(f"bench pd transfer: {transfer_tokens} tokens of llada-8b KV over {transfer_backend}")
        report["transfer"] = run_transfer_bench("llada-8b", transfer_tokens, transfer_backend,
                                                "cuda" if transfer_backend == "nccl" else "cpu")
    if "fragmentation" in parts:
        from flash_dllm.distributed.segment_sim import fragmentation_figure
        fig = fragmentation_figure()
        report["fragmentation"] = {k: v for k, v in fig.items()
                                   if k not in ("fragmentation", "utilisation")}
        report["fragmentation"]["series_every_20_steps"] = {
            "fragmentation": fig["fragmentation"][::20], "utilisation": fig["utilisation"][::20]}
    if "roles" in parts:
        report["roles"] = run_roles_part()
    if "serve" in parts:
        report["serve"] = run_serve_part(make_colocated, make_disaggregated, log=log,
                                         **serve_kw)
    return report


def table(report: dict) -> str:
    lines = []
    if "transfer" in report:
        from flash_dllm.distributed.bench_transfer import format_table
        lines.append(format_table(report["transfer"]))
    if "fragmentation" in report:
        f = report["fragmentation"]
        lines.append(f"staging allocator: {f['requests']} requests, {f['failed']} refused "
                     f"({f['failed_with_enough_free']} with enough free bytes), mean "
                     f"fragmentation {f['mean_fragmentation']:.3f}, peak use "
                     f"{f['peak_utilisation']:.2f}")
    if "roles" in report:
        r = report["roles"]
        for name, s in [*r["static"].items(), ("switching", r["switching"])]:
            lines.append(f"roles {name:>9}: latency p50 {s['latency_p50_s']:.2f} s p99 "
                         f"{s['latency_p99_s']:.2f} s, TTFT p99 {s['ttft_p99_s']:.2f} s, "
                         f"{s['switches']} switches")
    if "serve" in report:
        s = report["serve"]
        for name in ("colocated", "disaggregated"):
            x = s[name]
            def f(v):
                return "-" if v is None else f"{v:.3f}"
            lines.append(f"{name:>13}: {x['requests_per_s']:.2f} req/s; TTFT p50 long "
                         f"{f(x['long']['ttft_p50_s'])} s short {f(x['short']['ttft_p50_s'])} s;"
                         f" latency p99 {f(x['all']['latency_p99_s'])} s; errors {x['errors']}")
        lines.append(f"KV moved: {s['transfers']} requests, {s['transfer_bytes'] / 1e6:.1f} MB, "
                     f"{s['transfer_seconds_mean'] * 1e3:.1f} ms each (receipt to unpacked)")
    return "\n".join(lines)
