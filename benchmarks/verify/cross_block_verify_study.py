"""Verified cross-block drafting (issue 17), measured before building it into the engine.

``cross_block_study.py`` bounded cross-block drafting from above by committing the next block's
confident predictions without verification. This study verifies them the way Flash-Verify
verifies drafts: the forward that completes block ``b`` drafts block ``b + 1``'s slots whose
confidence is >= ``tau_next`` (most confident first); block ``b + 1``'s first forward checks them
with the prefix mask views (``flash_dllm.decoding.verify``: view ``M_i`` sees drafts
``d_1 .. d_{i-1}`` filled in and ``p_i`` still MASK) and accepts the longest prefix that passes
the ``agree`` rule at ``gamma``; the threshold rule then runs on what is left. With ``inblock``
the still-masked slots of a block are drafted and verified too, as ``decode="verify"`` does.

Each forward is one dense pass (cache ``none``, batch 1) over the canvas plus the verification
rows, written here with an explicit attention mask and no engine code: with ``inblock`` and no
``tau_next`` it equals the engine's ``decode="verify", cache="none"`` token for token and forward
for forward (tests/test_cross_block_verify_study.py); with neither, its threshold decoding.

    PYTHONPATH=$PWD python3 benchmarks/verify/cross_block_verify_study.py --model proxy-llada \\
        --suites chain code-long --n 50 \\
        --out benchmarks/results/verify/cross_block_verify_llada_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class MaskedContext:
    """Dense attention over one packed row set in which row ``r`` sees the keys ``allow[r]``."""

    def __init__(self, allow: torch.Tensor) -> None:
        self.allow = allow                                      # [N, N] bool

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor):
        q, k, v = attn.project(x)                               # [1, N, H(kv), D]
        q, k = attn.rotary(q, positions), attn.rotary(k, positions)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=self.allow[None, None], enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2).flatten(2)


def forward_with_views(model, ids: torch.Tensor, drafts: list[tuple[int, int]], shift: int):
    """Logits of the canvas rows [L, V] and of each draft's mask view [m, V] (``M_1`` is the
    canvas row at ``p_1 - shift``). Rows after the canvas: draft views ``D_1 .. D_{m-1}``, then
    mask views ``M_2 .. M_m``; row pair ``r`` (``D_{r+1}``, ``M_{r+2}``) sees drafts
    ``1 .. r+1`` in place of their MASK keys; the canvas rows see only the canvas."""
    L, m = ids.shape[0], len(drafts)
    k = max(m - 1, 0)
    n = L + 2 * k
    allow = torch.zeros(n, n, dtype=torch.bool)
    allow[:L, :L] = True
    d_ids, d_pos, m_ids, m_pos = [], [], [], []
    filled = ids.clone()                            # the canvas with drafts 1 .. r+1 in
    for r in range(k):
        filled[drafts[r][0]] = drafts[r][1]
        p_v = drafts[r + 1][0]
        d_ids.append(drafts[r][1])
        d_pos.append(drafts[r][0])
        m_ids.append(int(filled[p_v - shift]))       # an earlier draft's slot holds the draft
        m_pos.append(p_v - shift)
        for row in (L + r, L + k + r):
            allow[row, :L] = True
            for j in range(r + 1):
                allow[row, drafts[j][0]] = False     # the draft's MASK key ...
                allow[row, L + j] = True             # ... is replaced by D_j
    all_ids = torch.cat([ids, torch.tensor(d_ids + m_ids, dtype=ids.dtype)])
    all_pos = torch.cat([torch.arange(L), torch.tensor(d_pos + m_pos, dtype=torch.long)])
    h = model.hidden(all_ids[None], all_pos, MaskedContext(allow))[0]
    logits = model.logits(h).float()
    canvas = logits[:L]
    views = ([canvas[drafts[0][0] - shift]] if m else []) + [logits[L + k + r] for r in range(k)]
    return canvas, (torch.stack(views) if views else canvas[:0])


@torch.no_grad()
def decode(model, prompt: list[int], gen: int, block: int, tau: float, gamma: float | None,
           inblock: bool, tau_next: float | None, mask_id: int, eos: set[int], shift: int,
           max_verify: int | None = None, early_stop: bool = True) -> dict:
    """One answer. ``gamma`` None: plain threshold decoding. Returns its tokens, forwards,
    forwards per block and how many drafts were checked / accepted (cross-block ones apart)."""
    P = len(prompt)
    ids = torch.tensor(prompt + [mask_id] * gen)
    max_verify = max_verify or block
    forwards, per_block = 0, []
    stats = {"checked": 0, "accepted": 0, "cross_checked": 0, "cross_accepted": 0,
             # per block boundary: (next block's start, drafted slots, the input of the
             # forward that made them)
             "cross_drafts": []}
    drafts: list[tuple[int, int]] = []
    cross = False                            # the pending drafts are the next block's
    for b0 in range(P, P + gen, block):
        b1 = min(b0 + block, P + gen)
        n_fwd = 0
        while bool((ids[b0:b1] == mask_id).any()):
            seen = ids.clone()                       # this forward's input (for the record)
            canvas, views = forward_with_views(model, ids, drafts, shift)
            forwards += 1
            n_fwd += 1
            accepted = 0
            for (p, d), row in zip(drafts, views):   # the longest passing prefix ("agree")
                prob = float(torch.softmax(row, -1)[d])
                top = int(row.index_fill(0, torch.tensor([mask_id]), float("-inf")).argmax())
                if top != d or prob < gamma:
                    break
                ids[p] = d
                accepted += 1
            if cross:
                assert n_fwd == 1 and all(b0 <= p < b1 for p, _ in drafts)   # where they belong
            stats["cross_checked" if cross else "checked"] += len(drafts)
            stats["cross_accepted" if cross else "accepted"] += accepted
            # the engine's proposal: the best token but MASK, its probability under the whole
            # softmax (MASK's mass included). Row r predicts slot r + shift
            tok = canvas.index_fill(1, torch.tensor([mask_id]), float("-inf")).argmax(-1)
            conf = torch.softmax(canvas, -1).gather(1, tok[:, None]).squeeze(1)
            if shift:
                conf = torch.cat([conf.new_zeros(shift), conf[:-shift]])
                tok = torch.cat([tok.new_zeros(shift), tok[:-shift]])
            masked = ids == mask_id
            act = torch.zeros_like(masked)
            act[b0:b1] = True
            c = torch.where(masked & act, conf, torch.full_like(conf, -1.0))
            keep = c >= tau
            if not accepted and not bool(keep.any()):
                keep[int(c.argmax())] = True                      # ties: the earlier slot
            ids = torch.where(keep, tok, ids)
            drafts, cross = [], False
            left = (ids == mask_id) & act
            if gamma is not None and inblock and bool(left.any()):
                order = sorted(left.nonzero().flatten().tolist(),
                               key=lambda s: (-float(conf[s]), s))
                drafts = [(s, int(tok[s])) for s in order[:max_verify]]
            elif gamma is not None and tau_next is not None and not bool(left.any()) \
                    and b1 < P + gen:
                n1 = min(b1 + block, P + gen)
                nxt = [s for s in range(b1, n1) if conf[s] >= tau_next]
                nxt.sort(key=lambda s: (-float(conf[s]), s))
                drafts, cross = [(s, int(tok[s])) for s in nxt[:max_verify]], True
                stats["cross_drafts"].append((b1, [s for s, _ in drafts], seen.tolist()))
        per_block.append(n_fwd)
        if early_stop and any(int(t) in eos for t in ids[b0:b1]) and b1 < P + gen:
            break                                                # the engine's early stop
    out = ids[P:].tolist()
    cut = next((i for i, t in enumerate(out) if t in eos or t == mask_id), len(out))
    return {"tokens": out[:cut], "canvas": out, "forwards": forwards, "per_block": per_block,
            **stats}


VARIANTS = ("threshold", "verify", "cross_verified", "verify_and_cross")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="proxy-llada")
    p.add_argument("--suites", nargs="+", default=["chain", "code-long"])
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--tau", type=float, default=0.9)
    p.add_argument("--gamma", type=float, default=0.8)
    p.add_argument("--tau-next", type=float, default=0.9)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
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
    every = {"threshold": (None, False, None), "verify": (a.gamma, True, None),
             "cross_verified": (a.gamma, False, a.tau_next),
             "verify_and_cross": (a.gamma, True, a.tau_next)}
    variants = {k: every[k] for k in ["threshold"] + [v for v in a.variants if v != "threshold"]}
    report = {"model": a.model, "device": "cpu", "tau": a.tau, "gamma": a.gamma,
              "tau_next": a.tau_next, "rule": "agree", "view": "prefix", "block": a.block,
              "n": a.n, "cache": "none", "batch": 1, "threads": a.threads,
              "command": " ".join(sys.argv), "suites": {}}
    for name in a.suites:
        suite = SUITES[name]
        problems = suite.test_problems(a.n, 0)
        rows = {}
        for vname, (gamma, inblock, tn) in variants.items():
            t0 = time.perf_counter()
            res = [decode(model, tok.encode(pr.prompt), suite.gen_length, a.block, a.tau, gamma,
                          inblock, tn, cfg.mask_token_id, eos, cfg.logit_shift)
                   for pr in problems]
            ok = suite.score_batch(problems, [tok.decode(r["tokens"]) for r in res])
            blocks = [f for r in res for f in r["per_block"]]
            row = {"accuracy": sum(ok) / len(ok),
                   "forwards_per_sample": sum(r["forwards"] for r in res) / len(res),
                   "forwards_per_block": sum(blocks) / len(blocks),
                   "seconds": time.perf_counter() - t0}
            for k in ("checked", "accepted", "cross_checked", "cross_accepted"):
                row[k] = sum(r[k] for r in res)
            rows[vname] = row
            print(f"{a.model} {name} {vname}: acc {100 * row['accuracy']:.1f} %, "
                  f"{row['forwards_per_sample']:.2f} forwards/sample, accepted "
                  f"{row['accepted']}/{row['checked']} in-block, "
                  f"{row['cross_accepted']}/{row['cross_checked']} cross-block", flush=True)
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
