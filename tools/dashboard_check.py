"""Check deploy/ against the real thing: a running ``flash-dllm serve`` scraped by a real Prometheus
that loads ``deploy/prometheus/alerts.yml``; every query of ``deploy/grafana/flash-dllm.json`` is
run through Prometheus' HTTP API, and the dashboard is drawn from what the queries return.

Grafana itself does not install on the project's machines (it is on none of PyPI, Debian or npm,
and its download site is unreachable from them), so the picture is **not Grafana's**: it is the
dashboard's own layout (``gridPos``), titles, legends and units, drawn with matplotlib from the
series Prometheus answered for each panel's queries (``$job`` set to the scraped job). What it
proves is that every query is valid PromQL that returns data from a real server; what it cannot
prove is how Grafana renders it.

Needs ``prometheus`` on PATH (Debian: ``apt-get install prometheus``; ``--prometheus`` for
another binary) and matplotlib (``pip install -e ".[plot]"``). About three minutes on two cores:

    python tools/dashboard_check.py --json benchmarks/results/serving/dashboard_check_cpu.json \\
        --png benchmarks/results/serving/dashboard_check_cpu.png

The load, all at once against one demo-model server with a small L0, an L1 and a disk tier,
``--kv-placement kag`` and ``--kv-prefetch``: multi-turn chat sessions (prefix reuse,
evictions, tier moves, the access graph; ``cache=flash``, the mode the graph learns from),
requests with the KV sentinel and with verify's entropy sentinel, and a few bad requests (the
4xx panel). Exit status 1 when a query fails, a query has no data, or a rule does not
evaluate.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flash_dllm.bench.serve import free_port  # noqa: E402

DASHBOARD = ROOT / "deploy" / "grafana" / "flash-dllm.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
JOB = "flash-dllm"


def wait_http(url: str, timeout: float, proc: subprocess.Popen) -> None:
    import httpx
    t0 = time.monotonic()
    with httpx.Client(timeout=2) as client:             # one client for every poll
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} "
                                   "answered")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")


def prometheus_config(folder: Path, target: str, interval: str) -> Path:
    cfg = folder / "prometheus.yml"
    cfg.write_text(
        f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
        f"rule_files:\n  - {ALERTS}\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    return cfg


def panel_queries(dashboard: dict) -> list[dict]:
    """Every query panel with its targets, ``$job`` set to the scraped job."""
    out = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        fc = p.get("fieldConfig", {})
        right = {}                              # series name -> unit, on a right-hand axis
        for o in fc.get("overrides", []):
            props = {q["id"]: q["value"] for q in o["properties"]}
            if o["matcher"]["id"] == "byName" and props.get("custom.axisPlacement") == "right":
                right[o["matcher"]["options"]] = props.get("unit", "short")
        out.append({"id": p["id"], "title": p["title"], "type": p["type"],
                    "gridPos": p["gridPos"], "right": right,
                    "unit": fc.get("defaults", {}).get("unit", "short"),
                    "targets": [{"expr": t["expr"].replace("$job", JOB),
                                 "legend": t.get("legendFormat", "")} for t in p["targets"]]})
    return out


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def query_range(prom: str, expr: str, start: float, end: float, step: float) -> dict:
    import httpx
    r = httpx.get(f"{prom}/api/v1/query_range", timeout=30,
                  params={"query": expr, "start": start, "end": end, "step": step})
    body = r.json()
    if body.get("status") != "success":
        return {"ok": False, "error": body.get("error", r.text[:300]), "series": []}
    series = [{"labels": s["metric"],
               "points": [(float(t), float(v)) for t, v in s["values"]]}
              for s in body["data"]["result"]]
    return {"ok": True, "series": series}


# ------------------------------------------------------------------------------------- the load
async def side_load(url: str, seconds: float) -> dict:
    """Requests with sentinels, and bad requests, alongside the chat sessions."""
    import httpx
    counts = {"sentinel_ok": 0, "verify_ok": 0, "flash_ok": 0, "bad_4xx": 0, "other": 0}
    t_end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        i = 0
        while time.monotonic() < t_end:
            q = f"Ivy has {10 + i % 40} pens. Vic has {3 + i % 7} fewer than Ivy. How many pens?"
            r = await c.post("/v1/completions", json={
                "prompt": q, "max_tokens": 32, "decode": "threshold", "cache": "dual",
                "kv_jaccard_min": 0.9})
            counts["sentinel_ok" if r.status_code == 200 else "other"] += 1
            r = await c.post("/v1/completions", json={
                "prompt": q, "max_tokens": 32, "decode": "verify", "cache": "dual",
                "entropy_max": 0.3})
            counts["verify_ok" if r.status_code == 200 else "other"] += 1
            r = await c.post("/v1/completions", json={      # the access graph learns from these
                "prompt": q, "max_tokens": 32, "decode": "threshold", "cache": "flash"})
            counts["flash_ok" if r.status_code == 200 else "other"] += 1
            if i % 3 == 0:                     # a 400 (bad threshold) and a 404 (unknown model)
                for body in ({"prompt": q, "max_tokens": 8, "threshold": 2.0},
                             {"prompt": q, "max_tokens": 8, "model": "no-such-model"}):
                    r = await c.post("/v1/completions", json=body)
                    counts["bad_4xx" if 400 <= r.status_code < 500 else "other"] += 1
            i += 1
    return counts


async def load(url: str, seconds: float, users: int, turns: int) -> dict:
    from flash_dllm.bench.multiturn import MultiturnConfig, run_multiturn
    cfg = MultiturnConfig(users=users, turns=turns, history_tokens=96, max_tokens=32,
                          knobs={"cache": "flash", "decode": "threshold"})
    chat, side = await asyncio.gather(run_multiturn(url, cfg, warmup=False),
                                      side_load(url, seconds))
    return {"chat": {k: chat[k] for k in ("requests", "ok", "errors", "wall_s",
                                          "server_metrics")},
            "side": side}


# ------------------------------------------------------------------------------------- drawing
def fmt_value(v: float, unit: str) -> str:
    if not math.isfinite(v):
        return "-"
    if unit == "percentunit":
        return f"{100 * v:.0f}%"
    if unit == "s":
        return f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if unit == "Bps":
        for p, s in ((1e9, "GB/s"), (1e6, "MB/s"), (1e3, "kB/s")):
            if abs(v) >= p:
                return f"{v / p:.1f} {s}"
        return f"{v:.0f} B/s"
    if unit == "reqps":
        return f"{v:.2f} req/s"
    return f"{v:.3g}"


def draw(panels: list[dict], t0: float, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    bg, panel_bg, fg, grid = "#111217", "#181b1f", "#ccccdc", "#2c3235"
    colors = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9",
              "#fade2a"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42                                           # inches per grid row
    fig = plt.figure(figsize=(24 * 0.75, rows * unit_h + 0.6), facecolor=bg)
    fig.suptitle(title, color=fg, x=0.01, ha="left", fontsize=13)
    H = rows * unit_h + 0.6
    for p in panels:
        g = p["gridPos"]
        left, width = g["x"] / 24 + 0.042 * g["w"] / 8, g["w"] / 24 - 0.075 * g["w"] / 8
        top = 1 - (0.45 + g["y"] * unit_h) / H
        height = (g["h"] * unit_h - 0.75) / H
        ax = fig.add_axes([left, top - height, width, height], facecolor=panel_bg)
        ax.set_title(p["title"], color=fg, fontsize=10, loc="left")
        for s in ax.spines.values():
            s.set_color(grid)
        ax.tick_params(colors=fg, labelsize=7)
        series = [(legend(t["legend"], s["labels"]), s["points"])
                  for t, r in zip(p["targets"], p["results"]) for s in r["series"]]
        if p["type"] == "stat":
            ax.set_xticks([]), ax.set_yticks([])
            for i, (name, pts) in enumerate(series[:4]):
                v = pts[-1][1] if pts else float("nan")
                ax.text(0.5, 0.72 - 0.42 * i, fmt_value(v, p["unit"]), color=colors[i],
                        ha="center", va="center", fontsize=20, transform=ax.transAxes)
                ax.text(0.5, 0.52 - 0.42 * i, name, color=fg, ha="center", fontsize=8,
                        transform=ax.transAxes)
            continue
        ax.grid(color=grid, linewidth=0.6)
        twin = None
        handles = []
        for i, (name, pts) in enumerate(series[:8]):
            on = ax
            if name in p["right"]:
                if twin is None:
                    twin = ax.twinx()
                    twin.tick_params(colors=fg, labelsize=7)
                    twin.yaxis.set_major_formatter(FuncFormatter(
                        lambda v, _, u=p["right"][name]: fmt_value(v, u)))
                on = twin
            xs = [(t - t0) / 60 for t, v in pts if math.isfinite(v)]
            ys = [v for t, v in pts if math.isfinite(v)]
            if xs:
                handles += on.plot(xs, ys, color=colors[i % len(colors)], linewidth=1.3,
                                   label=name + (" (right)" if on is twin else ""))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=p["unit"]: fmt_value(v, u)))
        ax.set_xlabel("minutes", color=fg, fontsize=7, labelpad=1)
        if handles:
            ax.legend(handles=handles, loc="upper left", fontsize=6.5, facecolor=panel_bg,
                      edgecolor=grid, labelcolor=fg, ncol=2 if len(handles) > 3 else 1)
        else:
            ax.text(0.5, 0.5, "No data", color=fg, ha="center", transform=ax.transAxes)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, facecolor=bg)


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="prometheus", help="the prometheus binary")
    ap.add_argument("--seconds", type=float, default=150.0, help="length of the side load")
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--json", type=Path, help="the report")
    ap.add_argument("--png", type=Path, help="the dashboard drawn from the queries' answers")
    args = ap.parse_args(argv)
    binary = shutil.which(args.prometheus)
    if binary is None:
        sys.exit(f"{args.prometheus!r} is not on PATH (Debian: apt-get install prometheus)")

    work = Path(tempfile.mkdtemp(prefix="flash-dllm-dashboard-"))
    port, pport = free_port(), free_port()
    url, prom = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{pport}"
    server_cmd = [sys.executable, "-c", "import sys; from flash_dllm.entrypoints.cli import main; "
                  "sys.exit(main(sys.argv[1:]))", "serve", "--port",
                  str(port), "--num-kv-pages", "64", "--kv-cpu-gb", "0.002",
                  "--kv-disk-path", str(work / "kv.bin"), "--kv-disk-gb", "0.01",
                  "--kv-placement", "kag", "--kv-prefetch", "--max-num-seqs", "4",
                  "--warmup", "minimal"]
    procs, logs = [], [open(work / "server.log", "w"), open(work / "prometheus.log", "w")]
    try:
        server = subprocess.Popen(server_cmd, stdout=logs[0], stderr=subprocess.STDOUT)
        procs.append(server)
        prom_proc = subprocess.Popen(
            [binary, f"--config.file={prometheus_config(work, f'127.0.0.1:{port}', '1s')}",
             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{pport}"],
            stdout=logs[1], stderr=subprocess.STDOUT)
        procs.append(prom_proc)
        wait_http(url + "/ready", 300, server)
        wait_http(prom + "/-/ready", 60, prom_proc)
        t0 = time.time()
        load_report = asyncio.run(load(url, args.seconds, args.users, args.turns))
        time.sleep(5)                                  # the last scrapes and rule evaluations
        t1 = time.time()
        panels = panel_queries(json.loads(DASHBOARD.read_text()))
        step = max(1.0, (t1 - t0) / 200)
        failures = []
        for p in panels:
            p["results"] = [query_range(prom, t["expr"], t0, t1, step) for t in p["targets"]]
            p["status"] = ("query error" if not all(r["ok"] for r in p["results"])
                           else "ok" if all(r["series"] for r in p["results"]) else "no data")
            if p["status"] != "ok":
                failures.append(f"panel {p['title']!r}: {p['status']}")
        import httpx
        rules = httpx.get(prom + "/api/v1/rules", timeout=30).json()["data"]["groups"]
        rule_rows = [{"name": r["name"], "health": r["health"], "state": r.get("state"),
                      "lastError": r.get("lastError", "")}
                     for g in rules for r in g["rules"]]
        failures += [f"rule {r['name']}: {r['health']} {r['lastError']}"
                     for r in rule_rows if r["health"] != "ok"]
        if not rule_rows:
            failures.append("Prometheus loaded no rules from " + str(ALERTS))
        version = subprocess.run([binary, "--version"], capture_output=True,
                                 text=True).stdout.split("\n")[0]
        report = {
            "what": "every query of deploy/grafana/flash-dllm.json through a real Prometheus "
                    "scraping a running flash-dllm server; alert rules' health as Prometheus "
                    "evaluated them",
            "prometheus": version, "server": ["flash-dllm"] + server_cmd[3:],
            "duration_s": round(t1 - t0, 1),
            "load": load_report, "rules": rule_rows, "failures": failures,
            "panels": [{"title": p["title"], "status": p["status"],
                        "series": sum(len(r["series"]) for r in p["results"]),
                        "queries": [{"expr": t["expr"], "ok": r["ok"],
                                     "error": r.get("error"), "series": len(r["series"]),
                                     "last": [legend(t["legend"], s["labels"]) + " = "
                                              + fmt_value(s["points"][-1][1], p["unit"])
                                              for s in r["series"][:6] if s["points"]]}
                                    for t, r in zip(p["targets"], p["results"])]}
                       for p in panels]}
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        if args.png:
            draw(panels, t0, args.png, "flash-dllm (deploy/grafana/flash-dllm.json, drawn from "
                                       f"real Prometheus answers; {version})")
        for p in report["panels"]:
            print(f"{p['status']:>12}  {p['series']:>3} series  {p['title']}")
        print(f"rules: {', '.join(r['name'] + '=' + r['health'] for r in rule_rows)}")
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures))
        return 1 if failures else 0
    except (RuntimeError, TimeoutError) as e:       # a process that did not come up: its log
        for log in ("server.log", "prometheus.log"):
            path = work / log
            if path.exists():
                tail = "".join(path.read_text().splitlines(True)[-15:])
                print(f"--- last lines of {log}:\n{tail}")
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in logs:
            f.close()
        if os.environ.get("KEEP_DASHBOARD_WORK") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("work folder kept:", work)


if __name__ == "__main__":
    sys.exit(main())
