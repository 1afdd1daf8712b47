"""``flash-dllm bench soak``: a bounded soak with faults against real ``flash-dllm serve``
subprocesses (issue 42). Mixed traffic (completions and chat through the ``openai`` client,
streams over raw SSE, multi-turn chats that resend their history: prefix reuse) runs in phases
while faults are injected; after each phase the server's /metrics says whether anything leaked.

Servers, one after another (the model, device and dtype of each are the soak's):

- **tiers**: host (L1) and disk (L2) KV tiers and prefix reuse on, a small L0 pool so that cached
  pages move down. Phases ``mixed``, ``multiturn``, ``disconnect`` (clients hang up
  mid-stream), ``corrupt`` (bytes flipped in every disk record under the live server, then the
  conversations whose pages went down come back: the checksum must turn them into misses),
  ``sigterm`` (streams in flight, SIGTERM, a new request during the drain, a second SIGTERM).
- **replay**: fresh, prefix reuse off: a sample of the temperature-0 requests above, one at a
  time; the texts that differ are counted (under batching and prefix reuse some may legitimately
  differ, issue 44: reported, not failed).
- **fault**: ``--test-fault-file`` (serve's testing flag): phase ``step_fault``, a failed engine
  step every few seconds under load. No host tiers here: with them a failed step stops the
  engine by design (docs/serving.md, Errors).
- **disagg**: ``--disaggregate``, 1 prefill + 2 decode workers: phase ``worker_kill``, one decode
  worker ``kill -9``'d under load (KV tiers are not supported with --disaggregate).

NOTE (size): ~450 lines, most of them ``Soak``: one method per phase in the order they run,
sharing its servers, clients and counters; the clients (``soak_client``) and the server handles
(``soak_server``) are apart already, and a phase alone reads more easily beside the others.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from flash_dllm.bench import soak_client as C
from flash_dllm.bench.soak_server import Server, corrupt_disk_records

FAULTS = ("disconnect", "corrupt", "step", "worker_kill", "sigterm")
# share of --minutes per timed phase (the sigterm phase and the replay are short and untimed)
SHARES = {"mixed": 0.22, "multiturn": 0.18, "disconnect": 0.12, "corrupt": 0.14,
          "step_fault": 0.14, "worker_kill": 0.20}
MAX_PROMPT_CHARS = 300          # the demo model reads characters, and holds 512 positions


@dataclass
class SoakConfig:
    minutes: float = 15.0
    model: str | None = None
    device: str = "cpu"
    concurrency: int = 8
    max_tokens: int = 32
    faults: tuple[str, ...] = FAULTS
    replay: int = 40
    workdir: Path = Path("soak-work")
    num_kv_pages: int = 128
    kv_cpu_gb: float = 0.002
    kv_disk_gb: float = 0.01
    extra_flags: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, cfg: SoakConfig):
        self.cfg, self.records, self.phases = cfg, [], []
        self.report: dict = {"faults": {}, "servers": {}}
        self.i = 0                              # request counter: distinct prompts
        self.model = "demo"

    # ---------------------------------------------------------------------------- plumbing
    def flags(self, *more: str) -> list[str]:
        f = ["--device", self.cfg.device, "--max-num-seqs", str(self.cfg.concurrency)]
        if self.cfg.model:
            f += ["--model", self.cfg.model]
        return f + list(self.cfg.extra_flags) + list(more)

    def start(self, name: str, *flags: str) -> Server:
        s = Server(name, self.flags(*flags), self.cfg.workdir)
        s.start()
        self.model = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
        self.report["servers"][name] = {"flags": s.flags, "ready_s": s.ready_s}
        return s

    def next_i(self) -> int:
        self.i += 1
        return self.i

    async def load(self, server: Server, phase: str, seconds: float, kinds: list[str],
                   stop: asyncio.Event | None = None) -> list[dict]:
        """``concurrency`` clients, each sending the next kind of ``kinds`` in turn until
        ``seconds`` pass (or ``stop`` is set)."""
        import openai

        deadline = time.monotonic() + seconds
        recs: list[dict] = []
        mt = self.cfg.max_tokens
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="soak",
                                        max_retries=0, timeout=300)

            async def worker(w: int):
                conv, k = None, w
                while time.monotonic() < deadline and not (stop and stop.is_set()):
                    kind, k = kinds[k % len(kinds)], k + 1
                    i = self.next_i()
                    if kind == "completion":
                        r = await C.call_openai(client, phase, kind, C.completion_body(i, mt, self.model))
                    elif kind == "chat":
                        body = C.chat_body([{"role": "user", "content": C.question(i)}], mt, self.model)
                        r = await C.call_openai(client, phase, kind, body)
                    elif kind in ("stream", "disconnect"):
                        body = C.completion_body(i, mt, self.model) if i % 2 else C.chat_body(
                            [{"role": "user", "content": C.question(i)}], mt, self.model)
                        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
                        r = await C.call_stream(http, phase, kind, path, body,
                                                disconnect_after=1 if kind == "disconnect" else None)
                    else:                       # multiturn
                        if conv is None or sum(len(m["content"]) for m in conv.messages) > MAX_PROMPT_CHARS:
                            conv = C.Conversation(i, "You are a careful calculator.")
                        r = await conv.step(client, phase, mt, self.model)
                    recs.append(r)
            await asyncio.gather(*(worker(w) for w in range(self.cfg.concurrency)))
            await client.close()
        self.records += recs
        return recs

    def close_phase(self, server: Server, phase: str, recs: list[dict], seconds: float,
                    **extra) -> dict:
        """The phase's outcomes, error classes, latency and the server's state once idle."""
        m = server.quiesce() if server.proc.poll() is None else {}
        outcomes = Counter(r["outcome"] for r in recs)
        ok_lat = [r["latency_s"] for r in recs if r["outcome"] == "ok"]
        after = {k: m.get(f"flash_dllm_{k}") for k in
                 ("kv_pages_used", "requests_running", "requests_waiting",
                  "kv_checksum_failures_total", "failed_steps_total")}
        for tier in ("l0", "l1", "l2"):
            after[f"kv_pages_cached_{tier}"] = m.get(f'flash_dllm_kv_pages_cached{{tier="{tier}"}}')
        after["l2_hit_tokens"] = m.get('flash_dllm_prefix_cache_hit_tokens_total{tier="l2"}')
        workers = {k: v for k, v in m.items() if k.startswith("flash_dllm_pd_worker_")
                   and any(s in k for s in ("kv_pages_used", "staging", "in_flight", "pending",
                                            "_up{"))}
        if workers:
            after["pd_workers"] = workers
        ph = {"phase": phase, "server": server.name, "seconds": round(seconds, 1),
              "requests": len(recs), "outcomes": {o: outcomes.get(o, 0) for o in C.OUTCOMES},
              "errors": dict(Counter(r["error"] for r in recs if r["error"])),
              "latency_ok_s": {"p50": C.percentile(ok_lat, 0.5), "p99": C.percentile(ok_lat, 0.99)},
              "kinds": dict(Counter(r["kind"] for r in recs)),
              "after": after, "rss_mb": round(server.rss_bytes() / 2**20, 1) if m else None,
              "requests_total_so_far": len(self.records), **extra}
        self.phases.append(ph)
        print(f"soak: {phase}: {len(recs)} requests {dict(outcomes)} in {seconds:.0f} s",
              flush=True)
        return ph

    async def timed(self, server: Server, phase: str, kinds: list[str], **extra) -> dict:
        secs = self.cfg.minutes * 60 * SHARES[phase]
        t0 = time.monotonic()
        recs = await self.load(server, phase, secs, kinds)
        return self.close_phase(server, phase, recs, time.monotonic() - t0, **extra)

    # ---------------------------------------------------------------------------- phases
    async def run_tiers(self) -> None:
        disk = self.cfg.workdir / "kv-disk.bin"
        if disk.exists():
            disk.unlink()
        s = self.start("tiers", "--num-kv-pages", str(self.cfg.num_kv_pages),
                       "--kv-cpu-gb", str(self.cfg.kv_cpu_gb), "--kv-disk-path", str(disk),
                       "--kv-disk-gb", str(self.cfg.kv_disk_gb), "--drain-timeout", "30")
        rss = [(0, s.rss_bytes())]
        try:
            mix = ["completion", "chat", "stream", "multiturn"]
            await self.timed(s, "mixed", mix)
            rss.append((len(self.records), s.rss_bytes()))
            await self.timed(s, "multiturn", ["multiturn", "multiturn", "stream", "completion"])
            if "disconnect" in self.cfg.faults:
                await self.timed(s, "disconnect", ["disconnect", "stream", "completion",
                                                   "multiturn"])
            if "corrupt" in self.cfg.faults:
                await self.corrupt_phase(s, disk)
            rss.append((len(self.records), s.rss_bytes()))
            self.report["rss"] = rss_report(rss)
            if "sigterm" in self.cfg.faults:
                await self.sigterm_phase(s)
        finally:
            code = s.stop()
            self.report["servers"]["tiers"]["exit_code"] = code

    async def corrupt_phase(self, s: Server, disk: Path) -> None:
        """Conversations whose pages the load pushes down to disk; every disk record flipped;
        then those conversations' next turns (their history is looked up in the tiers)."""
        import openai

        t0, secs = time.monotonic(), self.cfg.minutes * 60 * SHARES["corrupt"]
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="soak", max_retries=0,
                                    timeout=300)
        convs = [C.Conversation(self.next_i(), "Answer with the number.") for _ in range(4)]
        recs = list(await asyncio.gather(*(c.step(client, "corrupt", self.cfg.max_tokens, self.model)
                                           for c in convs)))
        self.records += recs
        # a short flood pushes their pages down; a long one (the first full CPU soak: 40 s) also
        # pushes them out of the 53-record disk tier, so that no corrupted record is read again
        recs += await self.load(s, "corrupt", min(secs * 0.4, 5.0),
                                ["completion", "multiturn", "chat"])
        before = s.quiesce()
        n = corrupt_disk_records(disk)
        turns = list(await asyncio.gather(*(c.step(client, "corrupt", self.cfg.max_tokens, self.model)
                                            for c in convs)))
        for r in turns:
            r["after_corruption"] = True
        self.records += turns
        recs += turns
        # right after the flip, before any new record can replace a flipped one: every read of
        # the disk tier by these turns must fail its check (later hits may be fresh records)
        now = s.quiesce()
        key, hits = "kv_checksum_failures_total", 'prefix_cache_hit_tokens_total{tier="l2"}'
        caught_now = (now.get("flash_dllm_" + key) or 0) - (before.get("flash_dllm_" + key) or 0)
        hits_now = (now.get("flash_dllm_" + hits) or 0) - (before.get("flash_dllm_" + hits) or 0)
        rest = await self.load(s, "corrupt", max(1.0, t0 + secs - time.monotonic()),
                               ["multiturn", "completion", "stream"])
        for r in rest:
            r["after_corruption"] = True
        recs += rest
        await client.close()
        ph = self.close_phase(s, "corrupt", recs, time.monotonic() - t0)
        caught = (ph["after"][key] or 0) - (before.get("flash_dllm_" + key) or 0)
        l2_hits = (ph["after"]["l2_hit_tokens"] or 0) - (before.get("flash_dllm_" + hits) or 0)
        self.report["faults"]["corrupt"] = {
            "records_corrupted": n,
            "disk_pages_cached_before": before.get('flash_dllm_kv_pages_cached{tier="l2"}'),
            "checksum_failures_caught": caught,
            # whether the server read the disk tier at all after the flip (a failed check is a
            # miss, so a read shows as a failure or, for a record written since, as a hit)
            "disk_read_after": bool(caught or l2_hits), "l2_hit_tokens_after": l2_hits,
            # the conversations' turns right after the flip (no record rewritten yet)
            "checksum_failures_right_after": caught_now, "l2_hit_tokens_right_after": hits_now,
            "requests_after": sum(1 for r in recs if r.get("after_corruption"))}

    async def sigterm_phase(self, s: Server) -> None:
        """Streams (and a few whole answers) in flight; SIGTERM; a new request during the
        drain; a second SIGTERM: every client must still get an answer."""
        import openai

        t0 = time.monotonic()
        # long answers (every block decoded, one token per step): still streaming at the
        # second signal
        mt, slow = 128, {"decode": "vanilla", "steps": 128, "early_stop": False}
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="soak", max_retries=0,
                                        timeout=120)
            n = 2 * self.cfg.concurrency
            tasks = [asyncio.create_task(C.call_stream(
                http, "sigterm", "stream", "/v1/completions",
                {**C.completion_body(self.next_i(), mt, self.model), **slow})) for _ in range(n)]
            tasks += [asyncio.create_task(C.call_openai(
                client, "sigterm", "completion",
                {**C.completion_body(self.next_i(), mt, self.model), **slow}))
                for _ in range(2)]
            await asyncio.sleep(1.0)
            s.signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            during = await C.call_openai(client, "sigterm", "completion",
                                         C.completion_body(self.next_i(), 8, self.model))
            during["during_drain"] = True
            await asyncio.sleep(0.5)
            s.signal(signal.SIGTERM)
            recs = list(await asyncio.gather(*tasks)) + [during]
            await client.close()
        code = await asyncio.to_thread(s.wait, 60)
        self.records += recs
        ph = self.close_phase(s, "sigterm", recs, time.monotonic() - t0)
        self.report["faults"]["sigterm"] = {
            "exit_code": code, "during_drain": during["outcome"] + " " + str(during["error"]),
            "in_flight": len(recs) - 1, "answered": sum(
                r["outcome"] in ("ok", "error_body", "sse_error_done") for r in recs),
            "outcomes": ph["outcomes"]}

    async def run_replay(self) -> None:
        """A sample of the temperature-0 answers, each alone on a fresh server (no prefix
        reuse); the number whose text differs."""
        pool = [r for r in self.records if r["outcome"] == "ok" and r["text"] is not None
                and r["body"].get("temperature") == 0.0]
        forced = [r for r in pool if r.get("after_corruption")][: self.cfg.replay // 2]
        rest = [r for r in pool if not r.get("after_corruption")]
        random.Random(0).shuffle(rest)
        sample = forced + rest[: max(0, self.cfg.replay - len(forced))]
        if not sample:
            self.report["replay"] = {"compared": 0}
            return
        s = self.start("replay", "--no-prefix-reuse")
        diffs, examples, after = Counter(), [], 0
        try:
            async with httpx.AsyncClient(base_url=s.url, timeout=300) as http:
                for r in sample:
                    body = {k: v for k, v in r["body"].items() if k != "stream"}
                    resp = await http.post(r["path"], json=body)
                    ch = resp.json()["choices"][0]
                    text = ch["text"] if "text" in ch else ch["message"]["content"]
                    if text != r["text"]:
                        diffs[r["kind"]] += 1
                        after += bool(r.get("after_corruption"))
                        if len(examples) < 4:
                            examples.append({"phase": r["phase"], "kind": r["kind"],
                                             "soak": r["text"], "alone": text})
        finally:
            s.stop()
        self.report["replay"] = {
            "compared": len(sample), "differ": sum(diffs.values()),
            "after_corruption_compared": len(forced), "after_corruption_differ": after,
            "differ_by_kind": dict(diffs),
            "examples": examples,
            "note": "under batching and prefix reuse a text may legitimately differ (issue 44)"}

    async def run_step_fault(self) -> None:
        trigger = (self.cfg.workdir / "step.fault").resolve()
        s = self.start("fault", "--test-fault-file", str(trigger))
        stop, fired = asyncio.Event(), []
        secs = self.cfg.minutes * 60 * SHARES["step_fault"]

        async def inject():
            await asyncio.sleep(min(3.0, secs / 4))
            while not stop.is_set():
                trigger.touch()
                fired.append(time.monotonic())
                await asyncio.sleep(max(2.0, secs / 6))
        try:
            t0 = time.monotonic()
            task = asyncio.create_task(inject())
            recs = await self.load(s, "step_fault", secs, ["completion", "stream", "chat",
                                                           "multiturn"])
            stop.set()
            task.cancel()
            if trigger.exists():
                trigger.unlink()
            after = await self.load(s, "step_fault", 0.0 + min(5.0, secs / 4),
                                    ["completion", "stream"])  # still serving afterwards
            ph = self.close_phase(s, "step_fault", recs + after, time.monotonic() - t0)
            health = httpx.get(s.url + "/health").status_code
            self.report["faults"]["step"] = {
                "injected": len(fired), "failed_steps": ph["after"]["failed_steps_total"],
                "request_failed": sum(v for k, v in ph["errors"].items() if "request_failed" in k),
                "ok_after": sum(r["outcome"] == "ok" for r in after), "health_after": health,
                "how": "serve --test-fault-file PATH (subprocess): the runner's execute raises "
                       "once per appearance of PATH"}
        finally:
            s.stop()

    async def run_worker_kill(self) -> None:
        s = self.start("disagg", "--disaggregate", "--prefill-workers", "1",
                       "--decode-workers", "2")
        secs = self.cfg.minutes * 60 * SHARES["worker_kill"]
        try:
            t0 = time.monotonic()
            workers = s.workers()
            victim = workers[-1] if len(workers) == 3 else None
            task = asyncio.create_task(self.load(s, "worker_kill", secs,
                                                 ["completion", "stream", "chat", "multiturn"]))
            await asyncio.sleep(secs / 3)
            killed_at = time.monotonic()
            if victim:
                os.kill(victim, signal.SIGKILL)
            recs = await task
            ph = self.close_phase(s, "worker_kill", recs, time.monotonic() - t0)
            after_kill = [r for r in recs if r.get("t_end", 0) > killed_at]
            health = httpx.get(s.url + "/health").status_code
            m = s.metrics()
            self.report["faults"]["worker_kill"] = {
                "workers_found": len(workers), "killed_pid": victim,
                "worker_deaths": m.get("flash_dllm_pd_worker_deaths_total"),
                "failed_requests": m.get("flash_dllm_pd_failed_requests_total"),
                "ok_after_kill": sum(r["outcome"] == "ok" for r in after_kill),
                "requests_after_kill": len(after_kill), "health_after": health,
                "dead_worker_gauges": {k: v for k, v in ph["after"].get("pd_workers", {}).items()
                                       if dead(ph["after"], k) and v},
                "errors": ph["errors"]}
        finally:
            s.stop()

    async def run(self) -> dict:
        self.cfg.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        await self.run_tiers()
        await self.run_replay()
        if "step" in self.cfg.faults:
            await self.run_step_fault()
        if "worker_kill" in self.cfg.faults:
            await self.run_worker_kill()
        return self.finish(time.monotonic() - t0)

    def finish(self, wall: float) -> dict:
        c = self.cfg
        outcomes = Counter(r["outcome"] for r in self.records)
        leaks = {p["phase"]: p["after"] for p in self.phases if p["phase"] != "sigterm"}
        inv = {
            "every_client_answered": outcomes["connection_error"] == 0 and outcomes["malformed"] == 0,
            "no_kv_pages_leaked": all((a["kv_pages_used"] or 0) == 0 and (a["requests_running"] or 0) == 0
                                      for a in leaks.values()),
            "no_pd_worker_state_leaked": all(
                v == 0 for a in leaks.values() for k, v in (a.get("pd_workers") or {}).items()
                if "_up{" not in k and not dead(a, k)),
        }
        f = self.report["faults"]
        fc = f.get("corrupt") or {}
        if fc.get("records_corrupted") and (fc["checksum_failures_right_after"]
                                            or fc["l2_hit_tokens_right_after"]):
            # right after the flip every disk read must fail its check: a hit there would be a
            # corrupted record served. Not exercised when those turns read nothing from disk
            # (their pages were still in a faster tier, or already out of the disk's); the
            # hits of later traffic can be records written since, so they decide nothing
            inv["corruption_caught_by_checksum"] = (fc["checksum_failures_right_after"] > 0
                                                    and fc["l2_hit_tokens_right_after"] == 0)
        if "step" in f:
            inv["step_fault_isolated"] = (f["step"]["failed_steps"] or 0) >= 1 and \
                f["step"]["ok_after"] > 0 and f["step"]["health_after"] == 200
        if "worker_kill" in f:
            inv["serving_after_worker_kill"] = f["worker_kill"]["ok_after_kill"] > 0
        if "sigterm" in f:
            inv["sigterm_every_client_answered"] = \
                f["sigterm"]["answered"] == f["sigterm"]["in_flight"] + 1
            inv["sigterm_exit_status_0_or_130"] = f["sigterm"]["exit_code"] in (0, 130)
        self.report.update({
            "config": {"minutes": c.minutes, "model": c.model or "demo", "device": c.device,
                       "concurrency": c.concurrency, "max_tokens": c.max_tokens,
                       "faults": list(c.faults), "num_kv_pages": c.num_kv_pages,
                       "kv_cpu_gb": c.kv_cpu_gb, "kv_disk_gb": c.kv_disk_gb},
            "wall_s": round(wall, 1), "requests": len(self.records),
            "outcomes": {o: outcomes.get(o, 0) for o in C.OUTCOMES},
            "errors": dict(Counter(r["error"] for r in self.records if r["error"])),
            "phases": self.phases, "invariants": inv,
            "all_invariants_hold": all(inv.values())})
        return self.report


def dead(after: dict, key: str) -> bool:
    """Whether the pd_worker sample ``key`` is of a worker /metrics says is down (its gauges
    keep its last report: not a leak of a live worker)."""
    labels = key[key.index("{"):]
    return after["pd_workers"].get("flash_dllm_pd_worker_up" + labels) == 0


def rss_report(points: list[tuple[int, int]]) -> dict:
    """Server RSS at start, after the first phase (the baseline: allocator and caches warm) and
    at the end of the load; growth per 1,000 requests from the baseline."""
    (_, start), (n1, base), (n2, end) = points[0], points[1], points[-1]
    per = (end - base) / 2**20 / (n2 - n1) * 1000 if n2 > n1 else None
    return {"start_mb": round(start / 2**20, 1), "baseline_mb": round(base / 2**20, 1),
            "end_mb": round(end / 2**20, 1), "requests_measured": n2 - n1,
            "growth_mb_per_1000_requests": None if per is None else round(per, 2)}


def table(report: dict) -> str:
    cols = ("phase", "reqs", "ok", "err_body", "sse_err", "conn_err", "disc", "p50_s", "p99_s",
            "pages", "l1", "l2")
    rows = [cols]
    for p in report["phases"]:
        o, a = p["outcomes"], p["after"]
        rows.append((p["phase"], p["requests"], o["ok"], o["error_body"], o["sse_error_done"],
                     o["connection_error"] + o["malformed"], o["disconnected"],
                     p["latency_ok_s"]["p50"], p["latency_ok_s"]["p99"], a["kv_pages_used"],
                     a["kv_pages_cached_l1"], a["kv_pages_cached_l2"]))
    fmt = lambda v: "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
    w = [max(len(fmt(r[i])) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(fmt(v).rjust(w[i]) for i, v in enumerate(r)) for r in rows]
    rss = report.get("rss") or {}
    rep = report.get("replay") or {}
    lines.append(f"RSS growth: {rss.get('growth_mb_per_1000_requests')} MB / 1,000 requests "
                 f"({rss.get('baseline_mb')} -> {rss.get('end_mb')} MB); replay: "
                 f"{rep.get('differ')} of {rep.get('compared')} temperature-0 texts differ")
    lines += [f"{'ok  ' if v else 'FAIL'} {k}" for k, v in report["invariants"].items()]
    return "\n".join(lines)


def run_soak(cfg: SoakConfig) -> dict:
    return asyncio.run(Soak(cfg).run())
