"""Same answer under load (issue 44): how often a temperature-0 request's answer changes with what
else runs, or with what is cached, separated by cause.

- ``batch_probe``, cause (a), batch-dependent numerics: requests added at staggered steps of one
  engine (each joins a batch at a different point) against each request run alone.
- ``reuse_probe``, cause (b), approximate cross-request reuse on a bidirectional model: each
  follow-up turn of a conversation on an engine that reuses the history's cached pages against
  the same prompt recomputed by an engine without prefix reuse.
- ``server_probe``, both together, as a client sees them: ``users`` concurrent multi-turn chats
  through the real app (httpx ASGITransport, host tier on), then every turn replayed alone with
  its exact history: on the same server (what the load left cached), and ``cold`` on a server
  without prefix reuse (nothing cached: every history recomputed).

``python -m flash_dllm.bench.same_answer --out benchmarks/results/serving/same_answer_cpu.json``
runs all three with ``deterministic`` off and on (the demo model unless ``--model``).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time

import torch

from flash_dllm.config import EngineConfig, SamplingParams

# the probe: threshold decoding with the dual cache (the default request's mode)
KNOBS = {"cache": "dual", "decode": "threshold"}


def questions(n: int, turns: int, seed: int = 0) -> list[list[str]]:
    """``n`` conversations of ``turns`` short arithmetic questions (the demo model's kind)."""
    rng = random.Random(seed)
    names = ("Tom", "Amy", "Ivy", "Sam", "Dan", "Omar", "Ann", "Vic")
    out = []
    for i in range(n):
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        conv = [f"{names[i % 8]} has {a} apples and buys {b} more. How many apples now?"]
        for t in range(1, turns):
            conv.append(f"Then {names[(i + t) % 8]} gives {names[i % 8]} {rng.randint(1, 9)} "
                        "more. How many does he have?")
        out.append(conv)
    return out


def _ids(llm, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages))


def batch_probe(llm, n: int = 8, max_tokens: int = 32, seed: int = 0) -> dict:
    """Cause (a): ``n`` requests join one engine at random steps vs. each alone."""
    from flash_dllm.engine.engine import run_to_completion

    eng, rng = llm.engine, random.Random(seed)
    prompts = [_ids(llm, [{"role": "user", "content": c[0]}]) for c in questions(n, 1, seed)]
    p = SamplingParams(max_tokens=max_tokens, **KNOBS)
    reqs = []
    with torch.inference_mode():
        for ids in prompts:
            reqs.append(eng.add_request(ids, p))
            for _ in range(rng.randint(0, 3)):
                if eng.has_unfinished():
                    eng.step()
        run_to_completion(eng, reqs)
    batched = [eng.output(r).token_ids for r in reqs]
    solo = [llm.generate([ids], p)[0].token_ids for ids in prompts]
    return {"requests": n, "differ": sum(a != b for a, b in zip(batched, solo))}


def reuse_probe(llm_reuse, llm_fresh, n: int = 6, turns: int = 2, max_tokens: int = 32,
                seed: int = 0) -> dict:
    """Cause (b): every follow-up turn on ``llm_reuse`` (prefix reuse on: the history's pages
    are cached) vs. the same prompt on ``llm_fresh`` (no reuse: recomputed)."""
    p = SamplingParams(max_tokens=max_tokens, **KNOBS)
    differ = follow_ups = 0
    for conv in questions(n, turns, seed):
        history: list[dict] = []
        for t, q in enumerate(conv):
            history.append({"role": "user", "content": q})
            a = llm_reuse.chat(history, p)[0]
            if t:
                follow_ups += 1
                differ += a.token_ids != llm_fresh.chat(history, p)[0].token_ids
            history.append({"role": "assistant", "content": a.text})
    st = llm_reuse.engine.kv_manager.stats
    return {"follow_up_turns": follow_ups, "differ": differ,
            "hit_tokens": int(sum(st["hit_tokens"])), "query_tokens": int(st["query_tokens"])}


async def _chat(c, messages: list[dict], max_tokens: int) -> str:
    r = await c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                     "temperature": 0, **KNOBS})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def _async_engine(model, config: EngineConfig):
    """(AsyncEngine, Tokenizer) over ``model`` (a folder; None: the demo model) on the CPU, as
    ``serve`` builds them (a failed step fails its batch, not the server); from the layers
    below the entry points, which a benchmark may not import."""
    from flash_dllm.engine.async_engine import AsyncEngine
    from flash_dllm.engine.engine import Engine
    from flash_dllm.models.loader import load_model, model_path
    from flash_dllm.models.tokenizer import Tokenizer

    folder = model_path(model)
    net, cfg = load_model(folder, device="cpu", dtype="float32")
    tok = Tokenizer(folder)
    engine = Engine(net, tok.resolve_ids(cfg), config)
    engine.isolate_step_failures = True
    return AsyncEngine(engine), tok


def server_probe(config: EngineConfig, model=None, users: int = 12, turns: int = 3,
                 max_tokens: int = 32, seed: int = 0, cold: bool = False) -> dict:
    """``users`` concurrent chats of ``turns`` turns through the real app, then every turn
    replayed alone with its exact history; how many answers differ. ``cold``: the replays run
    on a second server without prefix reuse (every history recomputed: the answer with nothing
    cached) instead of the same server (whatever the load left cached)."""
    import httpx

    from flash_dllm.server.app import build_app

    aeng, tok = _async_engine(model, config)
    app = build_app(aeng, tok, "m")
    replay_app = app
    if cold:
        cold_cfg = dataclasses.replace(config, prefix_reuse=False, kv_cpu_gb=0.0)
        replay_app = build_app(_async_engine(model, cold_cfg)[0], tok, "m")
    convs = questions(users, turns, seed)

    def client(a):
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t",
                                 timeout=600)

    async def go():
        async with client(app) as c, client(replay_app) as r:
            async def user(conv):
                history, seen = [], []
                for q in conv:
                    history.append({"role": "user", "content": q})
                    answer = await _chat(c, history, max_tokens)
                    seen.append((list(history), answer))
                    history.append({"role": "assistant", "content": answer})
                return seen
            loaded = [t for u in await asyncio.gather(*(user(v) for v in convs)) for t in u]
            alone = [await _chat(r, h, max_tokens) for h, _ in loaded]
            return loaded, alone
    loaded, alone = asyncio.run(go())
    st = aeng.engine.kv_manager.stats
    return {"users": users, "turns": len(loaded),
            "differ": sum(a != b for (_, a), b in zip(loaded, alone)),
            "hit_tokens": int(sum(st["hit_tokens"])), "query_tokens": int(st["query_tokens"])}


def main(argv=None) -> None:
    from flash_dllm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the demo model)")
    ap.add_argument("--out", default=None, help="write the results here (JSON)")
    ap.add_argument("--n", type=int, default=12, help="requests / conversations per probe")
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip", nargs="*", default=(), choices=("batch", "reuse", "server"))
    a = ap.parse_args(argv)
    out = {"model": a.model or "demo", "device": "cpu", "knobs": KNOBS,
           "max_tokens": a.max_tokens, "torch_threads": torch.get_num_threads(), "modes": {}}
    for det in (False, True):
        t0, res = time.perf_counter(), {}
        if "batch" not in a.skip:
            res["batch"] = batch_probe(LLM(a.model, deterministic=det), a.n, a.max_tokens)
        if "reuse" not in a.skip:
            cfg = EngineConfig(prefix_reuse=True, deterministic=det)
            res["reuse"] = reuse_probe(LLM(a.model, engine_config=cfg), LLM(a.model), a.n,
                                       a.turns, a.max_tokens)
        if "server" not in a.skip:
            cfg = EngineConfig(prefix_reuse=True, kv_cpu_gb=0.01, deterministic=det)
            res["server"] = server_probe(cfg, a.model, a.users, a.turns, a.max_tokens)
            res["server_cold_replay"] = server_probe(cfg, a.model, a.users, a.turns,
                                                     a.max_tokens, cold=True)
        res["seconds"] = round(time.perf_counter() - t0, 1)
        out["modes"]["deterministic" if det else "default"] = res
        print(json.dumps({("deterministic" if det else "default"): res}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
