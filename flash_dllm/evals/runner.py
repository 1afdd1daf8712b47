"""Run a suite through the engine and summarise accuracy against decoding cost."""
from __future__ import annotations

import time
from dataclasses import asdict

from flash_dllm.config import SamplingParams
from flash_dllm.evals.tasks import get_suite


def run_eval(llm, suite_name: str, n: int, params: SamplingParams, seed: int = 0,
             chat: bool = False, progress: bool = True, keep_samples: bool = True,
             history: bool = False) -> dict:
    """Decode ``n`` held-out problems in one continuous batch and score them.

    ``forwards_per_sample`` is the mean number of model forwards a problem took part in;
    ``tokens_per_forward`` is decoded canvas slots (answer and end-of-answer padding) per forward,
    the parallelism the policy achieved; ``answer_tokens_per_second`` counts answer tokens only.
    """
    suite = get_suite(suite_name)
    problems = suite.test_problems(n, seed)
    t0 = time.perf_counter()
    turns = _with_history(llm, problems, params, chat, progress) if history else None
    if chat:
        outs = llm.chat([(turns[i] if turns else []) + [{"role": "user", "content": p.prompt}]
                         for i, p in enumerate(problems)], params, use_tqdm=progress)
    elif turns:
        outs = llm.generate([turns[i] + p.prompt for i, p in enumerate(problems)], params,
                            use_tqdm=progress)
    else:
        outs = llm.generate([p.prompt for p in problems], params, use_tqdm=progress)
    decode_s = time.perf_counter() - t0
    completions = [o.text for o in outs]
    ok = suite.score_batch(problems, completions)
    seconds = time.perf_counter() - t0
    forwards = sum(o.num_forwards for o in outs)
    slots = sum(o.metrics["committed_slots"] for o in outs)
    answer_tokens = sum(len(o.token_ids) for o in outs)
    report = {
        "suite": suite_name, "n": len(problems), "seed": seed, "chat": chat, "history": history,
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
    if keep_samples:
        report["samples"] = [
            {"id": p.id, "prompt": p.prompt, "answer": p.answer, "completion": c, "correct": k,
             "forwards": o.num_forwards}
            for p, c, k, o in zip(problems, completions, ok, outs)]
    return report


def _with_history(llm, problems, params: SamplingParams, chat: bool, progress: bool) -> list:
    """Two-turn evaluation: problem i is asked after problem i+1 (mod n) and the model's own
    answer to it, as a follow-up turn would be; the first turns run first, so with prefix reuse
    the second turns reuse their pages. Returns the history to prepend to each problem: chat
    messages, or text for plain prompts."""
    n = len(problems)
    first = [problems[(i + 1) % n] for i in range(n)]
    if chat:
        outs = llm.chat([[{"role": "user", "content": p.prompt}] for p in first], params,
                        use_tqdm=progress)
        return [[{"role": "user", "content": p.prompt}, {"role": "assistant", "content": o.text}]
                for p, o in zip(first, outs)]
    outs = llm.generate([p.prompt for p in first], params, use_tqdm=progress)
    # NOTE: the first turn's canvas (prompt + answer) is the second prompt's prefix, token for
    # token, so its pages can be reused
    return [p.prompt + o.text + "\n" for p, o in zip(first, outs)]


def summary_line(r: dict) -> str:
    p = r["params"]
    return (f"{r['suite']:6s} cache={p['cache']:6s} decode={p['decode']:9s} n={r['n']:4d} "
            f"acc={100 * r['accuracy']:6.2f}%  fwd/sample={r['forwards_per_sample']:7.2f}  "
            f"tok/fwd={r['tokens_per_forward']:5.2f}  {r['seconds']:7.1f}s  "
            f"{r['answer_tokens_per_second']:8.1f} tok/s")
