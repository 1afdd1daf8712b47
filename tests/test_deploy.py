"""The Grafana dashboard and Prometheus alert rules in deploy/ (issue 14): well formed, every
metric they name is exported by a running server, every alert has a case in Prometheus' own rule
tests (run by ``promtool`` where it is installed), and the committed check against a real
Prometheus (``tools/dashboard_check.py``) covers the dashboard as it is now."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import write_tiny_checkpoint
from flash_dllm.bench.serve import parse_metrics
from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.app import build_app

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "flash-dllm.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
CHECK = ROOT / "benchmarks" / "results" / "serving" / "dashboard_check_cpu.json"
PROMTOOL = shutil.which("promtool")
NAME = re.compile(r"\bflash_dllm_[a-zA-Z0-9_]+")


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_dashboard_is_well_formed():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "flash-dllm" and d["schemaVersion"] >= 30
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
    titles = {p["title"] for p in d["panels"]}
    for want in ("Throughput", "Latency percentiles", "Queue and batch", "Pages per tier",
                 "Prefix-cache hit rate", "KAG stability ratio", "L0 eviction rate",
                 "Sentinel trigger rate"):
        assert want in titles
    for e in dashboard_exprs():                           # balanced, and every query filters
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert 'job=~"$job"' in e, e


def test_alert_rules_are_well_formed():
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {"FlashDLLMKAGUnstable", "FlashDLLMHighL0EvictionRate",
            "FlashDLLMKVChecksumFailures"} <= names
    for r in rules:
        assert r["expr"].count("(") == r["expr"].count(")")
        assert r["labels"]["severity"] in ("info", "warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """The metric names a server exports once it has served a request and refused one."""
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("deploy") / "tiny", "llada")
    aeng, tok, _ = load_async_engine(ckpt, config=EngineConfig(
        num_kv_pages=256, prefix_reuse=True, kv_placement="kag"))
    app = build_app(aeng, tok, "tiny")

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            r = await c.post("/v1/completions", json={"prompt": "Ivy has 3 pens. " * 3,
                                                      "max_tokens": 16, "cache": "flash"})
            assert r.status_code == 200
            assert (await c.post("/v1/completions", json={"max_tokens": 1})).status_code == 400
            return (await c.get("/metrics")).text

    return {re.sub(r"\{.*", "", k) for k in parse_metrics(asyncio.run(go()))}


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_named_metric_is_exported(exported, source):
    exprs = dashboard_exprs() if source == "dashboard" else [r["expr"] for r in alert_rules()]
    named = {n for e in exprs for n in NAME.findall(e)}
    assert len(named) >= (20 if source == "dashboard" else 6)
    missing = sorted(named - exported)
    assert not missing, f"{source} names metrics the server does not export: {missing}"


def test_every_alert_has_a_rule_test_that_fires_it_and_one_that_does_not():
    cases = [c for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
             for c in t["alert_rule_test"]]
    for name in {r["alert"] for r in alert_rules()}:
        mine = [c for c in cases if c["alertname"] == name]
        assert any(c["exp_alerts"] for c in mine), f"no case of {ALERT_TESTS.name} fires {name}"
        assert any(not c["exp_alerts"] for c in mine), f"no case keeps {name} quiet"


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get "
                                             "install prometheus)")
@pytest.mark.parametrize("args", [("check", "rules", ALERTS), ("test", "rules", ALERT_TESTS)],
                         ids=["check", "test"])
def test_promtool_accepts_the_rules_and_their_tests_pass(args):
    r = subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_committed_prometheus_check_covers_the_dashboard_as_it_is():
    """``tools/dashboard_check.py`` ran every query of the dashboard through a real Prometheus
    scraping a real server: its report must hold today's panels and queries, each answered
    with data, and every alert rule evaluated without error (edit the dashboard, run it again)."""
    rep = json.loads(CHECK.read_text())
    assert not rep["failures"]
    want = [(p["title"], [t["expr"].replace("$job", "flash-dllm") for t in p["targets"]])
            for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    got = [(p["title"], [q["expr"] for q in p["queries"]]) for p in rep["panels"]]
    assert got == want, "the dashboard changed since tools/dashboard_check.py last ran"
    assert all(p["status"] == "ok" and all(q["ok"] and q["series"] > 0 for q in p["queries"])
               for p in rep["panels"])
    assert {r["name"] for r in rep["rules"]} == {r["alert"] for r in alert_rules()}
    assert all(r["health"] == "ok" for r in rep["rules"])
