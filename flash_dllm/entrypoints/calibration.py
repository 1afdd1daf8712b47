"""``--quantization-calibration``: the samples GPTQ fits int8 / int4 codes to, and the fit itself
at load (``layers/gptq.py``), before the engine quantizes the model.

A source is a built-in eval suite's *training* split (``evals/tasks``: never a test question),
a ``.jsonl`` file (per line ``{"text": ...}``, or ``{"prompt": ..., "answer": ...}``) or any
other text file (one sample per non-empty line, the first ``n`` taken, repeated if fewer);
sources are separated by ',' or '+'. Each sample is tokenized as the engine encodes
a request (the prompt with the tokenizer's special tokens, the answer continuing it) and a
random share of its answer tokens (of every token after the first, for a plain text) is replaced
by the mask token, as a diffusion model sees its input mid-generation: the share is drawn per
sample, uniform in [0.05, 1] (seeded: the same samples give the same codes).
"""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import torch

from flash_dllm.layers import gptq

SEED = 0
MAX_TOKENS = 2048            # a sample's tokens kept (its first)


def _read(source: str, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs from one source (a plain text's prompt is empty)."""
    from flash_dllm.evals.tasks import SUITES
    if source in SUITES:
        return [(p.prompt, p.answer) for p in SUITES[source].train_problems(n, seed)]
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"quantization_calibration: {source!r} is neither a built-in suite "
                         f"({', '.join(SUITES)}) nor a file")
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    rows = []
    for i, ln in enumerate(lines):
        if path.suffix != ".jsonl":
            rows.append(("", ln))
            continue
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"quantization_calibration: {path}:{i + 1} is not JSON ({e.msg})") \
                from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            rows.append(("", obj["text"]))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) \
                and isinstance(obj.get("answer"), str):
            rows.append((obj["prompt"], obj["answer"]))
        else:
            raise ValueError(f"quantization_calibration: {path}:{i + 1} has neither a string "
                             "'text' nor string 'prompt' and 'answer'")
    if not rows:
        raise ValueError(f"quantization_calibration: {path} holds no sample")
    return [rows[i % len(rows)] for i in range(n)]


def sources(spec: str) -> list[str]:
    """The sources a ``quantization_calibration`` value names: separated by ',' or '+' (lm-eval's
    ``--model_args`` splits on commas: ``quantization_calibration=chain+code-long`` there)."""
    out = [s.strip() for s in re.split(r"[,+]", str(spec)) if s.strip()]
    if not out:
        raise ValueError(f"quantization_calibration names no source: {spec!r}")
    return out


def samples(spec: str, tok, mask_id: int, n: int, seed: int = SEED,
            max_tokens: int = MAX_TOKENS) -> list[torch.Tensor]:
    """``n`` calibration sequences (1-D token ids, partly masked; their first ``max_tokens``)
    from ``spec``'s sources, drawn evenly (the module's docstring)."""
    sources_ = sources(spec)
    rng = random.Random(seed)
    out = []
    for k, source in enumerate(sources_):
        share = n // len(sources_) + (k < n % len(sources_))
        for prompt, answer in _read(source, share, seed):
            if prompt:
                head = tok.encode(prompt)
                tail = list(tok.hf(answer, add_special_tokens=False)["input_ids"])
            else:
                ids = tok.encode(answer)
                head, tail = ids[:1], ids[1:]
            t = rng.uniform(0.05, 1.0)
            tail = [mask_id if rng.random() < t else x for x in tail]
            out.append(torch.tensor((head + tail)[:max_tokens], dtype=torch.long))
    return out


def calibrate_as_configured(model, tok, cfg, config, quiet: bool = False) -> dict | None:
    """GPTQ ``model`` as ``config`` says (``quantization_calibration``, its sample count, the
    mode's bits and group size), in place, before ``quantize_as_configured``; None when no
    calibration is asked for. ``cfg``: the model config with its mask id resolved."""
    spec = config.quantization_calibration
    if spec is None:
        return None
    if any(getattr(m, "ckpt_codes", None) for m in model.modules()):
        raise ValueError("quantization_calibration refits the codes of an unquantized "
                         "checkpoint: this checkpoint is published quantized (its codes are "
                         "used as stored); drop --quantization-calibration")
    from flash_dllm.layers.quant import DEFAULT_GROUP_SIZE, make_method
    group = config.quantization_group_size or DEFAULT_GROUP_SIZE
    method = make_method(config.quantization, group)
    device = next(model.parameters()).device
    for name, width in gptq.target_widths(model):      # a bad group fails before the forwards
        method.check(name, width, device)
    seqs = samples(spec, tok, cfg.mask_token_id, config.quantization_calibration_samples,
                   max_tokens=min(MAX_TOKENS, cfg.max_position))

    def progress(i: int, n: int) -> None:
        if not quiet:
            print(f"\rflash-dllm: GPTQ {config.quantization} ({len(seqs)} samples): layer "
                  f"{i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)

    report = gptq.calibrate(model, seqs, method.bits, group, progress=progress)
    if not quiet:
        experts = (f"; MoE experts: {report['experts_fitted']} fitted, "
                   f"{report['experts_rounded']} rounded to nearest (fewer tokens than inputs)"
                   if report["experts_fitted"] + report["experts_rounded"] else "")
        print(f"flash-dllm: GPTQ fitted {report['layers']} projections on {report['tokens']} "
              f"tokens in {report['seconds']:.1f} s (mean relative layer-output error "
              f"{report['relative_error_gptq']:.3g} against round-to-nearest's "
              f"{report['relative_error_rtn']:.3g}{experts})", file=sys.stderr, flush=True)
    return report
