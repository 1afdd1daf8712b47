"""``flash-dllm bench soak`` at its smallest (issue 42): real ``serve`` subprocesses, a few
seconds of mixed traffic per phase, mid-stream disconnects, a corrupted disk-tier record, failed
engine steps (``serve --test-fault-file``) and SIGTERM then a second signal. The killed decode
worker is left to the full soak (its three worker processes take long to start on a small CPU).
Checks the report's structure and that every invariant holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_short_soak_report_and_invariants(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "flash_dllm", "bench", "soak", "--minutes", "0.3",
                        "--faults", "disconnect", "corrupt", "step", "sigterm", "--replay", "4",
                        "--concurrency", "4", "--workdir", str(tmp_path / "work"),
                        "--json", str(out)],
                       env=env, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert [p["phase"] for p in rep["phases"]] == ["mixed", "multiturn", "disconnect", "corrupt",
                                                   "sigterm", "step_fault"]
    for p in rep["phases"]:
        assert sum(p["outcomes"].values()) == p["requests"] > 0
        assert set(p["latency_ok_s"]) == {"p50", "p99"}
        if p["phase"] != "sigterm":              # the server is gone after it
            assert p["after"]["kv_pages_used"] == 0 and p["after"]["requests_running"] == 0
    assert rep["outcomes"]["connection_error"] == rep["outcomes"]["malformed"] == 0
    assert rep["phases"][2]["outcomes"]["disconnected"] > 0
    assert rep["faults"]["step"]["failed_steps"] >= 1
    assert rep["faults"]["step"]["request_failed"] >= 1
    assert rep["faults"]["sigterm"]["exit_code"] in (0, 130)
    assert rep["replay"]["compared"] > 0 and "differ" in rep["replay"]
    assert rep["rss"]["growth_mb_per_1000_requests"] is not None
    assert rep["invariants"] and rep["all_invariants_hold"], rep["invariants"]
    assert "every_client_answered" in r.stdout        # the table
