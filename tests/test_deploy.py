"""The Grafana dashboard and Prometheus alert rules in deploy/ (issue 14): well formed, and every
metric they name is exported by a running server."""
from __future__ import annotations

import asyncio
import json
import re
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
