"""Host time the KV cache manager spends admitting long prompts over a full host tier (issue 13's
oversubscription workload, replayed on the manager alone: no model, no torch).

    python3 benchmarks/kv-tiers/kv_admission_cpu.py \
        --out benchmarks/results/kv-tiers/kv_admission_cpu.json [--baseline OLD_CHECKOUT]

8 users x 4 turns of ~12k-token histories (page size 16: ~757 pages per prompt), a 1,536-page
GPU pool and 5,119 host slots (the H200 run's 12 GiB / 40 GiB of LLaDA-8B pages), one request at
a time: admit (reusing what the tiers still hold), complete its tier ops, finish and publish.
``--baseline`` replays the same in another checkout of the project (e.g. a ``git worktree`` of
fcb6f6c, before the one-pass eviction) for a before / after in one report.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPLAY = r"""
import json, random, time
from flash_dllm.cache.kv_manager import KVCacheManager
try:                                  # (checkouts before the tier stack took l1_slots)
    m = KVCacheManager(1536, 16, prefix_reuse=True, tier_slots=(5119,), page_bytes=8 << 20)
except TypeError:
    m = KVCacheManager(1536, 16, prefix_reuse=True, l1_slots=5119, page_bytes=8 << 20)
rng = random.Random(0)
hist = {u: [rng.randrange(3, 90) for _ in range(12000)] for u in range(8)}
spent = 0.0
for turn in range(4):
    for u in range(8):
        p = hist[u] + [rng.randrange(3, 90) for _ in range(60)]
        rid = f"{u}-{turn}"
        t = time.perf_counter()
        assert m.allocate(rid, len(p) + 32, p, mode="dual") is not None
        m.ops_done([(op, True, 0.001) for op in m.take_ops()])
        m.free(rid, p)
        spent += time.perf_counter() - t
        hist[u] = p + [rng.randrange(3, 90) for _ in range(32)]
print(json.dumps({"requests": 32, "manager_seconds": spent,
                  "hit_tokens": m.stats["hit_tokens"], "query_tokens": m.stats["query_tokens"]}))
"""


def replay(checkout: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    out = subprocess.run([sys.executable, "-c", REPLAY], env=env, check=True,
                         capture_output=True, text=True, cwd=checkout)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout,
                            capture_output=True, text=True).stdout.strip()
    return {"checkout": commit, **json.loads(out.stdout)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--baseline", default=None, help="another checkout to replay too")
    a = p.parse_args()
    rows = [replay(Path(__file__).resolve().parents[2])]
    if a.baseline:
        rows.insert(0, replay(Path(a.baseline).resolve()))
    for r in rows:
        print(f"{r['checkout']}: {r['manager_seconds']:.2f} s in the KV manager for "
              f"{r['requests']} requests, hit tokens {r['hit_tokens']}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
