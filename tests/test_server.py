"""HTTP server: OpenAI endpoints, /generate, streaming, continuous batching, admission, bad input.

The app runs in-process (httpx ``ASGITransport``) over a tiny random LLaDA checkpoint; the
disconnect and SIGTERM tests use a real socket. Outputs are checked against the offline ``LLM``
API at temperature 0.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import EXACT, write_tiny_checkpoint
from flash_dllm import LLM, SamplingParams
from flash_dllm.config import EngineConfig
from flash_dllm.server.app import build_app
from flash_dllm.server.detokenize import IncrementalDetokenizer
from flash_dllm.entrypoints.serve import load_async_engine

MODEL = "tiny"
REQUIRED_METRICS = ("requests_running", "requests_waiting", "kv_pages_used", "kv_pages_total",
                    "forwards_total", "generated_tokens_total", "tokens_per_forward",
                    "step_seconds", "batch_size", "time_to_first_token_seconds",
                    "request_seconds", "sentinel_triggers_total")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("srv") / "tiny", "llada")


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(ckpt)


def make_app(ckpt, **kw):
    econf = kw.pop("engine_config", EngineConfig(num_kv_pages=256))
    aeng, tok, _ = load_async_engine(ckpt, config=econf)
    return build_app(aeng, tok, MODEL, **kw), aeng


@pytest.fixture(scope="module")
def app(ckpt):
    return make_app(ckpt)[0]


def run(coro):
    return asyncio.run(coro)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             timeout=60)


def sse_events(text: str) -> list:
    """``data:`` payloads of an SSE body, in order (``[DONE]`` kept as a string)."""
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics_of(text: str) -> dict[str, float]:
    from flash_dllm.bench.serve import parse_metrics
    return parse_metrics(text)


async def post(app, path, body, **kw):
    async with client(app) as c:
        return await c.post(path, json=body, **kw)


def params16(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 16), block_length=kw.pop("block_length", 16),
                          **kw)


# ------------------------------------------------------------------------------ happy paths
def test_models_health_ready(app):
    async def go():
        async with client(app) as c:
            return [await c.get(p) for p in ("/v1/models", "/health", "/ready")]
    models, health, ready = run(go())
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    assert health.json() == {"status": "ok"} and ready.status_code == 200


def test_completion_matches_llm(app, llm):
    r = run(post(app, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 16}))
    assert r.status_code == 200, r.text
    body = r.json()
    ref = llm.generate("Hello there", params16())[0]
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == ref.text
    assert body["choices"][0]["finish_reason"] == ref.finish_reason
    u = body["usage"]
    assert u["prompt_tokens"] == len(ref.prompt_token_ids)
    assert u["completion_tokens"] == len(ref.token_ids)
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_chat_matches_llm(app, llm):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = run(post(app, "/v1/chat/completions", {"messages": msgs, "max_tokens": 16,
                                               "decode": "threshold", "threshold": 0.5}))
    assert r.status_code == 200, r.text
    ref = llm.chat(msgs, params16(decode="threshold", threshold=0.5))[0]
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref.text}
    assert r.json()["object"] == "chat.completion"


def test_generate_endpoint_maps_knobs(app, llm):
    # (num_inference_steps is vanilla's step count: the exact sampler, named)
    r = run(post(app, "/generate", {"prompt": "abc", "max_new_tokens": 24, "num_inference_steps": 12,
                                    "block_length": 8, "temperature": 0.0, **EXACT}))
    assert r.status_code == 200, r.text
    ref = llm.generate("abc", SamplingParams(max_tokens=24, block_length=8, steps=12, **EXACT))[0]
    assert r.json()["token_ids"] == ref.token_ids and r.json()["text"] == ref.text
    assert r.json()["num_forwards"] == ref.num_forwards


def test_default_block_length_divides_odd_max_tokens(app):
    r = run(post(app, "/v1/completions", {"prompt": "x", "max_tokens": 24}))   # 24 % 32 != 0
    assert r.status_code == 200, r.text


# (the exact sampler where the answer must arrive over several steps)
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 32, "block_length": 16,
                         **EXACT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
                              "cache": "dual", "block_length": 16}),
    ("/generate", {"prompt": "Hello there", "max_new_tokens": 32, "block_length": 16,
                   **EXACT}),
])
def test_streaming_concatenates_to_non_streamed(app, path, body):
    async def go():
        async with client(app) as c:
            full = await c.post(path, json=body)
            streamed = await c.post(path, json={**body, "stream": True,
                                                **({} if path == "/generate" else
                                                   {"stream_options": {"include_usage": True}})})
            return full, streamed
    full, streamed = run(go())
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith(
        "text/event-stream")
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and all(e != "[DONE]" for e in events[:-1])
    events = events[:-1]
    if path == "/generate":
        deltas = [e["text"] for e in events]
        final_text, usage = full.json()["text"], events[-1]["usage"]
        assert events[-1]["finished"] and not any(e["finished"] for e in events[:-1])
    elif path == "/v1/completions":
        deltas = [e["choices"][0]["text"] for e in events if e["choices"]]
        final_text, usage = full.json()["choices"][0]["text"], events[-1]["usage"]
        assert all(e["object"] == "text_completion" for e in events)
    else:
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        deltas = [e["choices"][0]["delta"].get("content", "") for e in events if e["choices"]]
        final_text, usage = full.json()["choices"][0]["message"]["content"], events[-1]["usage"]
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({e["id"] for e in events}) == 1
    assert "".join(deltas) == final_text
    assert len([d for d in deltas if d]) >= 2, "expected the prefix to arrive in several chunks"
    assert usage == full.json()["usage"]


def test_incremental_detokenizer_never_splits_utf8():
    text = "héllo wörld — 数字 🙂!"
    data = list(text.encode())                       # one "token" per byte, like byte-level BPE

    def decode(ids):
        return bytes(ids).decode("utf-8", errors="replace")

    det = IncrementalDetokenizer(decode)
    deltas = [det.step(data[:n]) for n in range(1, len(data) + 1)]
    deltas.append(det.step(data, final=True))
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    det = IncrementalDetokenizer(decode)            # jumps of several tokens at once
    out = det.step(data[:2]) + det.step(data[:9]) + det.step(data, final=True)
    assert out == text
    det = IncrementalDetokenizer(decode)            # an unresolved byte is flushed at the end
    assert det.step([0x61, 0xE2]) == "a" and det.step([0x61, 0xE2], final=True) == "\ufffd"


# --------------------------------------------------------------------- continuous batching
def test_concurrent_requests_equal_solo_and_share_forwards(ckpt, llm):
    app, aeng = make_app(ckpt)
    jobs = [("a", dict(max_tokens=16, block_length=16)),
            ("prompt number two", dict(max_tokens=32, block_length=8, steps=16)),
            ("third", dict(max_tokens=24, decode="threshold", threshold=0.7, block_length=8)),
            ("4", dict(max_tokens=16, cache="prefix", block_length=8)),
            ("fifth one here", dict(max_tokens=32, cache="dual", decode="threshold",
                                    threshold=0.8, block_length=16))]

    async def go():
        async with client(app) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, **kw})
                                        for p, kw in jobs))
            return rs, await c.get("/metrics")
    rs, m = run(go())
    for (p, kw), r in zip(jobs, rs):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == llm.generate(p, SamplingParams(**kw))[0].text
    m = metrics_of(m.text)
    # rows at different steps/lengths shared forwards: fewer forwards than the solo runs summed
    solo_forwards = sum(r.json()["usage"]["num_forwards"] for r in rs)
    assert m["flash_dllm_forwards_total"] < solo_forwards
    assert m["flash_dllm_batch_size_sum"] > m["flash_dllm_batch_size_count"]
    assert m["flash_dllm_kv_pages_used"] == 0 and m["flash_dllm_requests_running"] == 0


def test_metrics_present_and_moving(ckpt):
    app, _ = make_app(ckpt)

    async def go():
        async with client(app) as c:
            before = metrics_of((await c.get("/metrics")).text)
            await c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 16})
            text = (await c.get("/metrics")).text
            return before, metrics_of(text), text
    before, after, text = run(go())
    for name in REQUIRED_METRICS:
        assert f"flash_dllm_{name}" in text, name
    assert after["flash_dllm_kv_pages_total"] == 256
    for name in ("forwards_total", "generated_tokens_total", "step_seconds_count",
                 "batch_size_count", "request_seconds_count", "tokens_per_forward_count"):
        assert after[f"flash_dllm_{name}"] > before.get(f"flash_dllm_{name}", 0), name
    assert after['flash_dllm_sentinel_triggers_total{sentinel="entropy"}'] == 0


def test_every_sampling_knob_rides_in_the_body(ckpt, llm):
    """Every SamplingParams field but max_tokens is a body knob, and each arrives at the engine
    with the value sent (all non-default; drift runs without verify and edit is a policy of its
    own, so in further requests); the sentinels then run and the text equals the offline API's with the same params. Out of
    range is a 400 naming the field, a wrong type too."""
    from dataclasses import fields
    from flash_dllm.server.protocol import DLLMKnobs
    assert set(DLLMKnobs.model_fields) == {f.name for f in fields(SamplingParams)} - {"max_tokens"}
    app, aeng = make_app(ckpt)
    seen = []
    real = aeng.submit
    aeng.submit = lambda ids, params, *a, **k: seen.append(params) or real(ids, params, *a, **k)
    verify = {"max_tokens": 16, "block_length": 8, "steps": 8, "decode": "verify",
              "cache": "dual", "threshold": 0.001, "gamma": 0.7, "verify_rule": "cumprod",
              "max_verify": 4, "entropy_max": 0.5, "perturb_sigma": 0.25, "kv_jaccard_min": 0.9,
              "kv_top_k": 4, "flash_budget": 3, "early_stop": False, "temperature": 0.5,
              "top_k": 5, "top_p": 0.9, "seed": 7}
    drift = {"max_tokens": 16, "block_length": 8, "decode": "vanilla", "cache": "prefix",
             "drift_min": 0.9, "drift_defer": False}
    edit = {"max_tokens": 16, "block_length": 8, "decode": "edit", "cache": "dual",
            "edit_threshold": 0.5, "max_post_edit_steps": 2}
    defaults = SamplingParams()
    for body in (verify, drift, edit):
        assert all(v != getattr(defaults, k) for k, v in body.items()), body
    # a new knob is a new body field (generated): send it here too
    assert set(verify) | set(drift) | set(edit) == {f.name for f in fields(SamplingParams)}

    async def go():
        async with client(app) as c:
            ok = [await c.post("/v1/completions", json={"prompt": "Hello", **kw})
                  for kw in (verify, drift, edit)]
            bad = [await c.post("/v1/completions", json={"prompt": "Hello", **kw})
                   for kw in ({"kv_jaccard_min": 1.5}, {"max_verify": 0, "decode": "verify"},
                              {"verify_rule": "majority"}, {"drift_min": "0.9"})]
            return ok, bad, metrics_of((await c.get("/metrics")).text)
    ok, bad, m = run(go())
    for r, body, params in zip(ok, (verify, drift, edit), seen):
        assert r.status_code == 200, r.text
        assert {k: getattr(params, k) for k in body} == body
        ref = llm.generate("Hello", SamplingParams(**body))[0].text
        assert r.json()["choices"][0]["text"] == ref
    checks = aeng.engine.stats["sentinel_checks"]
    assert all(checks[s] > 0 for s in ("kv_consistency", "entropy", "perturbation", "drift"))
    assert 0 <= m["flash_dllm_sentinel_trigger_rate"] <= 1
    for r, field in zip(bad, ("kv_jaccard_min", "max_verify", "verify_rule", "drift_min")):
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


# ----------------------------------------------------------------------- admission control
def test_request_waits_for_pages_then_runs(ckpt, llm):
    # prompt "ab" (3 ids with BOS) + 32 slots = 35 tokens = 3 pages of 16; the pool holds 4
    app, aeng = make_app(ckpt, engine_config=EngineConfig(num_kv_pages=4, page_size=16))
    body = {"prompt": "ab", "max_tokens": 32, "block_length": 8}

    async def go():
        async with client(app) as c:
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            second = asyncio.create_task(c.post("/v1/completions", json=body))
            seen_waiting = False
            while not (first.done() and second.done()):
                seen_waiting |= aeng.num_waiting == 1 and aeng.engine.pool.num_used == 3
                await asyncio.sleep(0.002)
            return first.result(), second.result(), seen_waiting
    a, b, seen_waiting = run(go())
    ref = llm.generate("ab", SamplingParams(max_tokens=32, block_length=8))[0].text
    assert a.json()["choices"][0]["text"] == ref == b.json()["choices"][0]["text"]
    assert seen_waiting and aeng.engine.pool.num_used == 0


def test_request_larger_than_pool_is_400(ckpt):
    app, _ = make_app(ckpt, engine_config=EngineConfig(num_kv_pages=2, page_size=16))
    r = run(post(app, "/v1/completions", {"prompt": "ab", "max_tokens": 32}))
    assert r.status_code == 400 and "KV pages" in r.json()["error"]["message"]


def test_full_queue_is_429_with_retry_after(ckpt):
    # one canvas of "ab" + 128 slots (9 pages) fills the pool: the 2nd waits, the 3rd is refused
    app, aeng = make_app(ckpt, engine_config=EngineConfig(num_kv_pages=9, max_waiting=1))
    long = {"prompt": "ab", "max_tokens": 128, "block_length": 32}

    async def until(cond, tasks):
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline and not any(t.done() for t in tasks)
            await asyncio.sleep(0.001)

    async def go():
        async with client(app) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=long))]
            await until(lambda: aeng.num_running == 1, tasks)
            tasks.append(asyncio.create_task(c.post("/v1/completions", json=long)))
            await until(lambda: aeng.num_waiting == 1, tasks)
            third = await c.post("/v1/completions", json=long)
            return third, await asyncio.gather(*tasks)
    third, (a, b) = run(go())
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert a.status_code == b.status_code == 200


def test_cancelling_consumer_aborts_and_frees_pages(ckpt):
    _, aeng = make_app(ckpt)
    pool = aeng.engine.pool

    async def go():
        gen = aeng.generate([1, 40, 41], SamplingParams(max_tokens=128, block_length=32))
        first = await gen.__anext__()
        used_while_running = pool.num_used
        await gen.aclose()                          # what a client disconnect does
        for _ in range(500):
            if pool.num_used == 0 and aeng.num_unfinished == 0:
                break
            await asyncio.sleep(0.01)
        return first, used_while_running
    first, used = run(go())
    assert not first.finished and used == 9         # ceil((3 + 128) / 16)
    assert pool.num_used == 0 and aeng.num_running == 0 and aeng.engine.running == []


def test_client_disconnect_over_socket_frees_pages(ckpt):
    from flash_dllm.bench.serve import InProcessServer

    app, aeng = make_app(ckpt)
    long = {"prompt": "ab", "max_tokens": 192, "block_length": 32}
    with InProcessServer(app, aeng) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                next(r.iter_lines())                # the first chunk arrived: then hang up
            try:                                    # non-streamed: the client times out
                c.post("/v1/completions", json=long, timeout=0.3)
            except httpx.TimeoutException:
                pass
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                m = metrics_of(c.get("/metrics").text)
                if m['flash_dllm_requests_finished_total{finish_reason="abort"}'] == 2:
                    break
                time.sleep(0.05)
    assert m['flash_dllm_requests_finished_total{finish_reason="abort"}'] == 2
    assert m["flash_dllm_kv_pages_used"] == 0 and m["flash_dllm_requests_running"] == 0


def test_drain_finishes_in_flight_and_refuses_new(ckpt):
    app, aeng = make_app(ckpt)

    async def go():
        async with client(app) as c:
            inflight = asyncio.create_task(c.post("/generate", json={
                "prompt": "ab", "max_new_tokens": 32, "block_length": 8}))
            while aeng.num_running == 0:
                await asyncio.sleep(0.001)
            drained = asyncio.create_task(aeng.drain())
            await asyncio.sleep(0)
            refused = await c.post("/generate", json={"prompt": "x", "max_new_tokens": 8})
            ready = await c.get("/ready")
            return await inflight, refused, ready, await drained
    inflight, refused, ready, drained = run(go())
    assert inflight.status_code == 200 and inflight.json()["finish_reason"] in ("stop", "length")
    assert refused.status_code == 503 and "retry-after" in refused.headers
    assert ready.status_code == 503 and drained


@pytest.mark.slow
def test_sigterm_drains_then_exits(ckpt, tmp_path):
    from flash_dllm.bench.serve import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flash_dllm.cli", "serve", "--model", str(ckpt),
                             "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        body = {"prompt": "ab", "max_tokens": 128, "block_length": 32, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln]
        assert first.startswith("data: ") and rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("stop", "length")   # ran to the end
        proc.wait(timeout=30)                        # then the process exits by itself
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------------------ bad input
BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', None, 400),
    ("not an object", "/v1/completions", b"[1, 2]", None, 400),
    ("empty body", "/v1/completions", b"", None, 400),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, "prompt", 400),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "16"}, "max_tokens", 400),
    ("max_tokens float", "/v1/completions", {"prompt": "x", "max_tokens": 16.0}, "max_tokens", 400),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature",
     400),
    ("stream not bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", 400),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, "messages", 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]},
     "messages", 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, "messages", 400),
    ("unknown param", "/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate", 400),
    ("unknown chat param", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -100}}, "logit_bias",
     400),
    ("unknown generate param", "/generate", {"prompt": "x", "max_tokens": 8}, "max_tokens", 400),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", 400),
    ("max_tokens negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": -4}, "max_tokens", 400),
    ("max_new_tokens zero", "/generate", {"prompt": "x", "max_new_tokens": 0}, "max_new_tokens", 400),
    ("max_tokens over model length", "/v1/completions", {"prompt": "x", "max_tokens": 512},
     "max_tokens", 400),
    ("prompt over model length", "/v1/completions", {"prompt": "y" * 300, "max_tokens": 8},
     "prompt", 400),
    ("threshold zero", "/v1/completions", {"prompt": "x", "threshold": 0}, "threshold", 400),
    ("threshold above one", "/generate", {"prompt": "x", "threshold": 1.5}, "threshold", 400),
    ("gamma zero", "/v1/completions", {"prompt": "x", "gamma": 0}, "gamma", 400),
    ("gamma negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "gamma": -0.5}, "gamma", 400),
    ("block_length not dividing", "/v1/completions",
     {"prompt": "x", "max_tokens": 16, "block_length": 5}, "block_length", 400),
    ("steps not a multiple of blocks", "/generate",
     {"prompt": "x", "max_new_tokens": 16, "block_length": 8, "num_inference_steps": 3}, "steps", 400),
    ("bad decode", "/v1/completions", {"prompt": "x", "decode": "magic"}, "decode", 400),
    # a seed torch cannot take failed the engine's step, and then every request (a review)
    ("seed over 2**64-1", "/v1/completions", {"prompt": "x", "temperature": 1.0,
                                              "seed": 2**64}, "seed", 400),
    ("sentinel seed over 2**64-1", "/v1/completions",
     {"prompt": "x", "max_tokens": 16, "block_length": 8, "decode": "verify",
      "threshold": 0.001, "perturb_sigma": 0.5, "seed": 2**64 + 5}, "seed", 400),
    ("seed + n - 1 over 2**64-1", "/v1/completions", {"prompt": "x", "temperature": 1.0,
                                                      "seed": 2**64 - 2, "n": 3}, "seed", 400),
    ("bad cache", "/v1/completions", {"prompt": "x", "cache": "huge"}, "cache", 400),
    ("n > 16", "/v1/completions", {"prompt": "x", "n": 17}, "n", 400),
    ("too many stop strings", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
     "stop", 400),
    ("empty prompt ids", "/v1/completions", {"prompt": []}, "prompt", 400),
    ("token id outside vocab", "/v1/completions", {"prompt": [1, 99999]}, "prompt", 400),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, "prompt", 400),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, "model", 404),
]


@pytest.mark.parametrize("name,path,body,param,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_openai_error(app, name, path, body, param, status):
    async def go():
        async with client(app) as c:
            if isinstance(body, bytes):
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await c.post(path, json=body)
            return r, await c.post("/generate", json={"prompt": "ok", "max_new_tokens": 8})
    r, after = run(go())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    assert after.status_code == 200                 # the server keeps serving


def test_api_key_and_body_limit(ckpt):
    app, _ = make_app(ckpt, api_key="s3cret", max_body_bytes=2048)
    ok_body = {"prompt": "x", "max_tokens": 8}

    async def go():
        async with client(app) as c:
            return dict(
                missing=await c.post("/v1/completions", json=ok_body),
                wrong=await c.post("/v1/completions", json=ok_body,
                                   headers={"Authorization": "Bearer nope"}),
                wrong_gen=await c.post("/generate", json={"prompt": "x"},
                                       headers={"Authorization": "Bearer nope"}),
                models=await c.get("/v1/models"),
                ok=await c.post("/v1/completions", json=ok_body,
                                headers={"Authorization": "Bearer s3cret"}),
                x_api_key=await c.get("/v1/models", headers={"x-api-key": "s3cret"}),
                big=await c.post("/v1/completions", json={"prompt": "x" * 5000},
                                 headers={"Authorization": "Bearer s3cret"}),
                health=await c.get("/health"),
                metrics=await c.get("/metrics"))
    r = run(go())
    for k in ("missing", "wrong", "wrong_gen", "models"):
        assert r[k].status_code == 401, k
        assert r[k].json()["error"]["code"] == "invalid_api_key"
    assert r["ok"].status_code == 200 and r["x_api_key"].status_code == 200
    assert r["big"].status_code == 413 and "2048" in r["big"].json()["error"]["message"]
    assert r["health"].status_code == 200 and r["metrics"].status_code == 200
    assert 'flash_dllm_http_errors_total{status="401"} 4.0' in r["metrics"].text


def test_chunked_body_over_limit_is_413(ckpt):
    app, _ = make_app(ckpt, max_body_bytes=1024)

    async def chunks():
        for _ in range(4):
            yield b" " * 512                        # no Content-Length: counted as it arrives

    async def go():
        async with client(app) as c:
            return await c.post("/v1/completions", content=chunks(),
                                headers={"content-type": "application/json"})
    r = run(go())
    assert r.status_code == 413


def test_num_inference_steps_alone_selects_the_vanilla_sampler(app, llm):
    """/generate's num_inference_steps is vanilla's step count: sent without a decode policy it
    decodes with vanilla (the server's default cache), not the default threshold policy, which
    ignores steps; with a decode policy named, that one decodes."""
    body = {"prompt": "abc", "max_new_tokens": 24, "num_inference_steps": 12, "block_length": 8}
    r = run(post(app, "/generate", body))
    assert r.status_code == 200, r.text
    ref = llm.generate("abc", SamplingParams(max_tokens=24, block_length=8, steps=12,
                                             decode="vanilla"))[0]
    assert r.json()["token_ids"] == ref.token_ids and r.json()["num_forwards"] == 12
    r = run(post(app, "/generate", {**body, "decode": "threshold"}))
    ref = llm.generate("abc", SamplingParams(max_tokens=24, block_length=8, steps=12,
                                             decode="threshold"))[0]
    assert r.json()["token_ids"] == ref.token_ids
    assert r.json()["num_forwards"] == ref.num_forwards
