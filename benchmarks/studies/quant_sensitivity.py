"""Study: where weight quantization moves a model's predictions (CPU, no sampling noise).

An accuracy run of 200 problems moves by a point or two from a handful of flipped answers, so it
says little about *why* a mode costs accuracy. This measures the cause directly: the KL divergence
of the quantized model's predictions from the unquantized model's, and how often their argmax
agrees, at masked answer positions (the first ``--answer-tokens`` tokens of each reference answer,
every other one masked at random, seeded), for

- every mode (fp8, int8, int4 at ``--group``), the whole model quantized as ``--quantization`` does;
- int4 on one part at a time (attention, dense MLPs, shared experts, routed experts, or each of
  q / k / v / o), the rest unquantized;
- two other round-to-nearest int4 scales, which the shipped one is compared against: the group's
  largest weight mapped to -8 (all 16 levels used, as llama.cpp's Q4_0) and, per group, the scale
  of least squared weight error over amax / d for d in 6 ... 9 in steps of 1/4, either sign.

Usage (the report of the unquantized run gives the problems)::

    python3 benchmarks/studies/quant_sensitivity.py --model checkpoints/proxy-llada2 --group 4 \\
        --problems benchmarks/results/accuracy/quant_llada2_chain_none_cpu.json \\
        --out benchmarks/results/accuracy/quant_sensitivity_llada2_cpu.json
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import time

import torch

from flash_dllm.kernels import quant_decode, quant_gemm
from flash_dllm.layers import quant
from flash_dllm.layers.moe import MoE
from flash_dllm.models.loader import load_model
from flash_dllm.models.tokenizer import Tokenizer


def masked_inputs(tok: Tokenizer, samples: list[dict], mask_id: int, answer_tokens: int):
    rng = random.Random(0)
    out = []
    for s in samples:
        # the prompt as the engine encodes it; the answer continues it (no BOS of its own)
        prompt = tok.encode(s["prompt"])
        answer = tok.hf(s["answer"], add_special_tokens=False)["input_ids"][:answer_tokens]
        ids = torch.tensor(prompt + answer)
        pos = torch.tensor([len(prompt) + i for i in range(len(answer)) if rng.random() < 0.5],
                           dtype=torch.long)
        ids[pos] = mask_id
        out.append((ids, pos))
    return out


@torch.no_grad()
def log_probs(model, inputs) -> list[torch.Tensor]:
    return [torch.log_softmax(model(ids[None])[0, pos].float(), -1) for ids, pos in inputs]


def compare(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    n = sum(len(r) for r in ref)
    kl = sum((r.exp() * (r - g)).sum().item() for r, g in zip(ref, got)) / n
    agree = sum((r.argmax(-1) == g.argmax(-1)).sum().item() for r, g in zip(ref, got)) / n
    return {"kl": round(kl, 6), "argmax_agreement": round(agree, 5), "positions": n}


def rtn_int4(w: torch.Tensor, group: int, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 codes and scales in quant_decode's layout, by another scale ``rule``."""
    wf = w.float().unflatten(-1, (w.shape[-1] // group, group))
    big = wf.gather(-1, wf.abs().argmax(-1, keepdim=True))
    if rule == "largest_to_-8":
        scale = (big / -8).to(quant_decode.SCALE_DTYPE)
        scale = torch.where(scale == 0, torch.full_like(scale, 1e-7), scale)
    else:                                                           # "least_squares"
        best = scale = None
        for d in [x / 4 for x in range(24, 37)]:
            for sign in (1.0, -1.0):
                s = (sign * (big.abs() / d).clamp_min(1e-7)).to(quant_decode.SCALE_DTYPE)
                err = ((torch.round(wf / s.float()).clamp(-8, 7) * s.float() - wf) ** 2).sum(-1, True)
                if best is None:
                    best, scale = err, s
                else:
                    better = err < best
                    best, scale = torch.where(better, err, best), torch.where(better, s, scale)
    q = (torch.round(wf / scale.float()).clamp(-8, 7).flatten(-2) + 8).to(torch.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous(), scale.squeeze(-1).contiguous()


def quantized(model, mode: str, group: int, only=None, rule: str | None = None):
    """A copy of ``model`` with ``mode``; ``only(name)``: quantize just the layers it accepts
    (a MoE layer's routed experts are named ``<layer>.experts``)."""
    full = copy.deepcopy(model)
    shipped = quant_gemm.quantize
    if rule is not None:
        quant_gemm.quantize = lambda w, bits, g: (rtn_int4(w, g, rule) if bits == 4
                                                  else shipped(w, bits, g))
    try:
        quant.quantize_model(full, mode, group)
    finally:
        quant_gemm.quantize = shipped
    if only is None:
        return full
    part, done = copy.deepcopy(model), dict(full.named_modules())
    for name, module in list(part.named_modules()):
        for child, sub in list(module.named_children()):
            qual = f"{name}.{child}" if name else child
            if only(qual) and qual in done and type(done[qual]) is not type(sub):
                setattr(module, child, done[qual])
        if isinstance(module, MoE) and only(f"{name}.experts"):
            module.quant_experts = done[name].quant_experts
            del module.w_gate_up, module.w_down
    return part


PARTS = {
    "attention": lambda q: ".attn." in q,
    "dense_mlp": lambda q: ".mlp." in q and ".shared." not in q and not q.endswith(".experts"),
    "shared_experts": lambda q: ".shared." in q,
    "routed_experts": lambda q: q.endswith(".experts"),
    **{f"attention_{p}": (lambda q, p=p: ".attn." in q and q.endswith(f"{p}_proj"))
       for p in "qkvo"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--problems", required=True, help="an eval report (its samples' answers)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--group", type=int, default=quant.DEFAULT_GROUP_SIZE)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    model, cfg = load_model(a.model, dtype=torch.float32)
    model.eval()
    samples = json.load(open(a.problems))["samples"][:a.n]
    tok = Tokenizer(a.model)
    inputs = masked_inputs(tok, samples, tok.resolve_ids(cfg).mask_token_id, a.answer_tokens)
    ref = log_probs(model, inputs)
    rows = {}
    for mode in ("fp8", "int8", "int4"):
        rows[mode] = compare(ref, log_probs(quantized(model, mode, a.group), inputs))
    for part, only in PARTS.items():
        rows[f"int4_{part}_only"] = compare(ref, log_probs(quantized(model, "int4", a.group, only),
                                                           inputs))
    for rule in ("largest_to_-8", "least_squares"):
        rows[f"int4_{rule}"] = compare(ref, log_probs(quantized(model, "int4", a.group,
                                                                rule=rule), inputs))
    for k, v in rows.items():
        print(f"{k:28s} KL {v['kl']:.5f}  argmax agreement {v['argmax_agreement']:.4f}")
    report = {"model": a.model, "problems": a.problems, "n": a.n, "group": a.group,
              "answer_tokens": a.answer_tokens, "dtype": "float32", "device": "cpu",
              "seconds": round(time.time() - t0, 1), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
