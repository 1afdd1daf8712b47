"""Where a batch-1 verify sample's wall time goes: each engine step timed and classed by what ran
(fused replay, fused capture, fused eager, general path), against threshold on the same problems.

    python benchmarks/verify/profile_verify_steps.py --model proxy-dream --suite chain --n 20 \
        --device cuda --out $OUT/verify_step_kinds.json
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="proxy-dream")
    ap.add_argument("--suite", default="chain")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch

    from flash_dllm import LLM
    from flash_dllm.config import SamplingParams
    from flash_dllm.evals.tasks import get_suite
    suite = get_suite(a.suite)
    problems = suite.test_problems(a.n + 4, seed=0)
    llm = LLM(a.model, device=a.device, max_num_seqs=1)
    eng = llm.engine
    sg = eng.runner.fused
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    report = {}
    for name, kw in [("threshold", dict(decode="threshold")),
                     ("verify", dict(decode="verify", gamma=0.8))]:
        params = SamplingParams(max_tokens=suite.gen_length, block_length=32, cache="dual",
                                threshold=0.9, **kw)
        llm.generate([p.prompt for p in problems[a.n:]], params, use_tqdm=False)   # warm-up
        kinds: dict[str, list[float]] = {}
        for p in problems[:a.n]:
            ids = llm.tokenizer.encode(p.prompt)
            eng.add_request(ids, params)
            while eng.has_unfinished():
                before = dict(sg.stats) if sg else {}
                first = any(r.first_step for r in eng.running) if eng.running else True
                sync()
                t = time.perf_counter()
                eng.step()
                sync()
                dt = time.perf_counter() - t
                st = sg.stats if sg else {}
                if st.get("fused_replays", 0) > before.get("fused_replays", 0):
                    k = "fused replay"
                elif st.get("fused_captures", 0) > before.get("fused_captures", 0):
                    k = "fused capture"
                elif st.get("fused_steps", 0) > before.get("fused_steps", 0):
                    k = "fused eager"
                else:
                    k = "general (block's first step)" if first else "general (other)"
                kinds.setdefault(k, []).append(dt)
        total = sum(sum(v) for v in kinds.values())
        report[name] = {k: {"steps": len(v), "ms_per_step": 1e3 * sum(v) / len(v),
                            "ms_per_sample": 1e3 * sum(v) / a.n} for k, v in kinds.items()}
        report[name]["ms_per_sample"] = 1e3 * total / a.n
        print(name, json.dumps(report[name], indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "suite": a.suite, "n": a.n, "device": a.device,
                       "kinds": report}, f, indent=2)


if __name__ == "__main__":
    main()
