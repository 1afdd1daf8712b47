"""A lost disaggregated worker is visible (issue 44, item 2): real worker processes over gloo on
127.0.0.1 behind the real server (uvicorn in a thread), one killed with SIGKILL while the server is
idle.

- it is logged at once: one WARNING line naming the worker, its role and its signal;
- it is reaped (no zombie left until the server exits);
- ``/health`` lists every worker with its role, state and exit code / signal (200, "degraded",
  while each role keeps a live worker; 503 once a role has none);
- ``/ready`` stays 200 while each role has a live worker, and answers 503 naming the role once
  one has none;
- the router sends it nothing more: later requests succeed on the survivor.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import pytest

from flash_dllm.entrypoints.args import EngineArgs

LOGGER = "flash_dllm.disagg"


def _zombie_or_alive(pid: int) -> str | None:
    """The process state letter of ``pid`` ("Z": a zombie), or None once it is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _wait_down(c, rank: int, timeout_s: float = 15.0):
    """(/health response, the worker's entry) once /health says worker ``rank`` is down."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = c.get("/health")
        entry = next((w for w in r.json().get("workers", []) if w.get("worker") == rank), None)
        if entry is not None and entry["state"] == "down":
            return r, entry
        assert time.monotonic() < deadline, f"/health never showed worker {rank} down: {r.json()}"
        time.sleep(0.05)


def test_a_killed_worker_is_logged_reaped_and_reported(caplog):
    httpx = pytest.importorskip("httpx")
    from flash_dllm.bench.serve import InProcessServer
    from flash_dllm.entrypoints.serve import build_server_app

    caplog.set_level(logging.WARNING, logger=LOGGER)
    ns = argparse.Namespace(**{**vars(EngineArgs()), "max_num_seqs": 2, "num_kv_pages": 128,
                               "disaggregate": True, "prefill_workers": 1, "decode_workers": 2,
                               "pd_timeout": 10.0, "pd_staging_gb": 0.05,
                               "pd_role_switching": False, "pd_layer_groups": 1,
                               "pd_transport": "auto", "warmup": "none", "api_key": None,
                               "served_model_name": "demo", "model_shape": None})
    app, aeng, _ = build_server_app(ns)
    with InProcessServer(app, aeng) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        h = c.get("/health")
        assert h.status_code == 200, h.text
        assert h.json()["status"] == "ok"
        assert [(w["worker"], w["role"], w["state"]) for w in h.json()["workers"]] == [
            (0, "prefill", "up"), (1, "decode", "up"), (2, "decode", "up")]
        pd = aeng.engine
        # worker 1 is the one the router would pick first (least loaded, lowest rank)
        victim = pd.workers[1]
        pid = victim.pid
        os.kill(pid, signal.SIGKILL)                     # nothing in flight: the server is idle
        h, entry = _wait_down(c, 1)
        assert h.status_code == 200 and h.json()["status"] == "degraded", h.json()
        assert entry == {"worker": 1, "role": "decode", "state": "down", "exit_code": None,
                         "signal": "SIGKILL", "reason": entry["reason"]}, entry
        assert [w["state"] for w in h.json()["workers"]] == ["up", "down", "up"]
        r = c.get("/ready")
        assert r.status_code == 200, r.text               # one decode worker still lives
        # logged once, at once (before any request came), naming worker, role and signal
        lines = [rec for rec in caplog.records
                 if rec.name == LOGGER and rec.levelno == logging.WARNING]
        assert len(lines) == 1, [rec.getMessage() for rec in lines]
        msg = lines[0].getMessage()
        assert "worker 1" in msg and "decode" in msg and "SIGKILL" in msg, msg
        assert "\n" not in msg
        # reaped: no zombie waits for the server to exit
        deadline = time.monotonic() + 5
        while _zombie_or_alive(pid) is not None:
            assert time.monotonic() < deadline, f"worker 1 (pid {pid}) was not reaped: " \
                                                f"state {_zombie_or_alive(pid)}"
            time.sleep(0.05)
        # the router sends it nothing more: every request lands on worker 2
        for _ in range(3):
            r = c.post("/v1/completions", json={"model": "demo", "prompt": "What is 3+4?",
                                                "max_tokens": 16})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert victim.decoding == 0 and not victim.alive
        m = c.get("/metrics").text
        assert 'flash_dllm_pd_worker_up{role="decode",worker="1"} 0.0' in m
        assert "flash_dllm_pd_worker_deaths_total 1.0" in m

        # the last decode worker: the engine cannot serve; /ready and /health say so
        last = pd.workers[2]
        os.kill(last.pid, signal.SIGKILL)
        h, entry = _wait_down(c, 2)
        assert h.status_code == 503 and h.json()["status"] == "error", h.json()
        assert "decode" in h.json()["error"]
        r = c.get("/ready")
        assert r.status_code == 503 and r.json()["status"] == "error", r.text
        assert "no live decode worker" in r.json()["error"]
        lines = [rec.getMessage() for rec in caplog.records
                 if rec.name == LOGGER and rec.levelno == logging.WARNING]
        assert len(lines) == 2 and "worker 2" in lines[1], lines
