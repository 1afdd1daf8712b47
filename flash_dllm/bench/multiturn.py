"""``flash-dllm bench multiturn``: multi-turn chat sessions against the server (like SGLang's
multi-turn benchmark), with per-turn time to first token and the server's prefix-cache counters.

``users`` sessions run concurrently, each ``turns`` turns one after another. A session opens with
a system message of synthetic text (about ``history_tokens`` tokens: ``history_tokens *
chars_per_token`` characters of seeded random words; the demo model's tokenizer is one token per
character, so ``chars_per_token`` is 1.0 by default, ~4 fits English BPE tokenizers) and a short
user question. Every turn streams ``POST /v1/chat/completions`` with the whole history, appends
the streamed answer and the next question ("Continue. Question k: ..."), then sleeps ``idle_s``
so that other sessions' traffic can push its KV pages out of GPU memory.

A follow-up prompt (the chat template over the whole history) starts with the previous prompt and
answer, so a server with prefix reuse should cut the TTFT of turns >= 2: the report gives TTFT per
turn index, and the deltas of the server's prefix-cache / tier counters over the run (0 and
``exported: false`` where the server does not export them). A turn whose answer is empty has
TTFT = latency; throughput divides by the wall time of all sessions, idle sleeps included.

A session whose next prompt would not fit the server's ``max_model_len`` (``/v1/models``) together
with ``max_tokens`` stops there; it is recorded under ``stopped``, not as an error (an estimate
decides before sending; a 400 ``context_length_exceeded`` answer stops it the same way).
"""
from __future__ import annotations

import asyncio
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from flash_dllm.bench.serve import StreamError, scrape, sse_events, summary, wait_pages_free

CHAT = "/v1/chat/completions"
# Counters whose run deltas the report gives, by short name (the Prometheus names end in _total).
COUNTERS = {
    "prefix_cache_query_tokens": "flash_dllm_prefix_cache_query_tokens_total",
    "prefix_cache_hit_tokens": "flash_dllm_prefix_cache_hit_tokens_total",
    "kv_bytes_moved": "flash_dllm_kv_bytes_moved_total",
    "kv_tier_slower_than_recompute": "flash_dllm_kv_tier_slower_than_recompute_total",
    "kv_prefetch_pages": "flash_dllm_kv_prefetch_pages_total",
}
TIERS = ("l0", "l1", "l2")
# Chat-template tokens around one message (role header, separators, end of turn): a margin for the
# estimate of the next prompt's length; a wrong guess ends in a 400 that stops the session cleanly.
TEMPLATE_TOKENS_PER_MESSAGE = 12
_WORDS = ("the", "cache", "page", "token", "model", "block", "step", "query", "key", "value",
          "layer", "batch", "server", "prompt", "answer", "tier", "memory", "copy", "host", "disk",
          "mask", "commit", "window", "prefix", "radix", "tree", "hit", "miss", "load", "store")


@dataclass(frozen=True)
class MultiturnConfig:
    """One run's workload; ``knobs`` are extra request-body fields (cache, decode, ...)."""

    users: int = 8
    turns: int = 4
    history_tokens: int = 128
    chars_per_token: float = 1.0
    max_tokens: int = 32
    idle_s: float = 0.0
    seed: int = 0
    shared_prefix: bool = False
    temperature: float = 0.0
    knobs: dict = field(default_factory=dict)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.history_tokens < 0:
            raise ValueError("--history-tokens must be >= 0")
        if not self.chars_per_token > 0:
            raise ValueError("--chars-per-token must be > 0")
        if self.idle_s < 0:
            raise ValueError("--idle-s must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError("--timeout-s must be > 0")


# ----------------------------------------------------------------------------- synthetic sessions
def synthetic_text(rng: random.Random, chars: int) -> str:
    """Seeded random words, exactly ``chars`` characters (printable ASCII)."""
    out, n = [], 0
    while n < chars:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


def question(rng: random.Random, k: int) -> str:
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    return f"Question {k}: what is {a} + {b}?" if k == 1 else \
        f"Continue. Question {k}: what is {a} + {b}?"


def opening(cfg: MultiturnConfig, user: int) -> tuple[list[dict], random.Random]:
    """The first turn's messages of ``user`` and the generator of its later questions."""
    rng = random.Random(cfg.seed * 1_000_003 + user)
    doc_rng = random.Random(cfg.seed) if cfg.shared_prefix else rng
    doc = synthetic_text(doc_rng, round(cfg.history_tokens * cfg.chars_per_token))
    return [{"role": "system", "content": doc}, {"role": "user", "content": question(rng, 1)}], rng


# ------------------------------------------------------------------------------------- one turn
async def chat_turn(client, body: dict) -> dict:
    """Stream one chat request: latency, TTFT (first non-empty content delta), usage, text; or
    an error (``context_length`` True when the server said the history is too long)."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    try:
        async with client.stream("POST", CHAT, json=body) as r:
            if r.status_code != 200:
                raw = (await r.aread()).decode(errors="replace")
                return {"ok": False, "error": f"HTTP {r.status_code}: {raw[:300]}",
                        "context_length": r.status_code == 400
                        and "context_length_exceeded" in raw}
            async for ev in sse_events(r):
                for c in ev.get("choices") or []:
                    d = (c.get("delta") or {}).get("content") or ""
                    if d and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(d)
                if ev.get("usage"):
                    usage = ev["usage"]
    except StreamError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a load test reports every failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    lat = time.perf_counter() - t0
    usage = usage or {}
    return {"ok": True, "latency": lat, "ttft": ttft if ttft is not None else lat,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens", 0), "text": "".join(text)}


def estimate_next_prompt(prev: dict, answer: str, new_msg: str, cpt: float) -> int:
    """Tokens of the next prompt: the last prompt + its answer + the new user message + template
    margins (``cpt``: characters per token)."""
    answer_tokens = prev.get("completion_tokens") or math.ceil(len(answer) / cpt)
    return (prev["prompt_tokens"] + answer_tokens + math.ceil(len(new_msg) / cpt)
            + 2 * TEMPLATE_TOKENS_PER_MESSAGE)


async def session(client, cfg: MultiturnConfig, user: int, max_model_len: int | None,
                  records: list[dict], stopped: list[dict]) -> None:
    messages, rng = opening(cfg, user)
    body_knobs = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, **cfg.knobs}
    for turn in range(1, cfg.turns + 1):
        body = {"messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **body_knobs}
        t_start = time.perf_counter()
        r = await chat_turn(client, body)
        rec = {"user": user, "turn": turn, "t_start": t_start, **r}
        if not r["ok"] and r.get("context_length"):
            stopped.append({"user": user, "turn": turn, "reason": "max_model_len",
                            "detail": "server: context_length_exceeded"})
            return
        records.append(rec)
        if not r["ok"] or turn == cfg.turns:
            return               # an error ends the session: the history would be wrong
        nxt = question(rng, turn + 1)
        if max_model_len is not None and r.get("prompt_tokens") is not None:
            est = estimate_next_prompt(r, r["text"], nxt, cfg.chars_per_token)
            if est + cfg.max_tokens > max_model_len:
                stopped.append({"user": user, "turn": turn + 1, "reason": "max_model_len",
                                "estimated_prompt_tokens": est})
                return
        messages = messages + [{"role": "assistant", "content": r["text"]},
                               {"role": "user", "content": nxt}]
        if cfg.idle_s:
            await asyncio.sleep(cfg.idle_s)


# ------------------------------------------------------------------------------ server counters
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _samples(m: dict[str, float], name: str) -> dict[tuple, float]:
    """{sorted label items: value} of the samples of ``name`` in a parsed scrape."""
    out = {}
    for key, v in m.items():
        if key == name or key.startswith(name + "{"):
            out[tuple(sorted(_LABEL.findall(key[len(name):])))] = v
    return out


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The prefix-cache / tier counters over the run (absent ones: 0, ``exported`` False), pages
    held and cached after it."""
    d: dict[str, Any] = {"exported": {}}
    per = {}
    for short, name in COUNTERS.items():
        a, b = _samples(after, name), _samples(before, name)
        d["exported"][short] = bool(a)
        per[short] = {k: v - b.get(k, 0.0) for k, v in a.items()}
    d["prefix_cache_query_tokens"] = int(sum(per["prefix_cache_query_tokens"].values()))
    hits = {t: 0 for t in TIERS}
    for labels, v in per["prefix_cache_hit_tokens"].items():
        tier = dict(labels).get("tier", "all")
        hits[tier] = hits.get(tier, 0) + int(v)
    hits["total"] = sum(hits.values())
    d["prefix_cache_hit_tokens"] = hits
    q = d["prefix_cache_query_tokens"]
    d["prefix_cache_hit_rate"] = round(hits["total"] / q, 4) if q else None
    moved = {}
    for labels, v in per["kv_bytes_moved"].items():
        lab = dict(labels)
        moved[f"{lab.get('tier', 'all')}:{lab.get('direction', 'all')}"] = int(v)
    d["kv_bytes_moved"] = moved
    total_moved = sum(moved.values())
    d["kv_bytes_moved_total"] = total_moved
    d["kv_bytes_moved_per_hit_token"] = round(total_moved / hits["total"], 2) \
        if hits["total"] else None
    d["kv_tier_slower_than_recompute"] = int(sum(per["kv_tier_slower_than_recompute"].values()))
    d["kv_prefetch_pages"] = {dict(labels).get("outcome", "all"): int(v)
                              for labels, v in sorted(per["kv_prefetch_pages"].items())}
    fw = after.get("flash_dllm_forwards_total", 0) - before.get("flash_dllm_forwards_total", 0)
    bs = after.get("flash_dllm_batch_size_sum", 0) - before.get("flash_dllm_batch_size_sum", 0)
    d["forwards"] = int(fw)
    d["mean_batch_size"] = round(bs / fw, 3) if fw else None
    d["kv_pages_used_after"] = int(after.get("flash_dllm_kv_pages_used", -1))
    d["kv_pages_total"] = int(after.get("flash_dllm_kv_pages_total", -1))
    d["kv_pages_cached_after"] = {dict(k).get("tier", "all"): int(v) for k, v in
                                  _samples(after, "flash_dllm_kv_pages_cached").items()}
    d["requests_running_after"] = int(after.get("flash_dllm_requests_running", -1))
    return d


# ------------------------------------------------------------------------------------- the run
async def server_max_model_len(client) -> int | None:
    try:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return int(r.json()["data"][0]["max_model_len"])
    except Exception:  # noqa: BLE001 - another server may not say: no estimate then
        return None


def per_turn(records: list[dict], turns: int) -> list[dict]:
    rows = []
    for t in range(1, turns + 1):
        rs = [r for r in records if r["turn"] == t]
        ok = [r for r in rs if r["ok"]]
        pt = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]
        rows.append({"turn": t, "requests": len(rs), "ok": len(ok),
                     "prompt_tokens_mean": round(sum(pt) / len(pt), 1) if pt else None,
                     "prompt_tokens_max": max(pt) if pt else None,
                     "completion_tokens_mean": round(sum(r["completion_tokens"] for r in ok)
                                                     / len(ok), 2) if ok else None,
                     "ttft_s": summary([r["ttft"] for r in ok]),
                     "latency_s": summary([r["latency"] for r in ok])})
    return rows


async def run_multiturn(url: str, cfg: MultiturnConfig, api_key: str | None = None,
                        warmup: bool = True, keep_texts: bool = False) -> dict[str, Any]:
    """Run the sessions against the server at ``url``; the JSON report."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=cfg.users + 2, max_keepalive_connections=cfg.users + 2)
    records: list[dict] = []
    stopped: list[dict] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=cfg.timeout_s,
                                 limits=limits) as client:
        max_len = await server_max_model_len(client)
        if warmup:           # not counted; its own text, so it shares no session's prefix
            await chat_turn(client, {"messages": [{"role": "user", "content": "warm up"}],
                                     "stream": True, "max_tokens": min(cfg.max_tokens, 8)})
        before = await scrape(url)
        t0 = time.perf_counter()
        await asyncio.gather(*(session(client, cfg, u, max_len, records, stopped)
                               for u in range(cfg.users)))
        wall = time.perf_counter() - t0
    after = await wait_pages_free(url)
    records.sort(key=lambda r: (r["user"], r["turn"]))
    ok = [r for r in records if r["ok"]]
    errors = [r["error"] for r in records if not r["ok"]]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    prompt_tokens = sum(r.get("prompt_tokens") or 0 for r in ok)
    for r in records:
        r["t_start"] = round(r["t_start"] - t0, 4)
        for k in ("ttft", "latency"):
            if k in r:
                r[k] = round(r[k], 4)
        if not keep_texts:
            r.pop("text", None)
        r.pop("context_length", None)
    return {"url": url, "config": asdict(cfg), "max_model_len": max_len,
            "requests": len(records), "ok": len(ok), "errors": len(errors),
            "error_samples": errors[:5], "stopped": stopped,
            "wall_s": round(wall, 4), "throughput_rps": round(len(ok) / wall, 4),
            "prompt_tokens": prompt_tokens, "completion_tokens": out_tokens,
            "output_tokens_per_s": round(out_tokens / wall, 2),
            "ttft_s": summary([r["ttft"] for r in ok]),
            "latency_s": summary([r["latency"] for r in ok]),
            "per_turn": per_turn(records, cfg.turns),
            "server_metrics": counter_deltas(before, after),
            "records": records}


def compare_turns(on: dict, off: dict) -> list[dict]:
    """Per turn: TTFT with reuse on and off, and off / on (> 1: reuse is faster)."""
    rows = []
    for a, b in zip(on["per_turn"], off["per_turn"]):
        ma, mb = a["ttft_s"]["mean"], b["ttft_s"]["mean"]
        pa, pb = a["ttft_s"]["p50"], b["ttft_s"]["p50"]
        rows.append({"turn": a["turn"], "ttft_mean_on": ma, "ttft_mean_off": mb,
                     "ttft_p50_on": pa, "ttft_p50_off": pb,
                     "ttft_mean_off_over_on": round(mb / ma, 3) if ma and mb else None,
                     "ttft_p50_off_over_on": round(pb / pa, 3) if pa and pb else None})
    return rows


# ----------------------------------------------------------------------------------------- table
def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table(rep: dict) -> str:
    """The short table printed last (one run, or both runs of ``--compare``)."""
    if "reuse_on" in rep:
        lines = [table(rep["reuse_on"]) + "   [prefix reuse on]",
                 table(rep["reuse_off"]) + "   [prefix reuse off]",
                 f"{'turn':>4} {'ttft_on_ms':>11} {'ttft_off_ms':>12} {'off/on':>7}"]
        for r in rep["compare"]:
            x = r["ttft_mean_off_over_on"]
            ratio = "-" if x is None else f"{x:.2f}"
            lines.append(f"{r['turn']:>4} {_ms(r['ttft_mean_on']):>11} "
                         f"{_ms(r['ttft_mean_off']):>12} {ratio:>7}")
        return "\n".join(lines)
    c = rep["config"]
    lines = [f"multiturn: {c['users']} users x {c['turns']} turns, history ~{c['history_tokens']} "
             f"tokens, max_tokens {c['max_tokens']}, idle {c['idle_s']} s",
             f"{'turn':>4} {'ok':>4} {'prompt_tok':>10} {'ttft_mean_ms':>12} {'ttft_p50_ms':>11} "
             f"{'ttft_p99_ms':>11} {'latency_ms':>10}"]
    for t in rep["per_turn"]:
        pt = "-" if t["prompt_tokens_mean"] is None else f"{t['prompt_tokens_mean']:.0f}"
        lines.append(f"{t['turn']:>4} {t['ok']:>4} {pt:>10} {_ms(t['ttft_s']['mean']):>12} "
                     f"{_ms(t['ttft_s']['p50']):>11} {_ms(t['ttft_s']['p99']):>11} "
                     f"{_ms(t['latency_s']['mean']):>10}")
    m = rep["server_metrics"]
    h = m["prefix_cache_hit_tokens"]
    rate = "-" if m["prefix_cache_hit_rate"] is None else f"{m['prefix_cache_hit_rate']:.0%}"
    lines += [f"requests {rep['requests']} ok {rep['ok']} errors {rep['errors']} stopped "
              f"{len(rep['stopped'])} | {rep['throughput_rps']:.2f} req/s, "
              f"{rep['output_tokens_per_s']:.1f} output tok/s | wall {rep['wall_s']:.2f} s",
              f"prefix cache: query {m['prefix_cache_query_tokens']} tok, hits "
              + " ".join(f"{t} {h.get(t, 0)}" for t in TIERS) + f" ({rate}); bytes moved "
              f"{m['kv_bytes_moved_total']}; slower than recompute "
              f"{m['kv_tier_slower_than_recompute']}; pages used after {m['kv_pages_used_after']}"]
    return "\n".join(lines)
