"""Run a suite through the engine and summarise accuracy against decoding cost."""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import asdict

from flash_dllm.config import SamplingParams
from flash_dllm.decoding.sentinels import SENTINELS
from flash_dllm.evals.tasks import get_suite


def run_eval(llm, suite_name, n: int | None, params: SamplingParams, seed: int = 0,
             chat: bool = False, progress: bool = True, keep_samples: bool = True,
             repeat: bool = False) -> dict:
    """Decode ``n`` held-out problems in one continuous batch and score them.

    ``forwards_per_sample`` is the mean number of model forwards a problem took part in;
    ``tokens_per_forward`` is decoded canvas slots (answer and end-of-answer padding) per forward,
    the parallelism the policy achieved; ``answer_tokens_per_second`` counts answer tokens only.
    """
    # a registered suite's name, or a ``tasks.Suite`` (``evals.jsonl.make_suite``: n None = all)
    suite = get_suite(suite_name) if isinstance(suite_name, str) else suite_name
    suite_name = suite.name
    problems = suite.test_problems(n, seed)
    # NOTE: repeat: every question is asked twice and the second answers are scored (and
    # timed); with prefix reuse the second run reuses the first's pages: the accuracy cost of
    # the reuse approximation
    if params.cache is None:      # the family's default cache, named in the report
        from flash_dllm.engine.core import resolve_params
        params = resolve_params(params, llm.cfg)
    desc = f"{suite_name} {params.cache}/{params.decode}"
    first = (_decode(llm, problems, params, chat, progress and f"{desc} (first run)")
             if repeat else None)
    t0 = time.perf_counter()
    outs = _decode(llm, problems, params, chat, progress and desc)
    decode_s = time.perf_counter() - t0
    completions = [o.text for o in outs]
    ok = suite.score_batch(problems, completions)
    seconds = time.perf_counter() - t0
    forwards = sum(o.num_forwards for o in outs)
    slots = sum(o.metrics["committed_slots"] for o in outs)
    answer_tokens = sum(len(o.token_ids) for o in outs)
    blocks = [f for o in outs for f in o.metrics.get("block_forwards", ())]
    report = {
        "suite": suite_name, "n": len(problems), "seed": seed, "chat": chat, "repeat": repeat,
        "accuracy": sum(ok) / len(ok) if ok else 0.0,
        "forwards_per_sample": forwards / max(len(outs), 1),
        "tokens_per_forward": slots / max(forwards, 1),
        "answer_tokens_per_forward": answer_tokens / max(forwards, 1),
        # forwards each decoded block took (blocks skipped by early stop are not decoded)
        "forwards_per_block": {
            "mean": sum(blocks) / len(blocks) if blocks else 0.0, "blocks": len(blocks),
            "histogram": {str(k): c for k, c in sorted(Counter(blocks).items())}},
        "seconds": seconds, "decode_seconds": decode_s,
        "answer_tokens_per_second": answer_tokens / decode_s if decode_s > 0 else 0.0,
        "early_stopped": sum(o.early_stopped for o in outs),
        # canvas positions the forwards recomputed (their cache windows), per sample
        "positions_per_sample": sum(o.metrics.get("positions_computed", 0) for o in outs)
        / max(len(outs), 1),
        # decode="verify": drafts checked / accepted; sentinels: slots checked / flagged
        "verify": {k: sum(o.metrics.get(f"verify_{k}", 0) for o in outs)
                   for k in ("candidates", "accepted")},
        "sentinels": {name: {k: sum(o.metrics.get(f"sentinel_{k}", {}).get(name, 0) for o in outs)
                             for k in ("checks", "triggers")}
                      for name in SENTINELS},
        "params": asdict(params),
        "model": str(llm.model_path), "device": str(llm.device),
        "dtype": str(next(llm.engine.model.parameters()).dtype).replace("torch.", ""),
    }
    runner = getattr(getattr(llm, "engine", None), "runner", None)
    info = getattr(runner, "weight_info", None)
    if info is not None and info.get("quantization") is not None:     # --quantization
        report["quantization"] = _quantization(info)
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


def _quantization(info: dict) -> dict:
    """The report's record of the weights' quantization (the runner's ``weight_info``)."""
    out = {k: info.get(k) for k in ("quantization", "group_size", "lm_head", "weight_bytes",
                                    "unquantized_bytes")}
    if "calibration" in info:                          # --quantization-calibration (GPTQ)
        out["calibration"] = info["calibration"]
    return out


def _decode(llm, problems, params: SamplingParams, chat: bool, progress: bool | str) -> list:
    bar = (_SlotProgress(len(problems), params.max_tokens, progress) if progress
           else contextlib.nullcontext())
    with bar:
        on_step = bar.step if progress else None
        if chat:
            return llm.chat([[{"role": "user", "content": p.prompt}] for p in problems], params,
                            on_step=on_step)
        return llm.generate([p.prompt for p in problems], params, on_step=on_step)


class _SlotProgress:
    """A progress bar over the canvas slots of the batch (problems x max_tokens), advanced after
    every denoising step (``step``, the ``on_step`` of ``LLM.generate``) by the slots it
    committed; a request that finishes early (its answer ended) counts its remaining slots as
    done. The whole batch usually decodes together, so requests finish in a burst at the end: a
    bar over finished requests would sit at 0 and its ETA mean nothing. This one moves with the
    work, and shows no ETA either: the steps still to come depend on when answers end."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} slots [{elapsed}{postfix}]"

    def __init__(self, n: int, max_tokens: int, desc) -> None:
        self.n, self.max_tokens = n, max_tokens
        self.desc = desc if isinstance(desc, str) else "decoding"
        self.done: dict[str, int] = {}
        self.steps = self.finished = 0

    def __enter__(self) -> "_SlotProgress":
        from tqdm import tqdm

        self.bar = tqdm(total=self.n * self.max_tokens, desc=self.desc, bar_format=self.FORMAT,
                        dynamic_ncols=True)
        return self

    def step(self, outs) -> None:
        advanced = 0
        for o in outs:
            advanced += o.num_committed
            self.done[o.request_id] = self.done.get(o.request_id, 0) + o.num_committed
            if o.finished:
                advanced += max(self.max_tokens - self.done[o.request_id], 0)
                self.finished += 1
        self.steps += 1
        self.bar.set_postfix_str(f"step {self.steps}, {self.finished}/{self.n} answers",
                                 refresh=False)
        self.bar.update(advanced)

    def __exit__(self, *exc) -> None:
        self.bar.close()


def summary_line(r: dict) -> str:
    p = r["params"]
    return (f"{r['suite']:6s} cache={p['cache']:6s} decode={p['decode']:9s} n={r['n']:4d} "
            f"acc={100 * r['accuracy']:6.2f}%  fwd/sample={r['forwards_per_sample']:7.2f}  "
            f"tok/fwd={r['tokens_per_forward']:5.2f}  "
            f"fwd/block={r.get('forwards_per_block', {}).get('mean', 0.0):5.2f}  "
            f"{r['seconds']:7.1f}s  "
            f"{r['answer_tokens_per_second']:8.1f} tok/s")
