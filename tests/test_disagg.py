"""Prefill/decode disaggregation (issue 15): real worker processes over gloo on 127.0.0.1, the
real ``openai`` client through the server, and the fault paths.

- 1 prefill + 1 decode worker: every cache mode x decode policy (and a seeded sampled request)
  gives the colocated engine's tokens, token for token; nothing is left held afterwards.
- the server over 1 prefill + 2 decode workers: chat and streaming through the OpenAI client,
  the ``pd_*`` metrics; a killed decode worker fails its requests alone and the router stops
  sending to it.
- in-process workers over the fake transport: a hung transfer times out, a failed one fails,
  an abort in transit frees pages and staging on both sides.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque

import pytest
import torch

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, EngineConfig, SamplingParams
from flash_dllm.disagg import messages as W
from flash_dllm.disagg.worker import Worker
from flash_dllm.distributed.fake_transport import FakeNetwork
from flash_dllm.engine.engine import Engine, run_to_completion
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.loader import load_engine
from conftest import EXACT

# FLASH_DLLM_PD_DEVICE=cuda runs the process tests on the GPU (workers sharing one GPU read each
# other's staging over CUDA IPC; NCCL when each has its own); the default is the CPU with gloo
DEVICE = os.environ.get("FLASH_DLLM_PD_DEVICE", "cpu")
# float32 on any device: token-for-token equality across different batch mixes (bf16 rounding
# could flip a near-tie)
CONFIG = dict(max_num_seqs=4, num_kv_pages=256)
PROMPTS = [[1, 5, 6, 7, 8, 9, 10] * 3, [1, 20, 21, 22], [1, 30, 31, 32, 33, 34] * 5, [1, 40]]


def _params() -> list[SamplingParams]:
    ps = [SamplingParams(max_tokens=24, block_length=8, cache=c, decode=d, early_stop=False)
          for c in CACHE_MODES for d in DECODE_POLICIES
          if not CACHE_MODES[c].needs_block_causal]  # (block: block-causal models)
    ps.append(SamplingParams(max_tokens=24, block_length=8, temperature=0.8, seed=7,
                             decode="threshold", cache="dual", early_stop=False))
    return ps


def _drain(pd, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while pd.has_unfinished():
        pd.step()
        assert time.monotonic() < deadline, "disaggregated requests did not finish"


def _idle(pd) -> None:
    """Nothing held anywhere once the workers reported (pages, staging, transfers)."""
    deadline = time.monotonic() + 10
    while True:
        pd.step()
        ws = pd.pd_snapshot()["workers"]
        if all(w.get("pages_used", 1) == 0 and w.get("staging_used", 1) == 0
               and w.get("sends", 1) == 0 and w.get("recvs", 1) == 0 for w in ws if w["alive"]):
            return
        assert time.monotonic() < deadline, f"held after the requests ended: {ws}"


@pytest.fixture(scope="module", params=[(None, 1), (None, 2), ("nixl", 1)],
                ids=["one_send", "layer_groups", "nixl"])
def pd(request):
    from flash_dllm.entrypoints.pd_launch import launch

    backend, groups = request.param
    if backend == "nixl":
        pytest.importorskip("nixl", reason="nixl does not import here")
    eng = launch(EngineArgs(device=DEVICE, dtype="float32"), 1, 1, timeout_s=20.0,
                 layer_groups=groups, backend=backend, **CONFIG)
    eng.wait_ready(300)
    yield eng
    eng.close()


def test_disaggregated_equals_colocated_token_for_token(pd):
    ps = _params()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(ps))]
    reqs = [pd.add_request(p, q) for p, q in zip(prompts, ps)]
    _drain(pd)
    local = load_engine(EngineArgs(device=DEVICE, dtype="float32"), **CONFIG).engine
    ref = [local.add_request(p, q) for p, q in zip(prompts, ps)]
    run_to_completion(local, ref)
    for i, (a, b) in enumerate(zip(reqs, ref)):
        got, want = pd.output(a), local.output(b)
        assert got.error is None, got.error
        assert got.token_ids == want.token_ids, (i, ps[i])
        assert got.finish_reason == want.finish_reason
        assert got.num_forwards == want.num_forwards
    snap = pd.pd_snapshot()
    assert snap["transfers"] >= len(ps) - 2        # (a request may finish in its first step)
    assert snap["failed_requests"] == 0
    _idle(pd)


def test_abort_in_every_phase_frees_everything(pd):
    p = SamplingParams(max_tokens=256, block_length=32, decode="vanilla", steps=256, cache="none")
    rids = [pd.add_request(PROMPTS[i % 4], p).request_id for i in range(3)]
    pd.step()
    pd.abort(rids[0])                       # probably still on the prefill worker
    for _ in range(40):
        pd.step()
    for r in rids[1:]:                      # decoding (or in transit) by now
        pd.abort(r)
    assert not pd.tracks
    _idle(pd)


def test_bad_request_is_a_named_error_and_others_go_on(pd):
    with pytest.raises(ValueError, match="vocabulary"):
        pd.add_request([10**9], SamplingParams(max_tokens=8, block_length=8, **EXACT))
    ok = pd.add_request(PROMPTS[1], SamplingParams(max_tokens=8, block_length=8, **EXACT))
    _drain(pd)
    assert ok.finished and ok.error is None


# ----------------------------------------------------------------------- server + killed worker
def test_server_with_a_killed_decode_worker(tmp_path):
    openai = pytest.importorskip("openai")
    import argparse

    import httpx

    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import build_server_app

    ns = argparse.Namespace(**{**vars(EngineArgs()), "max_num_seqs": 4, "num_kv_pages": 256,
                               "disaggregate": True, "prefill_workers": 1, "decode_workers": 2,
                               "pd_timeout": 10.0, "pd_staging_gb": 0.05,
                               "pd_role_switching": False, "pd_layer_groups": 1, "pd_transport": "auto",
                               "warmup": "none", "api_key": None,
                               "served_model_name": "demo", "model_shape": None})
    app, aeng, _ = build_server_app(ns)
    with InProcessServer(app, aeng) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        r = client.chat.completions.create(model="demo", max_tokens=16,
                                           messages=[{"role": "user", "content": "What is 3+4?"}])
        assert r.choices[0].message.content
        text = "".join(ch.choices[0].text or "" for ch in client.completions.create(
            model="demo", prompt="Tom has 5 apples.", max_tokens=16, stream=True)
            if ch.choices)
        assert isinstance(text, str)
        metrics = httpx.get(srv.url + "/metrics").text
        for name in ("flash_dllm_pd_transfers_total", "flash_dllm_pd_worker_up",
                     "flash_dllm_pd_worker_staging_segments", "flash_dllm_requests_running"):
            assert name in metrics
        pd = aeng.engine
        # a long request decodes on worker 1 (the least loaded, lowest rank) when it dies
        result: dict = {}

        def long_request():
            try:
                client.completions.create(model="demo", prompt="Count: 1 2 3", max_tokens=480,
                                          extra_body={"block_length": 32, "steps": 480,
                                                      "decode": "vanilla"})
                result["ok"] = True
            except openai.APIError as e:
                result["error"] = e
        th = threading.Thread(target=long_request)
        th.start()
        victim = pd.workers[1]
        deadline = time.monotonic() + 60
        while not any(t.decode == 1 and t.phase == "decode" for t in list(pd.tracks.values())):
            assert time.monotonic() < deadline, "the long request never reached worker 1"
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        th.join(60)
        assert "error" in result, result             # it failed, with a message, not a hang
        assert "worker 1" in str(result["error"])
        assert not victim.alive
        for _ in range(4):              # every later request lands on the live decode worker
            r = client.completions.create(model="demo", prompt="What is 3+4?", max_tokens=16)
            assert r.choices[0].finish_reason in ("stop", "length")
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'flash_dllm_pd_worker_up{role="decode",worker="1"} 0.0' in metrics
        assert "flash_dllm_pd_worker_deaths_total 1.0" in metrics
        # the survivors hold nothing once idle (their stats arrive a moment after the answer)
        deadline = time.monotonic() + 10
        while True:
            metrics = httpx.get(srv.url + "/metrics").text
            held = [line for line in metrics.splitlines()
                    if line.startswith(("flash_dllm_pd_worker_kv_pages_used{",
                                        "flash_dllm_pd_worker_staging_segments{",
                                        "flash_dllm_pd_worker_sends_in_flight{",
                                        "flash_dllm_pd_worker_receives_pending{"))
                    and 'worker="1"' not in line and not line.endswith(" 0.0")]
            if not held:
                break
            assert time.monotonic() < deadline, held
            time.sleep(0.2)


# ------------------------------------------------------------------ fake transport, in process
class _Pipe:
    """One end of an in-memory control connection."""

    def __init__(self, inbox: deque, outbox: deque) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, msg) -> None:
        self.outbox.append(msg)

    def recv(self):
        return self.inbox.popleft()

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.inbox)


class _Pair:
    """A prefill and a decode worker over one fake network, and the front end's part."""

    def __init__(self, timeout_s: float = 0.3, polls: int = 2, groups: int = 1) -> None:
        from test_sampler import tiny

        model = tiny("llada", seed=3)
        cfg = EngineConfig(max_num_seqs=4, num_kv_pages=64, page_size=4)
        self.net = FakeNetwork(2, polls_to_complete=polls)
        self.to = [deque(), deque()]          # front end -> worker
        self.frm = [deque(), deque()]         # worker -> front end
        self.w = [Worker(Engine(model, model.cfg, cfg), self.net.endpoint(r),
                           _Pipe(self.to[r], self.frm[r]), timeout_s=timeout_s,
                           staging_bytes=1 << 20, layer_groups=groups) for r in range(2)]
        self.groups = groups
        self.failed: dict[str, str] = {}
        self.finished: set[str] = set()

    def tick(self) -> None:
        for r, w in enumerate(self.w):
            w._commands(0)
            w._transfers()
            if w.engine.has_unfinished():
                with torch.inference_mode():
                    w._step()
            while self.frm[r]:
                m = self.frm[r].popleft()
                if isinstance(m, W.Exported):
                    self.to[m.dst].append(W.Import(m.snap, r, m.tag))
                elif isinstance(m, W.Announce):
                    self.to[m.dst].append(W.Expect(m.request_id, r, m.tag, m.canvas_len,
                                                   m.groups))
                elif isinstance(m, W.Failed):
                    self.failed.setdefault(m.request_id, m.message)   # the first wins
                elif isinstance(m, W.Out) and m.finished:
                    self.finished.add(m.request_id)

    def add(self, rid: str, tag: int, max_tokens: int = 16) -> None:
        self.to[0].append(W.Add(rid, [5, 17, 3, 42, 8], SamplingParams(
            max_tokens=max_tokens, block_length=8, decode="vanilla", steps=max_tokens,
                                                                       cache="none"), None,
            1, tag * 16, self.groups))

    def held(self) -> list:
        return [(w.engine.kv_manager.num_used, len(w.alloc.allocated()), len(w.sends),
                 len(w.rx.recvs) + len(w.rx.landed), len(w.rx.queued)) for w in self.w]


@pytest.mark.parametrize("groups", [1, 2])
def test_fake_transport_happy_path_and_no_leaks(groups):
    p = _Pair(groups=groups)
    p.add("a", 1)
    for _ in range(200):
        p.tick()
        if "a" in p.finished:
            break
    assert "a" in p.finished and not p.failed
    p.tick()
    assert p.held() == [(0, 0, 0, 0, 0)] * 2


def test_hung_transfer_times_out_alone():
    p = _Pair(timeout_s=0.2)
    p.net.hang_tag(7 * 16)
    p.add("stuck", 7)
    p.add("fine", 8)
    deadline = time.monotonic() + 10
    while ("stuck" not in p.failed or "fine" not in p.finished) and time.monotonic() < deadline:
        p.tick()
        time.sleep(0.01)
    assert "did not arrive" in p.failed["stuck"] or "timed out" in p.failed["stuck"]
    assert "fine" in p.finished and "fine" not in p.failed
    # the hung receive is cancelled; its staging waits for the fake's settle (cancel = settled)
    for _ in range(5):
        p.tick()
    held = p.held()
    assert held[1][0] == 0 and held[1][1] == 0          # decode side: no pages, no staging


def test_failed_transfer_fails_its_request():
    p = _Pair()
    p.net.fail_tag(9 * 16)
    p.add("bad", 9)
    for _ in range(100):
        p.tick()
        if "bad" in p.failed:
            break
    assert "failed" in p.failed["bad"]
    for _ in range(5):
        p.tick()
    assert p.held()[1][:2] == (0, 0)


@pytest.mark.parametrize("groups", [1, 2])
def test_corrupted_segment_is_never_served(groups):
    """A segment that arrives with a flipped byte fails its request with a named error, leaves
    nothing held on the decode side, and the request next to it is served."""
    p = _Pair(groups=groups)
    p.net.corrupt_tag(5 * 16 + groups - 1)             # (pipelined: the last layer group)
    p.add("bad", 5)
    p.add("good", 6)
    for _ in range(300):
        p.tick()
        if "bad" in p.failed and "good" in p.finished:
            break
    assert "checksum mismatch" in p.failed["bad"] and "not served" in p.failed["bad"]
    assert p.w[1].rx.checksum_failures == 1
    assert "good" in p.finished and "good" not in p.failed
    assert p.w[1].engine.scheduler.find("bad") is None            # never ran on the decode side
    for _ in range(5):
        p.tick()
    assert p.held() == [(0, 0, 0, 0, 0)] * 2


@pytest.mark.parametrize("groups", [1, 2])
def test_abort_in_transit_still_drains_the_segment(groups):
    p = _Pair(polls=50, groups=groups)
    p.add("x", 3)
    while not p.w[1].rx.queued and not p.w[1].rx.recvs:
        p.tick()
    p.to[0].append(W.Abort("x"))
    p.to[1].append(W.Abort("x"))
    for _ in range(200):
        p.tick()
    assert p.held() == [(0, 0, 0, 0, 0)] * 2 and "x" not in p.finished


def test_bench_pd_writes_its_report(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "pd.json"
    r = subprocess.run([sys.executable, "-m", "flash_dllm.cli", "bench", "pd", "--parts",
                        "fragmentation", "roles", "serve", "--requests", "4", "--rate", "20",
                        "--max-tokens", "16", "--block-length", "16", "--num-kv-pages", "256",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["serve"]["colocated"]["errors"] == rep["serve"]["disaggregated"]["errors"] == 0
    assert rep["serve"]["transport"] == "gloo"
    assert rep["roles"]["switching"]["switches"] >= 2
    assert rep["fragmentation"]["requests"] > 0
    assert "disaggregated:" in r.stdout


def test_role_switching_moves_a_worker_and_requests_still_finish():
    """A controller that sees a prefill backlog moves an idle decode worker to prefill; it is
    drained first, then takes first steps; every request still finishes, nothing is left."""
    from flash_dllm.disagg.roles import RoleController
    from flash_dllm.entrypoints.pd_launch import launch

    pd = launch(EngineArgs(), 1, 2, timeout_s=20.0, role_switching=True, max_num_seqs=16,
                num_kv_pages=512)
    try:
        pd.controller = RoleController(queue_high=2, cooldown_s=0.0)
        pd.wait_ready(300)
        p = SamplingParams(max_tokens=16, block_length=8, **EXACT)
        reqs = [pd.add_request(PROMPTS[i % 4], p) for i in range(10)]
        _drain(pd)
        assert all(r.finished and r.error is None for r in reqs)
        snap = pd.pd_snapshot()
        assert snap["role_switches"] >= 1
        roles = [w["role"] for w in snap["workers"]]
        assert roles.count("prefill") >= 1 and roles.count("decode") >= 1
        _idle(pd)
    finally:
        pd.close()
