"""``flash-dllm bench multiturn`` on the CPU against the shipped demo model: the report's fields,
every request succeeds, the history grows turn by turn, a session that outgrows the model's
maximum length stops cleanly, the counter deltas, and the CLI's parsing and validation."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import pytest

from flash_dllm.bench import multiturn as mt
from flash_dllm.bench.multiturn import MultiturnConfig, counter_deltas, run_multiturn, table
from flash_dllm.bench.serve import parse_metrics
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.cli import build_parser, main


def _args(*extra: str):
    return build_parser().parse_args(["bench", "multiturn", *extra])


@pytest.fixture(scope="module")
def server():
    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import build_server_app

    a = _args()
    a.served_model_name, a.max_body_bytes = None, 1 << 20
    app, aeng, _ = build_server_app(a)
    with InProcessServer(app, aeng) as srv:
        yield srv


def test_report_fields_all_ok_and_history_grows(server):
    cfg = MultiturnConfig(users=2, turns=2, history_tokens=48, max_tokens=16, idle_s=0.0)
    rep = asyncio.run(run_multiturn(server.url, cfg, keep_texts=True))
    for key in ("config", "max_model_len", "requests", "ok", "errors", "error_samples", "stopped",
                "wall_s", "throughput_rps", "prompt_tokens", "completion_tokens",
                "output_tokens_per_s", "ttft_s", "latency_s", "per_turn", "server_metrics",
                "records"):
        assert key in rep, key
    assert rep["max_model_len"] == 512
    assert rep["requests"] == rep["ok"] == 4 and rep["errors"] == 0 and rep["stopped"] == []
    assert [t["turn"] for t in rep["per_turn"]] == [1, 2]
    for t in rep["per_turn"]:
        assert t["ok"] == 2 and t["ttft_s"]["mean"] > 0 and t["ttft_s"]["p99"] is not None
        assert t["latency_s"]["mean"] >= t["ttft_s"]["mean"]
    assert rep["per_turn"][1]["prompt_tokens_mean"] > rep["per_turn"][0]["prompt_tokens_mean"]
    by = {(r["user"], r["turn"]): r for r in rep["records"]}
    for u in range(2):
        first, second = by[(u, 1)], by[(u, 2)]
        # the follow-up prompt holds the first prompt, its answer and a new question
        assert second["prompt_tokens"] >= first["prompt_tokens"] + len(first["text"]) + 10
    m = rep["server_metrics"]
    assert m["kv_pages_used_after"] == 0 and m["requests_running_after"] == 0
    assert m["forwards"] > 0
    assert set(m["exported"]) == set(mt.COUNTERS)
    assert set(m["prefix_cache_hit_tokens"]) >= {"l0", "l1", "l2", "total"}
    json.dumps(rep)                                     # the report is plain JSON
    assert "turn" in table(rep)


def test_session_stops_cleanly_at_max_model_len(server, monkeypatch):
    # the estimate stops the session before sending the too-long turn ...
    cfg = MultiturnConfig(users=1, turns=3, history_tokens=380, max_tokens=16)
    rep = asyncio.run(run_multiturn(server.url, cfg, warmup=False))
    assert rep["errors"] == 0 and rep["ok"] == 1
    assert rep["stopped"] == [{"user": 0, "turn": 2, "reason": "max_model_len",
                               "estimated_prompt_tokens": rep["stopped"][0]
                               ["estimated_prompt_tokens"]}]

    # ... and without an estimate the server's 400 context_length_exceeded stops it the same way
    async def unknown(client):
        return None
    monkeypatch.setattr(mt, "server_max_model_len", unknown)
    rep = asyncio.run(run_multiturn(server.url, cfg, warmup=False))
    assert rep["errors"] == 0 and rep["ok"] == 1 and rep["max_model_len"] is None
    assert [(s["turn"], s["reason"]) for s in rep["stopped"]] == [(2, "max_model_len")]
    assert rep["server_metrics"]["kv_pages_used_after"] == 0


def test_sessions_are_deterministic_and_sized():
    cfg = MultiturnConfig(users=2, turns=1, history_tokens=100, chars_per_token=2.0, seed=3)
    (m0, _), (m0b, _), (m1, _) = mt.opening(cfg, 0), mt.opening(cfg, 0), mt.opening(cfg, 1)
    assert m0 == m0b and m0 != m1
    assert len(m0[0]["content"]) == 200 and m0[0]["role"] == "system" and m0[1]["role"] == "user"
    shared = dataclasses.replace(cfg, shared_prefix=True)
    assert mt.opening(shared, 0)[0][0] == mt.opening(shared, 1)[0][0]
    assert mt.synthetic_text(random.Random(0), 0) == ""


def test_counter_deltas():
    before = parse_metrics(
        'flash_dllm_prefix_cache_query_tokens_total 100.0\n'
        'flash_dllm_prefix_cache_hit_tokens_total{tier="l0"} 10.0\n'
        'flash_dllm_kv_bytes_moved_total{direction="down",tier="l1"} 0.0\n'
        'flash_dllm_forwards_total 5.0\nflash_dllm_batch_size_sum 5.0\n')
    after = parse_metrics(
        'flash_dllm_prefix_cache_query_tokens_total 500.0\n'
        'flash_dllm_prefix_cache_hit_tokens_total{tier="l0"} 210.0\n'
        'flash_dllm_prefix_cache_hit_tokens_total{tier="l1"} 100.0\n'
        'flash_dllm_kv_bytes_moved_total{direction="down",tier="l1"} 4096.0\n'
        'flash_dllm_kv_bytes_moved_total{direction="up",tier="l1"} 2048.0\n'
        'flash_dllm_kv_tier_slower_than_recompute_total 1.0\n'
        'flash_dllm_kv_prefetch_pages_total{outcome="issued"} 3.0\n'
        'flash_dllm_kv_prefetch_pages_total{outcome="on_time"} 2.0\n'
        'flash_dllm_kv_pages_used 0.0\nflash_dllm_kv_pages_cached{tier="l0"} 7.0\n'
        'flash_dllm_forwards_total 15.0\nflash_dllm_batch_size_sum 25.0\n')
    d = counter_deltas(before, after)
    assert d["prefix_cache_query_tokens"] == 400
    assert d["prefix_cache_hit_tokens"] == {"l0": 200, "l1": 100, "l2": 0, "total": 300}
    assert d["prefix_cache_hit_rate"] == 0.75
    assert d["kv_bytes_moved"] == {"l1:down": 4096, "l1:up": 2048}
    assert d["kv_bytes_moved_total"] == 6144 and d["kv_bytes_moved_per_hit_token"] == 20.48
    assert d["kv_tier_slower_than_recompute"] == 1 and all(d["exported"].values())
    assert d["kv_prefetch_pages"] == {"issued": 3, "on_time": 2}
    assert d["kv_pages_used_after"] == 0 and d["kv_pages_cached_after"] == {"l0": 7}
    assert d["forwards"] == 10 and d["mean_batch_size"] == 2.0
    empty = counter_deltas({}, {})
    assert empty["prefix_cache_query_tokens"] == 0 and not any(empty["exported"].values())
    assert empty["prefix_cache_hit_rate"] is None and empty["kv_bytes_moved"] == {}


def test_cli_parses_and_validates(capsys):
    a = _args("--users", "3", "--turns", "5", "--history-tokens", "200", "--idle-s", "0.5",
              "--max-tokens", "8", "--compare", "--shared-prefix", "--json", "r.json")
    assert (a.users, a.turns, a.history_tokens, a.idle_s, a.max_tokens) == (3, 5, 200, 0.5, 8)
    assert a.compare and a.shared_prefix and a.url is None and a.func.__name__ == \
        "cmd_bench_multiturn"
    for flag, value in (("--users", "0"), ("--turns", "0"), ("--max-tokens", "0"),
                        ("--idle-s", "-1"), ("--history-tokens", "-1"),
                        ("--chars-per-token", "0")):
        assert main(["bench", "multiturn", flag, value]) == 2       # before any model loads
        assert flag in capsys.readouterr().err
    assert main(["bench", "multiturn", "--compare", "--url", "http://127.0.0.1:9"]) == 2
    assert "--compare" in capsys.readouterr().err
    if "prefix_reuse" in {f.name for f in dataclasses.fields(EngineArgs)}:
        assert _args("--no-prefix-reuse").prefix_reuse is False


def test_compare_runs_both_servers(tmp_path, monkeypatch, capsys):
    from flash_dllm.entrypoints import bench_multiturn as bench

    if "prefix_reuse" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        # the engine has no --no-prefix-reuse yet: check the plumbing with two equal servers
        monkeypatch.setattr(bench, "_has_prefix_reuse", lambda a: True)
    out = tmp_path / "mt.json"
    rc = main(["bench", "multiturn", "--compare", "--users", "1", "--turns", "2",
               "--history-tokens", "32", "--max-tokens", "8", "--no-warmup", "--json", str(out),
               "--png", str(tmp_path / "mt.png")])
    assert rc == 0
    assert (tmp_path / "mt.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(out.read_text())
    assert rep["errors"] == 0
    assert rep["reuse_on"]["prefix_reuse"] is True and rep["reuse_off"]["prefix_reuse"] is False
    # no cache flag: the default request (the family's fast cache) keeps K/V, so the second
    # turn reuses the first one's pages (issue 42: the exact default showed 0 query tokens)
    on = rep["reuse_on"]["server_metrics"]
    assert on["prefix_cache_query_tokens"] > 0 and on["prefix_cache_hit_tokens"]["total"] > 0
    assert [r["turn"] for r in rep["compare"]] == [1, 2]
    for r in rep["compare"]:
        assert r["ttft_mean_on"] > 0 and r["ttft_mean_off"] > 0 and r["ttft_mean_off_over_on"] > 0
    assert "off/on" in capsys.readouterr().out.splitlines()[-3]
    assert main(["bench", "plot", str(out), "--png", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 10_000


@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate"])
def test_bench_serve_whole_answers_equal_streamed_ones(server, endpoint):
    """``bench serve --no-stream``: the same answers as streamed requests, TTFT = latency."""
    from flash_dllm.bench.serve import request_body, run_load

    knobs = {"max_tokens": 8, "temperature": 0.0}
    prompts = ["What is 2 + 3?", "Ivy has 4 pens."]
    streamed = [request_body(endpoint, p, knobs) for p in prompts]
    whole = [request_body(endpoint, p, {**knobs, "stream": False}) for p in prompts]
    assert all(b["stream"] is False and "stream_options" not in b for b in whole)
    a = asyncio.run(run_load(server.url, streamed, 2, endpoint))
    b = asyncio.run(run_load(server.url, whole, 2, endpoint))
    assert a["ok"] == b["ok"] == 2 and a["texts"] == b["texts"]
    assert b["ttft_s"] == b["latency_s"]


def test_bench_serve_requests_per_concurrency(server, tmp_path, capsys):
    """``--requests`` takes one count per ``--concurrency`` value (few at concurrency 1, many
    at high concurrency); any other number of values is a named error before any run."""
    out = tmp_path / "s.json"
    assert main(["bench", "serve", "--url", server.url, "--concurrency", "1", "2",
                 "--requests", "1", "3", "--max-tokens", "8", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [(r["concurrency"], r["requests"], r["ok"]) for r in rep["runs"]] == [(1, 1, 1),
                                                                               (2, 3, 3)]
    capsys.readouterr()
    assert main(["bench", "serve", "--url", server.url, "--concurrency", "1", "2", "4",
                 "--requests", "1", "3"]) == 2
    assert "--requests takes one value, or one per --concurrency value (3), got 2" in \
        capsys.readouterr().err


def test_sse_events_stop_at_done_and_name_what_went_wrong():
    """The load generators' one stream reader (bench serve and bench multiturn): events up to
    [DONE]; an error event or a stream cut short is a StreamError with the text they report."""
    import asyncio

    from flash_dllm.bench.serve import StreamError, sse_events

    class Cut:                          # fault injection: a response whose lines are given
        def __init__(self, lines):
            self.lines = lines

        async def aiter_lines(self):
            for line in self.lines:
                yield line

    async def read(lines):
        return [ev async for ev in sse_events(Cut(lines))]

    ok = ['data: {"a": 1}', "", ": keep-alive", 'data: {"a": 2}', "data: [DONE]", 'data: {"a": 3}']
    assert asyncio.run(read(ok)) == [{"a": 1}, {"a": 2}]
    with pytest.raises(StreamError, match="stream ended without"):
        asyncio.run(read(['data: {"a": 1}']))
    with pytest.raises(StreamError, match='"error"'):
        asyncio.run(read(['data: {"a": 1}', 'data: {"error": {"message": "boom"}}']))
