"""Run a suite through the engine and summarise accuracy against decoding cost."""
from __future__ import annotations

import time
from dataclasses import asdict

from flash_dllm.config import SamplingParams
from flash_dllm.evals.tasks import get_suite


def run_eval(llm, suite_name: str, n: int, params: SamplingParams, seed: int = 0,
             chat: bool = False, progress: bool = True, keep_samples: bool = True,
             repeat: bool = False) -> dict:
    """Decode ``n`` held-out problems in one continuous batch and score them.

    ``forwards_per_sample`` is the mean number of model forwards a problem took part in;
    ``tokens_per_forward`` is decoded canvas slots (answer and end-of-answer padding) per forward,
    the parallelism the policy achieved; ``answer_tokens_per_second`` counts answer tokens only.
    """
    suite = get_suite(suite_name)
    problems = suite.test_problems(n, seed)
    # NOTE: repeat: every question is asked twice and the second answers are scored (and
    # timed); with prefix reuse the second run reuses the first's pages: the accuracy cost of
    # the reuse approximation
    first = _decode(llm, problems, params, chat, progress) if repeat else None
    t0 = time.perf_counter()
    outs = _decode(llm, problems, params, chat, progress)
    decode_s = time.perf_counter() - t0
    completions = [o.text for o in outs]
    ok = suite.score_batch(problems, completions)
    seconds = time.perf_counter() - t0
    forwards = sum(o.num_forwards for o in outs)
    slots = sum(o.metrics["committed_slots"] for o in outs)
    answer_tokens = sum(len(o.token_ids) for o in outs)
    report = {
        "suite": suite_name, "n": len(problems), "seed": seed, "chat": chat, "repeat": repeat,
        "accuracy": sum(ok) / len(ok) if ok else 0.0,
        "forwards_per_sample": forwards / max(len(outs), 1),
        "tokens_per_forward": slots / max(forwards, 1),
        "answer_tokens_per_forward": answer_tokens / max(forwards, 1),
        "seconds": seconds, "decode_seconds": decode_s,
        "answer_tokens_per_second": answer_tokens / decode_s if decode_s > 0 else 0.0,
        "early_stopped": sum(o.early_stopped for o in outs),
        # decode="verify": drafts checked / accepted; sentinels: slots checked / flagged
        "verify": {k: sum(o.metrics.get(f"verify_{k}", 0) for o in outs)
                   for k in ("candidates", "accepted")},
        "sentinels": {name: {k: sum(o.metrics.get(f"sentinel_{k}", {}).get(name, 0) for o in outs)
                             for k in ("checks", "triggers")}
                      for name in ("entropy", "perturbation", "kv_consistency")},
        "params": asdict(params),
        "model": str(llm.model_path), "device": str(llm.device),
        "dtype": str(next(llm.engine.model.parameters()).dtype).replace("torch.", ""),
    }
    kv = getattr(getattr(llm, "engine", None), "kv_manager", None)
    if kv is not None and getattr(kv, "prefix_reuse", False):
        st = kv.stats
        report["prefix_cache"] = {"query_tokens": st["query_tokens"],
                                  "hit_tokens": dict(zip(("l0", "l1", "l2"), st["hit_tokens"])),
                                  "checksum_failures": st["checksum_failures"]}
    if first is not None:
        report["first_run_accuracy"] = (sum(suite.score_batch(problems, [o.text for o in first]))
                                        / max(len(first), 1))
    if keep_samples:
        report["samples"] = [
            {"id": p.id, "prompt": p.prompt, "answer": p.answer, "completion": c, "correct": k,
             "forwards": o.num_forwards}
            for p, c, k, o in zip(problems, completions, ok, outs)]
    return report


def _decode(llm, problems, params: SamplingParams, chat: bool, progress: bool) -> list:
    if chat:
        return llm.chat([[{"role": "user", "content": p.prompt}] for p in problems], params,
                        use_tqdm=progress)
    return llm.generate([p.prompt for p in problems], params, use_tqdm=progress)


def summary_line(r: dict) -> str:
    p = r["params"]
    return (f"{r['suite']:6s} cache={p['cache']:6s} decode={p['decode']:9s} n={r['n']:4d} "
            f"acc={100 * r['accuracy']:6.2f}%  fwd/sample={r['forwards_per_sample']:7.2f}  "
            f"tok/fwd={r['tokens_per_forward']:5.2f}  {r['seconds']:7.1f}s  "
            f"{r['answer_tokens_per_second']:8.1f} tok/s")
