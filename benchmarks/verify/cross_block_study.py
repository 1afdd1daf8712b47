"""How much room cross-block drafting has (issue 17), measured before building it.

Flash-Verify's folded design verifies a draft in the forward after it is made, so a block never
finishes in fewer forwards than threshold decoding's. Cross-block drafting would make drafts of
block ``b + 1`` during block ``b``'s last forward, to be verified by block ``b + 1``'s first. This
study bounds what that can buy, without verification: threshold decoding (cache ``none``, one
full-canvas forward per step, batch 1) where, after the forward that completes block ``b``, the
same forward's predictions for block ``b + 1`` with confidence >= ``tau_next`` are committed
at once ("lookahead"). A verified version could only keep fewer of those (its verifier rejects
some), so the forwards saved here bound cross-block drafting's saving from above; the accuracy
says how good such drafts are. ``draft_agreement``: the share of the lookahead's early tokens
equal to plain threshold decoding's final token at the same slot, over the slots plain
decoding decoded (``early_tokens_compared``).

    PYTHONPATH=$PWD python3 benchmarks/verify/cross_block_study.py --model proxy-llada \\
        --suites chain code-long --n 50 --out benchmarks/results/verify/cross_block_llada_cpu.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


@torch.no_grad()
def decode(model, prompt: list[int], gen: int, block: int, tau: float, tau_next: float | None,
           mask_id: int, eos: set[int], shift: int) -> dict:
    """One answer: threshold decoding block by block, optionally committing the next block's
    confident predictions from the forward that completes a block. Returns its tokens, forwards,
    forwards per block and the slots committed early."""
    P = len(prompt)
    ids = torch.tensor(prompt + [mask_id] * gen)
    forwards, per_block, early = 0, [], {}
    for b0 in range(P, P + gen, block):
        b1 = min(b0 + block, P + gen)
        n_fwd = 0
        while bool((ids[b0:b1] == mask_id).any()):
            logits = model(ids[None])[0].float()
            forwards += 1
            n_fwd += 1
            logits[:, mask_id] = float("-inf")
            probs = torch.softmax(logits, -1)
            conf, tok = probs.max(-1)                       # row r predicts slot r + shift
            if shift:
                conf = torch.cat([conf.new_zeros(shift), conf[:-shift]])
                tok = torch.cat([tok.new_zeros(shift), tok[:-shift]])
            masked = ids == mask_id
            act = torch.zeros_like(masked)
            act[b0:b1] = True
            c = torch.where(masked & act, conf, torch.full_like(conf, -1.0))
            keep = (c >= tau)
            keep[int(c.argmax())] = True
            ids = torch.where(keep, tok, ids)
            if tau_next is not None and not bool((ids[b0:b1] == mask_id).any()) and b1 < P + gen:
                n0, n1 = b1, min(b1 + block, P + gen)
                nxt = torch.zeros_like(masked)
                nxt[n0:n1] = True
                early_keep = nxt & (ids == mask_id) & (conf >= tau_next)
                for s in early_keep.nonzero().flatten().tolist():
                    early[s] = int(tok[s])
                ids = torch.where(early_keep, tok, ids)
        per_block.append(n_fwd)
        if any(int(t) in eos for t in ids[b0:b1]) and b1 < P + gen:
            # the engine's early stop: the next block is never decoded, so the tokens committed
            # into it early are not early commits of a decoded block (they were counted as
            # such, and as disagreements with the baseline's MASK there, before 596e13b's review)
            early = {s: t for s, t in early.items() if s < b1}
            break
    out = ids[P:].tolist()
    cut = next((i for i, t in enumerate(out) if t in eos or t == mask_id), len(out))
    return {"tokens": out[:cut], "canvas": ids.tolist(), "forwards": forwards,
            "per_block": per_block, "early": early}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="proxy-llada")
    p.add_argument("--suites", nargs="+", default=["chain", "code-long"])
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--tau-next", type=float, nargs="+", default=[0.9, 0.99])
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from flash_dllm.entrypoints.llm import LLM
    from flash_dllm.evals.tasks import SUITES

    llm = LLM(model=a.model)
    model, tok = llm.engine.model, llm.tokenizer
    cfg = model.cfg
    eos = set(cfg.eos_token_ids)
    report = {"model": a.model, "device": "cpu", "tau": a.tau, "block": a.block, "n": a.n,
              "cache": "none", "batch": 1, "suites": {}}
    for name in a.suites:
        suite = SUITES[name]
        problems = suite.test_problems(a.n, 0)
        rows = {}
        base_canvas = []
        for tn in [None] + list(a.tau_next):
            t0 = time.perf_counter()
            res = [decode(model, tok.encode(pr.prompt), suite.gen_length, a.block, a.tau, tn,
                          cfg.mask_token_id, eos, cfg.logit_shift) for pr in problems]
            ok = suite.score_batch(problems, [tok.decode(r["tokens"]) for r in res])
            blocks = [f for r in res for f in r["per_block"]]
            row = {"tau_next": tn, "accuracy": sum(ok) / len(ok),
                   "forwards_per_sample": sum(r["forwards"] for r in res) / len(res),
                   "forwards_per_block": sum(blocks) / len(blocks),
                   "blocks_in_one_forward": sum(f <= 1 for f in blocks) / len(blocks),
                   "seconds": time.perf_counter() - t0}
            if tn is None:
                base_canvas = [r["canvas"] for r in res]
            else:
                early = [(s, t, base_canvas[i]) for i, r in enumerate(res)
                         for s, t in r["early"].items()]
                row["early_tokens_per_block_boundary"] = (
                    len(early) / max(1, sum(len(r["per_block"]) - 1 for r in res)))
                # against the baseline's token at the same slot, where the baseline decoded it
                # (a baseline that stopped earlier left MASK there: nothing to compare)
                both = [(t, bc[s]) for s, t, bc in early if bc[s] != cfg.mask_token_id]
                row["draft_agreement"] = (sum(t == b for t, b in both) / len(both)
                                          if both else None)
                row["early_tokens_compared"] = len(both)
            rows["threshold" if tn is None else f"lookahead_{tn}"] = row
            print(f"{a.model} {name} tau_next {tn}: acc {100 * row['accuracy']:.1f} %, "
                  f"{row['forwards_per_sample']:.1f} forwards/sample, "
                  f"{row['forwards_per_block']:.2f}/block"
                  + (f", early {row['early_tokens_per_block_boundary']:.1f}/boundary, "
                     f"agreement {row['draft_agreement']}" if tn is not None else ""),
                  flush=True)
        base = rows["threshold"]["forwards_per_sample"]
        for r in rows.values():
            r["forwards_vs_threshold"] = r["forwards_per_sample"] / base
        report["suites"][name] = rows
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
