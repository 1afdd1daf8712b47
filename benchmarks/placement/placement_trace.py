"""Placement of 32K- and 64K-token requests larger than L0, driven by attention traces of the trained
proxies scaled up (issue 14): L0 hit rate and host->device bytes per answer token for
``--kv-placement lru|ema|kag`` under lazy loading (``--lazy-load-budget F``, mass predictor).

Random weights give meaningless attention, so the LLaDA-8B-shape runs of ``bench overflow`` can
time a lazy step but cannot say which pages a placement keeps resident for nothing. This study
takes the attention from the trained proxies instead:

1. **Record.** Each proxy answers ``--n`` problems of a long suite (threshold 0.9, dual cache,
   pages of ``--record-page-size``) as requests larger than the pool (lazy loading at F = 1,
   so the answers are exact). For every request it keeps each step's window and each block's
   measuring-step attention mass per page (last layer, the active block's rows): what the
   engine's placement and lazy loading see (``cache/io/kv_overflow.py``).
2. **Scale up** (the locality model, stated here because it decides the answer): the recorded
   prompt's attention per token is stretched over a prompt of ``--prompt-tokens`` tokens (token
   t of the long prompt takes the density of recorded token ``t * P / P_long``), times a
   salience per long page drawn once per request from a lognormal of sigma ``--sigma`` (pages
   of one stretched region differ, and a page's salience persists over the request's blocks:
   the larger sigma, the more a page's past attention predicts its next; the answer depends
   on it, so report several),
   renormalised so the prompt keeps its recorded share of the mass. The answer's pages, the
   windows and the number of steps per block are the recorded ones, shifted behind the long
   prompt. Pages of ``--page-size`` tokens.
3. **Simulate** what ``OverflowKV.step`` does with those traces, with the engine's own pieces
   (``overflow_placement.ResidentSet`` chooses the resident set at each refresh,
   ``lazy_load.select_pages`` the host pages a lazy step loads): a refresh loads nothing, a
   block's measuring step loads every host page, its lazy steps the chosen ones.
   ``tests/test_placement_trace.py`` checks the simulation against the engine's own counters
   on a real run.

The pool holds ``--l0`` of each request's pages. Bytes are the KV of the model family's real
shape (LLaDA-8B 512 KiB per token, Dream-7B 56 KiB). No accuracy here: the simulated requests do
not decode (``placement_overflow_*_h200.json`` has accuracy, at the proxies' real lengths).

    PYTHONPATH=$PWD python3 benchmarks/placement/placement_trace.py \\
        --models proxy-llada proxy-dream \\
        --out benchmarks/results/placement/placement_trace_cpu.json \\
        --png benchmarks/results/placement/placement_trace_cpu.png
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

# KV bytes per token of the real shapes (shared/MODELS.md): the simulated requests' page bytes
KV_BYTES_PER_TOKEN = {"llada": 2 * 32 * 4096 * 2, "dream": 2 * 28 * 4 * 128 * 2}


# ------------------------------------------------------------------------------- 1. recording
@contextmanager
def recording():
    """Within it, every request larger than the pool leaves a trace (by request id): its
    canvas, page size and spill, each step's ``(window, hot)`` positions (``hot``: the window
    of the block's later steps) and each measuring step's mass per logical page."""
    from flash_dllm.cache.io.kv_overflow import OverflowKV

    traces: dict[str, dict] = {}
    real_step, real_observe = OverflowKV.step, OverflowKV.observe

    def step(self, meta, plan, state, window, canvas_len, active=(0, 0)):
        t = traces.setdefault(state.request_id, {
            "canvas_len": canvas_len, "page_size": self.page_shape[0], "spill": plan.spill,
            "steps": [], "masses": []})
        t["steps"].append((list(map(int, window)), list(map(int, active))))
        return real_step(self, meta, plan, state, window, canvas_len, active)

    def observe(self, state, lazy, mass):
        if lazy is None:
            traces[state.request_id]["masses"].append(np.asarray(mass, dtype=np.float64))
        return real_observe(self, state, lazy, mass)

    OverflowKV.step, OverflowKV.observe = step, observe
    try:
        yield traces
    finally:
        OverflowKV.step, OverflowKV.observe = real_step, real_observe


def record(model: str, suite: str, n: int, page_size: int, tau: float = 0.9) -> list[dict]:
    """Exact answers (lazy loading at F = 1) of ``n`` problems as requests larger than an
    8-page pool, with their traces (``recording``)."""
    from flash_dllm.config import EngineConfig, SamplingParams
    from flash_dllm.entrypoints.llm import LLM
    from flash_dllm.evals.tasks import SUITES, get_suite

    gen = SUITES[suite].gen_length
    llm = LLM(model=model, engine_config=EngineConfig(
        page_size=page_size, num_kv_pages=8, kv_overflow_gb=0.25, lazy_load_budget=1.0,
        kv_placement="lru", cuda_graphs=False))
    params = SamplingParams(max_tokens=gen, decode="threshold", threshold=tau, cache="dual")
    with recording() as traces:
        outs = llm.generate([p.prompt for p in get_suite(suite).test_problems(n, 0)], params)
    out = []
    for o in outs:
        t = traces[o.request_id]
        t.update(prompt_len=t["canvas_len"] - gen, answer_tokens=len(o.token_ids))
        out.append(t)
    return out


# --------------------------------------------------------------------------------- 2. scaling
def scale(trace: dict, prompt_tokens: int, page_size: int, sigma: float, seed: int) -> dict:
    """The recorded request with its prompt stretched to ``prompt_tokens`` (module docstring)."""
    P, C, ps0 = trace["prompt_len"], trace["canvas_len"], trace["page_size"]
    gen = C - P
    P2, C2 = prompt_tokens, prompt_tokens + gen
    n2 = -(-C2 // page_size)
    shift = P2 - P
    rng = np.random.default_rng(seed)
    salience = rng.lognormal(0.0, sigma, size=-(-P2 // page_size))
    t_long = np.arange(P2)
    src = np.minimum((t_long * P) // P2, P - 1)           # recorded prompt token of each token
    width = np.full(-(-C // ps0), ps0)                    # tokens per recorded page
    width[-1] = C - ps0 * (len(width) - 1)
    masses = []
    for m in trace["masses"]:
        m = np.asarray(m, dtype=np.float64)
        per_tok = np.repeat(m / width, width)             # density: a page's mass over its tokens
        prompt = per_tok[src] * salience[t_long // page_size]
        if prompt.sum() > 0:
            prompt *= per_tok[:P].sum() / prompt.sum()    # the prompt keeps its share
        tok = np.concatenate([prompt, per_tok[P:]])       # the answer's tokens as recorded
        masses.append(np.add.reduceat(tok, np.arange(0, C2, page_size)))

    def move(r):
        a, b = r
        return [0 if a <= 0 else a + shift, C2 if b >= C else b + shift]
    steps = [(move(w), move(h)) for w, h in trace["steps"]]
    return {"canvas_len": C2, "prompt_len": P2, "page_size": page_size, "num_pages": n2,
            "steps": steps, "masses": masses, "answer_tokens": trace["answer_tokens"]}


# ------------------------------------------------------------------------------ 3. simulation
def simulate(trace: dict, resident: int, budget: float | None, placement: str,
             top_k: int = 8) -> dict:
    """``OverflowKV.step``'s loads for one request (mass predictor): host pages loaded per
    step, and of the pages lazy steps attend to (their ``k``) the resident ones (L0 hits)."""
    from flash_dllm.cache.io.kv_overflow import rewrites_host
    from flash_dllm.cache.io.lazy_load import select_pages
    from flash_dllm.cache.io.overflow_placement import ResidentSet

    ps, C = trace["page_size"], trace["canvas_len"]
    n = -(-C // ps)
    s = n - min(resident, n)
    rs = ResidentSet(placement if budget is not None else "lru", n, top_k)
    order = np.arange(n)                                # host: the first s logical pages
    masses = iter(trace["masses"])
    page_mass = plan = None
    loaded = lazy_loaded = wanted = hits = lazy_steps = 0
    for (w0, w1), (h0, h1) in trace["steps"]:
        if w0 <= 0 and w1 >= C:                          # a refresh: the placement's choice
            new = rs.choose(s, (h0 // ps, -(-h1 // ps)))
            if new is not None:
                order = new
        slot_of = np.argsort(order)
        p0, p1 = max(0, w0 // ps), min(n, -(-w1 // ps))
        written = np.zeros(n, dtype=bool)
        written[slot_of[p0:p1]] = True
        if rewrites_host((w0, w1), order[:s], ps, C):
            page_mass = plan = None                      # every host key rewritten: no load
            continue
        if budget is None or page_mass is None:
            loaded += s                                  # exact, or the block's measuring step
            if budget is not None:
                mass = next(masses)
                page_mass = mass[order]
                rs.observe(mass)
            continue
        if plan is None or plan[0] != (p0, p1):
            plan = ((p0, p1), *select_pages(page_mass, budget, written, s))
        _, ranges, k, h = plan
        pages = sum(b - a for a, b in ranges)
        loaded, lazy_loaded = loaded + pages, lazy_loaded + pages
        wanted, hits, lazy_steps = wanted + k, hits + h, lazy_steps + 1
    return {"pages_loaded": loaded, "lazy_pages_loaded": lazy_loaded, "lazy_wanted": wanted,
            "lazy_hits": hits, "lazy_steps": lazy_steps, "placement_s": rs.seconds}


def plot(report: dict, path: Path) -> None:
    """Per model, suite and prompt length: GiB a lazy step loads per placement, for each (L0,
    F), with the L0 hit rate above each bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["lazy_load_budget"] is not None]
    panels = sorted({(r["model"], r["suite"], r["prompt_tokens"], r["sigma"]) for r in rows})
    groups = sorted({(r["l0"], r["lazy_load_budget"]) for r in rows}, reverse=True)
    places = [p for p in ("lru", "ema", "kag") if any(r["kv_placement"] == p for r in rows)]
    colors = {"lru": "tab:gray", "ema": "tab:blue", "kag": "tab:orange"}
    cols = 2
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, squeeze=False,
                             figsize=(6.4 * cols, 3.6 * -(-len(panels) // cols)))
    w = 0.8 / len(places)
    for ax, (model, suite, P, sigma) in zip(axes.flat, panels):
        top = 0.0
        for j, pl in enumerate(places):
            for i, (l0, f) in enumerate(groups):
                r = next((r for r in rows if (r["model"], r["suite"], r["prompt_tokens"],
                                              r["sigma"], r["l0"], r["lazy_load_budget"],
                                              r["kv_placement"])
                          == (model, suite, P, sigma, l0, f, pl)), None)
                if r is None or r["gib_per_lazy_step"] is None:
                    continue
                x, y = i + (j - (len(places) - 1) / 2) * w, r["gib_per_lazy_step"]
                ax.bar(x, y, w, color=colors[pl], label=pl if i == 0 else None)
                ax.text(x, y, f"{r['hit_rate']:.2f}", ha="center", va="bottom", fontsize=7)
                top = max(top, y)
        ax.set_ylim(0, top * 1.18)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"L0 {l0:.0%}, F {f:g}" for l0, f in groups], fontsize=8)
        ax.set_ylabel("GiB loaded per lazy step")
        ax.set_title(f"{model} {suite}, {P // 1024}K-token prompt, salience sigma {sigma:g}",
                     fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("Lazy loading on scaled-up proxy attention traces (mass predictor): bytes per "
                 "lazy step; L0 hit rate above each bar", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=["proxy-llada", "proxy-dream"])
    p.add_argument("--suites", nargs="+", default=["chain", "code-long"])
    p.add_argument("--n", type=int, default=50, help="recorded requests per model and suite")
    p.add_argument("--record-page-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[32768, 65536])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--sigma", type=float, nargs="+", default=[1.0],
                   help="lognormal page salience (several: a row set each)")
    p.add_argument("--l0", type=float, nargs="+", default=[0.25, 0.1])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.1])
    p.add_argument("--placements", nargs="+", default=["lru", "ema", "kag"])
    p.add_argument("--kag-top-k", type=int, default=8, help="kag: neighbours kept per page")
    p.add_argument("--trace-cache", type=Path, default=None,
                   help="a JSON file of recorded traces: read if it exists, else written "
                        "(reruns at other scaling settings skip the recording)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--png", type=Path, help="also draw the report (matplotlib)")
    p.add_argument("--replot", action="store_true", help="only draw --out's report as --png")
    a = p.parse_args()
    if a.replot:
        plot(json.loads(Path(a.out).read_text()), a.png)
        return 0
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    rows = []
    cache = (json.loads(a.trace_cache.read_text())
             if a.trace_cache is not None and a.trace_cache.exists() else {})
    report = {"method": __doc__.split("\n\n")[1:4], "sigma": a.sigma, "page_size": a.page_size,
              "kag_top_k": a.kag_top_k,
              "record_page_size": a.record_page_size, "n": a.n, "predictor": "mass",
              "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "rows": rows, "recorded": {}}
    for model in a.models:
        family = "dream" if "dream" in model else "llada"
        page_bytes = KV_BYTES_PER_TOKEN[family] * a.page_size
        for suite in a.suites:
            t0 = time.perf_counter()
            key = f"{model}/{suite}/{a.n}/{a.record_page_size}"
            fresh = key not in cache
            if fresh:
                cache[key] = record(model, suite, a.n, a.record_page_size)
                for t in cache[key]:
                    t["masses"] = [np.asarray(m).tolist() for m in t["masses"]]
            traces = cache[key]
            report["recorded"][f"{model}/{suite}"] = {
                "requests": len(traces),
                "record_seconds": round(time.perf_counter() - t0, 1) if fresh else None,
                "prompt_tokens_median": float(np.median([t["prompt_len"] for t in traces])),
                "steps_per_request": float(np.mean([len(t["steps"]) for t in traces])),
                "blocks_per_request": float(np.mean([len(t["masses"]) for t in traces]))}
            for sigma, P2 in [(s, P) for s in a.sigma for P in a.prompt_tokens]:
                long = [scale(t, P2, a.page_size, sigma, seed=i) for i, t in enumerate(traces)]
                tokens = sum(t["answer_tokens"] for t in long)
                for l0 in a.l0:
                    configs = [(None, "lru")] + [(b, pl) for b in a.budgets
                                                 for pl in a.placements]
                    for budget, placement in configs:
                        sims = [simulate(t, max(1, int(l0 * t["num_pages"])), budget, placement,
                                         a.kag_top_k) for t in long]
                        tot = {k: sum(s[k] for s in sims) for k in sims[0]}
                        row = {"model": model, "suite": suite, "prompt_tokens": P2, "sigma": sigma,
                               "l0": l0,
                               "lazy_load_budget": budget, "kv_placement": placement,
                               "requests": len(long), "answer_tokens": tokens,
                               "hit_rate": (tot["lazy_hits"] / tot["lazy_wanted"]
                                            if tot["lazy_wanted"] else None),
                               "mib_per_token": tot["pages_loaded"] * page_bytes / tokens / 2**20,
                               "gib_per_lazy_step": (
                                   tot["lazy_pages_loaded"] * page_bytes / tot["lazy_steps"]
                                   / 2**30 if tot["lazy_steps"] else None),
                               "placement_ms_per_request": 1e3 * tot["placement_s"] / len(long)}
                        rows.append(row)
                        hr = "  -  " if row["hit_rate"] is None else f"{row['hit_rate']:.2f}"
                        lz = row["gib_per_lazy_step"]
                        lz = "   -  " if lz is None else f"{lz:6.2f}"
                        print(f"{model:12s} {suite:9s} {P2:6d} s {sigma:3.1f} L0 {l0:4.2f} F "
                              f"{str(budget):5s} {placement:4s}: hit {hr}  "
                              f"{row['mib_per_token']:7.0f} MiB/token  {lz} GiB/lazy step  "
                              f"placement {row['placement_ms_per_request']:5.1f} ms/request",
                              flush=True)
    if a.trace_cache is not None:
        a.trace_cache.write_text(json.dumps(cache))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    if a.png:
        plot(report, a.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
