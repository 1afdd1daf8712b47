"""``flash-dllm bench serve``: an async load generator for the HTTP server, with a JSON report.

``N`` workers (``--concurrency``) share ``M`` requests (``--requests``); every request streams, so
the client measures time to first token as well as latency (``--no-stream``: whole answers, TTFT
= latency, to see what streaming costs the server). With ``--sequential`` the same requests
first run one after another, and the report gives the speed-up of the concurrent run. Without
``--url`` a server for ``--model`` is started in-process on a free loopback port.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from typing import Any

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}


def percentile(xs: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-quantile (0..1) of ``xs``; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict:
    r = lambda v: None if v is None else round(v, 4)   # noqa: E731
    return {"mean": r(sum(xs) / len(xs) if xs else None), "p50": r(percentile(xs, 0.5)),
            "p99": r(percentile(xs, 0.99)), "max": r(max(xs) if xs else None)}


def request_body(endpoint: str, prompt: str, knobs: dict) -> dict:
    """The request of one prompt; ``knobs["stream"] = False`` asks for the whole answer in one
    response (no per-token server-sent events)."""
    knobs = dict(knobs)
    stream = knobs.pop("stream", True)
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    if endpoint == "chat":
        return {"messages": [{"role": "user", "content": prompt}], "stream": stream, **usage,
                **knobs}
    if endpoint == "generate":
        if "max_tokens" in knobs:
            knobs["max_new_tokens"] = knobs.pop("max_tokens")
        if "steps" in knobs:
            knobs["num_inference_steps"] = knobs.pop("steps")
        return {"prompt": prompt, "stream": stream, **knobs}
    return {"prompt": prompt, "stream": stream, **usage, **knobs}


def _delta_text(endpoint: str, ev: dict, chat_key: str = "delta") -> str:
    """The text of a streamed event (a chat chunk's ``delta``) or of a whole response (a chat
    completion's ``message``: ``chat_key="message"``)."""
    if endpoint == "generate":
        return ev.get("text", "")
    for c in ev.get("choices") or []:
        if endpoint == "chat":
            return (c.get(chat_key) or {}).get("content") or ""
        return c.get("text") or ""
    return ""


class StreamError(Exception):
    """A streamed answer that went wrong after its 200: the load generator's error text."""


async def sse_events(response):
    """The JSON events of an OpenAI-style server-sent-event stream, up to ``[DONE]``. An error
    event, or a stream that ends without ``[DONE]``, raises ``StreamError``."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            return
        ev = json.loads(data)
        if "error" in ev:
            raise StreamError(json.dumps(ev)[:300])
        yield ev
    raise StreamError("stream ended without [DONE]")


async def one_request(client, endpoint: str, body: dict) -> dict:
    """Stream one request; returns latency, TTFT, completion tokens, text or an error. A
    non-streamed request (``body["stream"]`` false) has its TTFT equal to its latency."""
    t0 = time.perf_counter()
    if not body.get("stream", True):
        return await _one_whole(client, endpoint, body, t0)
    ttft, text, tokens = None, [], 0
    try:
        async with client.stream("POST", PATHS[endpoint], json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                return {"ok": False, "error": f"HTTP {r.status_code}: {detail}"}
            async for ev in sse_events(r):
                d = _delta_text(endpoint, ev)
                if d and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(d)
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
    except StreamError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:  # noqa: BLE001 - a load test reports every failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    lat = time.perf_counter() - t0
    return {"ok": True, "latency": lat, "ttft": ttft if ttft is not None else lat,
            "tokens": tokens, "text": "".join(text)}


async def _one_whole(client, endpoint: str, body: dict, t0: float) -> dict:
    try:
        r = await client.post(PATHS[endpoint], json=body)
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:300]}"}
        ev = r.json()
    except Exception as e:  # noqa: BLE001 - a load test reports every failure
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    lat = time.perf_counter() - t0
    text = _delta_text(endpoint, ev, chat_key="message")
    tokens = (ev.get("usage") or {}).get("completion_tokens", 0)
    return {"ok": True, "latency": lat, "ttft": lat, "tokens": tokens, "text": text}


async def run_load(url: str, bodies: list[dict], concurrency: int, endpoint: str,
                   api_key: str | None = None, timeout: float = 600.0) -> dict:
    """Send ``bodies`` with ``concurrency`` workers; a report dict (without server metrics)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    results: list[dict | None] = [None] * len(bodies)
    next_i = iter(range(len(bodies)))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        async def worker():
            for i in next_i:
                results[i] = await one_request(client, endpoint, bodies[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r and r["ok"]]
    errors = [r["error"] for r in results if r and not r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"endpoint": endpoint, "concurrency": concurrency, "requests": len(bodies),
            "ok": len(ok), "errors": len(errors), "error_samples": errors[:5],
            "wall_s": round(wall, 4), "throughput_rps": round(len(ok) / wall, 4),
            "completion_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 2),
            "ttft_s": summary([r["ttft"] for r in ok]),
            "latency_s": summary([r["latency"] for r in ok]),
            "texts": [r["text"] if r and r["ok"] else None for r in results]}


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def scrape(url: str) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=30.0) as c:
        r = await c.get("/metrics")
        r.raise_for_status()
        return parse_metrics(r.text)


async def wait_pages_free(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Scrape until ``kv_pages_used`` reads 0 (or ``timeout``); the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = await scrape(url)
        if m.get("flash_dllm_kv_pages_used", 0) == 0 or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


async def bench(url: str, prompts: list[str], n_requests: int, concurrency: int, endpoint: str,
                knobs: dict, api_key: str | None = None, sequential: bool = False,
                keep_texts: bool = False) -> dict[str, Any]:
    """Warm up, optionally run sequentially, run concurrently; the JSON report."""
    bodies = [request_body(endpoint, prompts[i % len(prompts)], knobs) for i in range(n_requests)]
    first = await run_load(url, bodies[:1], 1, endpoint, api_key)  # warm-up, not counted
    report: dict[str, Any] = {"url": url, "knobs": knobs,
                              "first_request_latency_s": first["latency_s"]["max"]}
    if sequential:
        report["sequential"] = await run_load(url, bodies, 1, endpoint, api_key)
    before = await scrape(url)
    run = await run_load(url, bodies, concurrency, endpoint, api_key)
    after = await wait_pages_free(url)
    # stalls inside the timed run: kernels compiled and CUDA graphs captured while it ran; and
    # how the steps ran (graph replays, eager forwards)
    delta = lambda k: after.get(k, 0) - before.get(k, 0)   # noqa: E731
    for name in ("kernel_compiles", "graph_captures", "graph_replays", "eager_forwards"):
        key = f"flash_dllm_{name}_total"
        if key in after:
            run[f"{name}_during_run"] = int(delta(key))
    fw, bs = delta("flash_dllm_forwards_total"), delta("flash_dllm_batch_size_sum")
    # the engine thread's share of the wall time: what is left is the server (HTTP, SSE,
    # detokenising) and, with an in-process client, the client, all under the same GIL
    busy, steps = delta("flash_dllm_step_seconds_sum"), delta("flash_dllm_step_seconds_count")
    run.update(engine_step_s=round(busy, 4),
               engine_busy_frac=round(busy / run["wall_s"], 3) if run["wall_s"] else None,
               mean_step_ms=round(1e3 * busy / steps, 3) if steps else None)
    run.update(forwards=int(fw), mean_batch_size=round(bs / fw, 3) if fw else None,
               kv_pages_used_after=int(after.get("flash_dllm_kv_pages_used", -1)),
               kv_pages_total=int(after.get("flash_dllm_kv_pages_total", -1)),
               requests_running_after=int(after.get("flash_dllm_requests_running", -1)))
    report.update(run)
    if sequential:
        seq = report["sequential"]
        report["speedup_vs_sequential"] = round(seq["wall_s"] / run["wall_s"], 3)
        report["outputs_match_sequential"] = seq["texts"] == run["texts"]
    if not keep_texts:
        report.pop("texts", None)
        report.get("sequential", {}).pop("texts", None)
    return report


def bench_in_subprocess(*args, **kwargs) -> dict[str, Any]:
    """``bench(...)`` run by a fresh client process: the load generator then shares no GIL with
    an in-process server's engine thread (a real client never does). Spawned, not forked: the
    server process holds threads and perhaps a CUDA context."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_bench_sync, *args, **kwargs).result()


def _bench_sync(*args, **kwargs) -> dict[str, Any]:
    return asyncio.run(bench(*args, **kwargs))


# ------------------------------------------------------------------------- in-process server
from flash_dllm.distributed.launch import free_port  # noqa: E402,F401 - (re-exported)


READY_TIMEOUT_S = 900


async def startup_report(url: str) -> dict:
    """Time to ready and the warm-up, from the server's metrics."""
    m = await scrape(url)
    return {"time_to_ready_s": m.get("flash_dllm_time_to_ready_seconds"),
            "warmup_s": m.get("flash_dllm_warmup_seconds"),
            "kernel_compiles_before_ready": int(m.get("flash_dllm_kernel_compiles_total", 0)
                                                - m.get("flash_dllm_kernel_compiles_after_ready"
                                                        "_total", 0)),
            "graph_captures_before_ready": int(m.get("flash_dllm_graph_captures_total", 0)
                                               - m.get("flash_dllm_graph_captures_after_ready"
                                                       "_total", 0))}


class InProcessServer:
    """uvicorn on a free loopback port in a background thread (``with`` block)."""

    def __init__(self, app, aeng) -> None:
        from flash_dllm.server.launch import make_uvicorn_server

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_uvicorn_server(app, aeng, "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "InProcessServer":
        import httpx

        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        # then its warm-up: the load starts when /ready says ready, as a load balancer would.
        # NOTE: one client for all polls: ``httpx.get`` builds a client, hence a TLS context
        # (~40 ms of CPU under this process's GIL), per call, which slowed the warm-up it polled
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while (r := client.get("/ready")).status_code != 200:
                if r.json().get("status") == "error":      # the engine (or its warm-up) failed
                    health = client.get("/health").json()
                    self.__exit__()
                    raise RuntimeError(f"the in-process server's engine failed: "
                                       f"{health.get('error', health)}")
                if not self.thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the in-process server was not ready within "
                                       f"{READY_TIMEOUT_S} s")
                time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
