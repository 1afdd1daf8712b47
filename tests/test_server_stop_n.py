"""OpenAI ``stop`` strings and ``n`` choices on /v1/completions and /v1/chat/completions.

The string logic (``flash_dllm.server.stops``) is tested on its own; the endpoints run in-process
over the shipped demo model (a character-level tokenizer: one token per character), which answers
"Ivy has 23 pens. ..." with "23-12=11. 23+11=34. #### 34" at temperature 0. The disconnect and
queue-full tests use the tiny random checkpoint of tests/test_server.py.
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.stops import (MAX_STOP_STRINGS, StopBuffer, find_stop, partial_stop_len,
                                     stop_strings, tokens_covering)
from conftest import EXACT
from test_server import ckpt, client, make_app, metrics_of, run, sse_events  # noqa: F401

QUESTION = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"
ANSWER = "23-12=11. 23+11=34. #### 34"
MESSAGES = [{"role": "user", "content": QUESTION}]
ABORTS = 'flash_dllm_requests_finished_total{finish_reason="abort"}'
STOPS = 'flash_dllm_requests_finished_total{finish_reason="stop"}'


# ------------------------------------------------------------------------------- stops.py
def test_stop_strings_validation():
    assert stop_strings(None) == () and stop_strings([]) == ()
    assert stop_strings(".") == (".",) and stop_strings(["a", "bc"]) == ("a", "bc")
    assert len(stop_strings(["a"] * MAX_STOP_STRINGS)) == 4
    with pytest.raises(ValueError, match="at most 4"):
        stop_strings(["a", "b", "c", "d", "e"])
    for bad in ("", ["x", ""]):
        with pytest.raises(ValueError, match="empty"):
            stop_strings(bad)


def test_find_stop_earliest_of_all():
    assert find_stop("23-12=11. 23+11=34.", ["=", "."]) == 5
    assert find_stop("23-12=11. 23+11=34.", [".", "="]) == 5        # order does not matter
    assert find_stop("23-12=11. 23+11=34.", ["34", "zz"]) == 16
    assert find_stop("abc", ["zz"]) == -1 and find_stop("abc", []) == -1
    assert find_stop("a.b.c", ["."], start=2) == 3
    assert find_stop("aaab", ["ab", "aab"]) == 1                     # overlapping candidates


def test_partial_stop_len():
    assert partial_stop_len("34. #", ["####"]) == 1
    assert partial_stop_len("34. ###", ["####"]) == 3
    assert partial_stop_len("34. ", ["####"]) == 0
    assert partial_stop_len("x##", ["##", "abc"]) == 1    # "##" is a full match, not a partial
    assert partial_stop_len("ab", ["abc", "bcd"]) == 2    # longest wins
    assert partial_stop_len("xb", ["abc", "bcd"]) == 1
    assert partial_stop_len("hello", [".", "\n"]) == 0    # one-character stops hold nothing
    assert partial_stop_len("", ["abc"]) == 0 and partial_stop_len("abc", []) == 0


def test_stop_buffer_holds_back_and_cuts():
    buf = StopBuffer(["####"])
    assert buf.push("23+11=34. ") == "23+11=34. "
    assert buf.push("##") == "" and not buf.stopped            # may become "####": held back
    assert buf.push("#") == ""
    assert buf.push("# 34") == "" and buf.stopped               # never past the stop string
    assert buf.output == "23+11=34. " and buf.push("more", final=True) == ""
    buf = StopBuffer(["####"])
    assert buf.push("a ##") == "a " and buf.push("x") == "##x"  # released: not a stop after all
    assert buf.push("#", final=True) == "#" and buf.output == "a ##x#" and not buf.stopped
    buf = StopBuffer()                                          # no stop strings: pass-through
    assert buf.push("ab") == "ab" and buf.push("c", final=True) == "c" and buf.output == "abc"
    buf = StopBuffer(["."])
    assert buf.push("23-12=11. 23") == "23-12=11" and buf.stopped and buf.output == "23-12=11"


def test_stop_buffer_random_splits_match_whole_text():
    rng = random.Random(0)
    alphabet = "ab#. "
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        stops = [("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
                 for _ in range(rng.randint(0, 3))]
        pos = find_stop(text, stops)
        expected = text if pos < 0 else text[:pos]
        buf, out, i = StopBuffer(stops), "", 0
        while i < len(text):
            j = min(len(text), i + rng.randint(0, 5))
            out += buf.push(text[i:j])
            assert expected.startswith(out), (text, stops, out)   # never past a stop
            i = j
        out += buf.push("", final=True)
        assert out == expected == buf.output, (text, stops)
        assert buf.stopped == (pos >= 0)


def test_tokens_covering():
    def chars(ids):                                  # one character per id
        return "".join(chr(i) for i in ids)
    ids = [ord(c) for c in ANSWER]
    assert tokens_covering(ids, "23-12=11", chars) == 8
    assert tokens_covering(ids, "", chars) == 0
    assert tokens_covering(ids, ANSWER, chars) == len(ids)
    words = ["23-", "12=", "11.", " 23+"]               # multi-character tokens

    def multi(ids):
        return "".join(words[i] for i in ids)
    assert tokens_covering([0, 1, 2, 3], "23-12=11", multi) == 3     # straddling token counts
    assert tokens_covering([0, 1, 2, 3], "23-12", multi) == 2
    assert tokens_covering([0, 1], "nope", multi) == 2              # not a prefix: all of them


# ------------------------------------------------------------------------------ endpoints
@pytest.fixture(scope="module")
def demo():
    aeng, tok, _ = load_async_engine(None, config=EngineConfig(num_kv_pages=256))
    from flash_dllm.server.app import build_app
    return build_app(aeng, tok, "demo"), aeng


async def _posts(app, *calls):
    async with client(app) as c:
        return [await c.post(path, json=body) for path, body in calls]


def _metrics(app) -> dict[str, float]:
    async def go():
        async with client(app) as c:
            return metrics_of((await c.get("/metrics")).text)
    return run(go())


def _wait_idle(aeng, timeout: float = 20.0) -> None:
    """Aborts are applied by the engine thread before its next step: wait for them."""
    deadline = time.monotonic() + timeout
    while aeng.engine.pool.num_used or aeng.num_unfinished:
        assert time.monotonic() < deadline, (aeng.engine.pool.num_used, aeng.num_unfinished)
        time.sleep(0.01)


def _text(path: str, choice: dict) -> str:
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def _request(path: str, **kw) -> dict:
    return {"prompt": QUESTION, **kw} if path == "/v1/completions" else {"messages": MESSAGES, **kw}


def _stream_by_index(path: str, events: list) -> tuple[dict[int, list[str]], dict[int, str], dict]:
    """(deltas per index, finish_reason per index, usage) of a streamed response; checks that each
    index's finish chunk is its last one, ``[DONE]`` ends the stream and usage comes once, last."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    events = events[:-1]
    assert len({e["id"] for e in events}) == 1
    deltas: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for k, e in enumerate(events):
        if not e["choices"]:
            assert usage is None and k == len(events) - 1          # the usage chunk: once, last
            usage = e["usage"]
            continue
        (c,) = e["choices"]
        i = c["index"]
        assert i not in finish, "a chunk after the choice's finish chunk"
        if path == "/v1/completions":
            deltas.setdefault(i, []).append(c["text"])
        else:
            if c["delta"].get("role"):
                assert c["delta"] == {"role": "assistant", "content": ""} and i not in deltas
            deltas.setdefault(i, []).append(c["delta"].get("content", ""))
        if c["finish_reason"] is not None:
            finish[i] = c["finish_reason"]
    return deltas, finish, usage


PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
def test_stop_cuts_text_and_saves_forwards(demo, path):
    app, aeng = demo
    before = _metrics(app)
    # the exact sampler: the answer commits over many steps, so a stop string is seen (and the
    # request aborted) before the end (threshold commits the demo's answer in 1-2 forwards)
    full, cut, cut2 = run(_posts(app, (path, _request(path, **EXACT)),
                                 (path, _request(path, stop=".", **EXACT)),
                                 (path, _request(path, stop=["34", "="], **EXACT))))
    assert full.status_code == cut.status_code == cut2.status_code == 200, cut.text
    text = _text(path, full.json()["choices"][0])
    assert text == ANSWER
    c = cut.json()["choices"][0]
    assert _text(path, c) == "23-12=11" and c["finish_reason"] == "stop"
    assert _text(path, cut2.json()["choices"][0]) == "23-12"         # the earliest stop wins
    u, fu = cut.json()["usage"], full.json()["usage"]
    assert u["completion_tokens"] == len("23-12=11")                # one token per character
    assert u["prompt_tokens"] == fu["prompt_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["num_forwards"] < fu["num_forwards"]                    # stopped early
    _wait_idle(aeng)                                                 # pages freed
    after = _metrics(app)
    # both cut requests were aborted in the engine (pages freed) and count as stops (issue 44)
    assert after.get(ABORTS, 0) == before.get(ABORTS, 0)
    full_stops = full.json()["choices"][0]["finish_reason"] == "stop"   # (its EOS)
    assert after[STOPS] == before.get(STOPS, 0) + 2 + full_stops


@pytest.mark.parametrize("path", PATHS)
def test_stop_that_never_occurs_changes_nothing(demo, path):
    app, _ = demo
    full, same, empty = run(_posts(app, (path, _request(path)), (path, _request(path, stop="zz!")),
                                   (path, _request(path, stop=[]))))
    for r in (same, empty):
        assert r.status_code == 200, r.text
        assert r.json()["choices"] == full.json()["choices"]
        assert r.json()["usage"] == full.json()["usage"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stop", [".", "####", ["#### 3", "zz"], "#### 34"])
def test_streamed_stop_equals_non_streamed(demo, path, stop):
    app, aeng = demo
    opts = {"stream_options": {"include_usage": True}}
    full, streamed = run(_posts(app, (path, _request(path, stop=stop)),
                                (path, _request(path, stop=stop, stream=True, **opts))))
    assert full.status_code == streamed.status_code == 200, streamed.text
    deltas, finish, usage = _stream_by_index(path, sse_events(streamed.text))
    expected = _text(path, full.json()["choices"][0])
    stops = [stop] if isinstance(stop, str) else stop
    assert expected == ANSWER[:find_stop(ANSWER, stops)]
    assert "".join(deltas[0]) == expected and finish == {0: "stop"}
    assert full.json()["choices"][0]["finish_reason"] == "stop"
    assert usage == full.json()["usage"]
    _wait_idle(aeng)


BAD = [
    ("too many stops", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("empty stop", {"stop": ""}, "stop"),
    ("empty stop in list", {"stop": ["x", ""]}, "stop"),
    ("stop wrong type", {"stop": 5}, "stop"),
    ("n over 16", {"n": 17}, "n"),
    ("n zero", {"n": 0}, "n"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_stop_and_n_are_400(demo, path, name, extra, param):
    app, _ = demo
    (r,) = run(_posts(app, (path, _request(path, max_tokens=8, **extra))))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("path", PATHS)
def test_n_choices_non_streamed(demo, path):
    app, aeng = demo
    one, three = run(_posts(app, (path, _request(path)), (path, _request(path, n=3))))
    assert three.status_code == 200, three.text
    choices = three.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(_text(path, c) == ANSWER for c in choices)          # temperature 0: all equal
    assert all(c["finish_reason"] == one.json()["choices"][0]["finish_reason"] for c in choices)
    u, u1 = three.json()["usage"], one.json()["usage"]
    assert u["prompt_tokens"] == u1["prompt_tokens"]                 # the prompt counted once
    assert u["completion_tokens"] == 3 * u1["completion_tokens"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["num_forwards"] == 3 * u1["num_forwards"]
    _wait_idle(aeng)


def test_n_with_seed_is_reproducible_and_choice_i_uses_seed_plus_i(demo):
    app, _ = demo
    body = {"prompt": "Hello there", "max_tokens": 16, "temperature": 1.0, "seed": 7}
    a, b, *solo = run(_posts(app, ("/v1/completions", {**body, "n": 3}),
                             ("/v1/completions", {**body, "n": 3}),
                             *(("/v1/completions", {**body, "seed": 7 + i}) for i in range(3))))
    texts = [c["text"] for c in a.json()["choices"]]
    assert texts == [c["text"] for c in b.json()["choices"]]        # reproducible
    assert texts == [r.json()["choices"][0]["text"] for r in solo]  # choice i = seed + i
    assert len(set(texts)) > 1                                      # and the choices differ


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("extra", [
    {"prompt": "Hello there", "max_tokens": 16, "temperature": 1.0, "seed": 7},
    {"stop": "+"},
    {"stop": "####", "max_tokens": 32},
], ids=["sampled", "stop", "stop-hold-back"])
def test_streamed_n_concatenates_per_index(demo, path, extra):
    app, aeng = demo
    if path == "/v1/chat/completions" and "prompt" in extra:
        extra = {**{k: v for k, v in extra.items() if k != "prompt"},
                 "messages": [{"role": "user", "content": extra["prompt"]}]}
    body = {**_request(path), **extra, "n": 2}
    full, streamed = run(_posts(app, (path, body), (path, {
        **body, "stream": True, "stream_options": {"include_usage": True}})))
    assert full.status_code == streamed.status_code == 200, streamed.text
    deltas, finish, usage = _stream_by_index(path, sse_events(streamed.text))
    choices = full.json()["choices"]
    assert sorted(deltas) == [0, 1] and sorted(finish) == [0, 1]
    for c in choices:
        assert "".join(deltas[c["index"]]) == _text(path, c)
        assert finish[c["index"]] == c["finish_reason"]
    if "stop" in extra:
        assert all(c["finish_reason"] == "stop" for c in choices)
    if "seed" in extra:
        assert _text(path, choices[0]) != _text(path, choices[1])
    assert usage == full.json()["usage"]
    _wait_idle(aeng)


def test_streamed_without_usage_has_no_usage_chunk(demo):
    app, _ = demo
    (r,) = run(_posts(app, ("/v1/completions", _request("/v1/completions", n=2, stream=True,
                                                         stop="."))))
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])
    assert sorted(e["choices"][0]["index"] for e in events[:-1]
                  if e["choices"][0]["finish_reason"]) == [0, 1]


# ------------------------------------------------------------- aborts: disconnect, queue full
def test_disconnect_aborts_all_n(ckpt):  # noqa: F811 - the fixture imported from test_server
    from flash_dllm.bench.serve import InProcessServer

    app, aeng = make_app(ckpt)
    long = {"prompt": "ab", "max_tokens": 192, "block_length": 32, "n": 3}
    with InProcessServer(app, aeng) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                next(r.iter_lines())                # the first chunk arrived: then hang up
            try:                                    # non-streamed: the client times out
                c.post("/v1/chat/completions", timeout=0.3, json={
                    **{k: v for k, v in long.items() if k != "prompt"},
                    "messages": [{"role": "user", "content": "ab"}]})
            except httpx.TimeoutException:
                pass
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                m = metrics_of(c.get("/metrics").text)
                if m.get(ABORTS) == 6 and m["flash_dllm_kv_pages_used"] == 0:
                    break
                time.sleep(0.05)
    assert m[ABORTS] == 6
    assert m["flash_dllm_kv_pages_used"] == 0 and aeng.num_unfinished == 0


def test_failed_submission_aborts_the_submitted_choices(ckpt):  # noqa: F811
    # one running slot and one waiting place: the third choice of n=3 cannot be queued
    app, aeng = make_app(ckpt, engine_config=EngineConfig(num_kv_pages=256, max_num_seqs=1,
                                                          max_waiting=1))

    async def go():
        async with client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 128, "n": 3})
            deadline = time.monotonic() + 20
            while aeng.num_unfinished or aeng.engine.pool.num_used:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            return r, metrics_of((await c.get("/metrics")).text)
    r, m = run(go())
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert m.get(ABORTS, 0) >= 1                            # choice 0 (and maybe 1) was aborted
    assert not any(v for k, v in m.items()                  # ... and nothing ran to its end
                   if k.startswith("flash_dllm_requests_finished_total") and k != ABORTS)
    assert m["flash_dllm_kv_pages_used"] == 0
