"""decode="verify" (Flash-Verify) and the sentinels.

The reference loop below is written from the algorithm's statement on a dense forward with an
explicit attention mask (its own attention math, none of the engine's packing, caches or
vectorised rules): every forward holds the canvas and, for the drafts of the previous forward in
verification order, a draft view D_i (token d_i at p_i) and a mask view M_i (the row predicting p_i
in the canvas with d_1..d_{i-1} filled in). Canvas rows see the canvas only; D_i sees the canvas
without p_1..p_i plus D_1..D_i; M_i sees the canvas without p_1..p_{i-1} plus D_1..D_{i-1}.
"""
from __future__ import annotations

import math

import pytest
import torch
from dense_oracle import DenseStep, Segment, VerifyRows
from test_sampler import EOS, MASK, PROMPTS, run_engine, tiny

from flash_dllm.config import SamplingParams
from flash_dllm.decoding.sentinels import entropy, perturbation_flips, topk_jaccard
from flash_dllm.decoding.verify import (accept_prefix, build_verify_block, draft_probability,
                                        order_candidates, select_after_verify)
from flash_dllm.engine.engine import Engine
from flash_dllm.models.loader import build_model


# ------------------------------------------------------------------------------ accept rule
def _view_logits(rows: list[tuple[int, float]], vocab: int = 8) -> torch.Tensor:
    """One logits row per (argmax token, its probability), the rest of the mass spread evenly."""
    out = torch.empty(len(rows), vocab)
    for r, (tok, p) in enumerate(rows):
        rest = (1 - p) / (vocab - 1)
        probs = torch.full((vocab,), rest)
        probs[tok] = p
        out[r] = probs.log()
    return out


def test_accept_agree_stops_at_first_failure():
    # group 0: pass, pass, disagree, pass -> 2; group 1: low prob first -> 0; group 2: all pass
    view = _view_logits([(1, .9), (2, .95), (3, .99), (4, .9),
                         (5, .5), (6, .99),
                         (1, .85), (2, .81)])
    draft = torch.tensor([1, 2, 0, 4, 5, 6, 1, 2])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    prob = draft_probability(view, draft)
    assert torch.allclose(prob[:2], torch.tensor([.9, .95]))
    acc = accept_prefix(draft, view.argmax(-1), prob, gid, 3, torch.tensor([.8, .8, .8]),
                        torch.zeros(3, dtype=torch.bool))
    assert acc.tolist() == [True, True, False, False, False, False, True, True]
    # a per-request gamma: group 2 at 0.84 stops at its second candidate (0.81)
    acc = accept_prefix(draft, view.argmax(-1), prob, gid, 3, torch.tensor([.8, .8, .84]),
                        torch.zeros(3, dtype=torch.bool))
    assert acc.tolist()[6:] == [True, False]


def test_accept_cumprod():
    # running products: .9, .81, .729 | .99, .495 | .95, .9025, .857...
    view = _view_logits([(1, .9), (2, .9), (3, .9), (1, .99), (2, .5),
                         (1, .95), (2, .95), (3, .95)])
    draft = torch.tensor([1, 2, 3, 1, 2, 1, 2, 3])
    gid = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    prob = draft_probability(view, draft)
    acc = accept_prefix(draft, view.argmax(-1), prob, gid, 3, torch.tensor([.75, .75, .86]),
                        torch.ones(3, dtype=torch.bool))
    assert acc.tolist() == [True, True, False, True, False, True, True, False]
    # mixed rules in one call: group 1 by agree at 0.75 -> its 0.5 candidate fails too
    acc2 = accept_prefix(draft, view.argmax(-1), prob, gid, 3, torch.tensor([.75, .75, .86]),
                         torch.tensor([True, False, True]))
    assert acc2.tolist() == acc.tolist()
    # gamma above 1 accepts nothing, even at probability exactly 1
    one = torch.ones(8)
    assert not accept_prefix(draft, draft, one, gid, 3, torch.full((3,), 1.0001),
                             torch.ones(3, dtype=torch.bool)).any()
    assert accept_prefix(draft, draft, one, gid, 3, torch.ones(3),
                         torch.ones(3, dtype=torch.bool)).all()


def test_select_after_verify_commits_at_least_one():
    conf = torch.tensor([.5, .7, .95, .3, .6, .6, .2])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    tau = torch.full((3,), .9)
    none = torch.zeros(7, dtype=torch.bool)
    avail = torch.ones(7, dtype=torch.bool)
    # plain threshold: group 0 passes .95; group 1 forced best (earliest tie); group 2 its only slot
    keep = select_after_verify(conf, gid, 3, tau, avail, none, torch.zeros(3, dtype=torch.bool))
    assert keep.tolist() == [False, False, True, False, True, False, True]
    # a group that accepted a draft is not forced
    keep = select_after_verify(conf, gid, 3, tau, avail, none, torch.tensor([False, True, False]))
    assert keep.tolist() == [False, False, True, False, False, False, True]
    # a demoted slot is not committed; the forced pick prefers undemoted slots ...
    dem = torch.tensor([False, False, True, False, True, False, False])
    keep = select_after_verify(conf, gid, 3, tau, avail, dem, torch.zeros(3, dtype=torch.bool))
    assert keep.tolist() == [False, True, False, False, False, True, True]
    # ... and falls back to the best demoted one when nothing else is left
    dem = torch.tensor([True, True, True, False, False, False, True])
    keep = select_after_verify(conf, gid, 3, tau, avail, dem, torch.zeros(3, dtype=torch.bool))
    assert keep.tolist() == [False, False, True, False, True, False, True]
    # unavailable (accepted) slots are never re-selected
    avail = torch.tensor([True, True, False, True, True, True, True])
    keep = select_after_verify(conf, gid, 3, tau, avail, none, torch.tensor([True, False, False]))
    assert keep.tolist() == [False, False, False, False, True, False, True]


def test_order_candidates_by_confidence_then_position():
    conf = torch.tensor([.2, .9, .5, .9, .7])
    assert order_candidates(conf, 10).tolist() == [1, 3, 4, 2, 0]
    assert order_candidates(conf, 2).tolist() == [1, 3]


# ------------------------------------------------------------------ intra-query attention mask
def _verify_forward(model, canvas, cand_pos, cand_tok, allow_fn=None):
    """Engine attention path: the canvas (no cache) plus a verification block in one packed
    forward; returns logits of the mask views M_2..M_m."""
    shift = model.cfg.logit_shift
    blk = build_verify_block(canvas, cand_pos, cand_tok, shift)
    allow = blk.allow if allow_fn is None else allow_fn(blk.allow)
    L, m = canvas.shape[0], cand_pos.shape[0]
    seg = Segment(0, L, torch.arange(L), verify=VerifyRows(L, L + blk.num_rows, m - 1, allow))
    h = model.hidden(torch.cat([canvas, blk.ids]), torch.cat([torch.arange(L), blk.positions]),
                     DenseStep([seg]))
    return model.logits(h[L + m - 1:])


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_mask_view_equals_dense_prefix_filled_canvas_one_layer(family):
    """With one layer, K/V depend only on (token, position), so mask view M_i must equal the dense
    forward of the canvas with d_1..d_{i-1} filled in (read at p_i), and not the canvas with d_i
    filled in as well."""
    cfg = ({"architectures": ["LLaDAModelLM"], "d_model": 64, "n_layers": 1, "n_heads": 4,
            "mlp_hidden_size": 128, "vocab_size": 100, "max_sequence_length": 256,
            "mask_token_id": MASK, "eos_token_id": EOS} if family == "llada" else
           {"architectures": ["DreamModel"], "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
            "vocab_size": 100, "max_position_embeddings": 256, "mask_token_id": MASK,
            "eos_token_id": EOS})
    model = build_model(cfg, seed=0)
    model.init_weights(std=0.3, seed=1)
    shift = model.cfg.logit_shift
    canvas = torch.tensor([5, 17, 3, 42, 8] + [MASK] * 8)
    # adjacent drafts in non-canvas order: with Dream's shift M_i's row is an earlier draft's slot
    cand_pos = torch.tensor([7, 6, 10, 8, 5])
    cand_tok = torch.tensor([11, 12, 13, 14, 15])
    with torch.no_grad():
        got = _verify_forward(model, canvas, cand_pos, cand_tok)
        for i in range(1, 5):
            x = canvas.clone()
            x[cand_pos[:i]] = cand_tok[:i]
            ref = model(x[None])[0, cand_pos[i] - shift]
            assert torch.allclose(got[i - 1], ref, atol=1e-4), i
            x[cand_pos[i]] = cand_tok[i]                      # what a leak would see
            assert not torch.allclose(got[i - 1], model(x[None])[0, cand_pos[i] - shift], atol=1e-2)


A_TOK, B_TOK, COUNT_MASK = 1, 2, 31


def _counting_model(scale_b: float):
    """One layer with uniform attention (q = k = 0), V = O = identity and no MLP: a row's logit for
    token t is proportional to how many visible keys hold t (times ``scale_b`` for token B)."""
    cfg = {"architectures": ["LLaDAModelLM"], "d_model": 64, "n_layers": 1, "n_heads": 4,
           "mlp_hidden_size": 64, "vocab_size": 32, "max_sequence_length": 64,
           "mask_token_id": COUNT_MASK, "eos_token_id": 30}
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed.weight[:, :32] = torch.eye(32)
        blk = model.layers[0]
        blk.attn_norm.weight.fill_(1.0)
        blk.mlp_norm.weight.fill_(1.0)
        blk.attn.v_proj.weight.copy_(torch.eye(64))
        blk.attn.o_proj.weight.copy_(torch.eye(64))
        model.norm.weight.fill_(1.0)
        head = torch.zeros(32, 64)
        head[:, :32] = torch.eye(32) * 4.0
        head[B_TOK, B_TOK] *= scale_b
        head[COUNT_MASK, COUNT_MASK] = 0.0                    # MASK's own mass out of the way
        model.lm_head.weight.copy_(head)
    return model



def _leaky(m):
    """The wrong mask: mask view M_i also sees its own draft D_i."""
    def f(allow):
        allow = allow.clone()
        L = allow.shape[1] - (m - 1)
        for r in range(m - 2):                                # M_{r+2} -> D_{r+2}
            allow[m - 1 + r, L + r + 1] = True
        return allow
    return f


@pytest.mark.parametrize("leak", [False, True])
def test_mask_view_cannot_see_its_own_draft(leak, monkeypatch):
    """Prompt: six A, two B; B's logit weighs 2.5x. Drafts (p1, A), (p2, B), (p3, A). Honest M_2
    sees seven A and two B (A wins 7 : 5): B is rejected and p2 stays masked. Seeing its own draft
    it would count three B (7.5 > 7) and accept B: the mask changes the answer."""
    import flash_dllm.decoding.policies.verify as vs
    model = _counting_model(2.5)
    if leak:
        orig = vs.build_verify_block

        def leaky_block(canvas, pos, tok, shift):
            blk = orig(canvas, pos, tok, shift)
            blk.allow = _leaky(pos.shape[0])(blk.allow)
            return blk
        monkeypatch.setattr(vs, "build_verify_block", leaky_block)
    eng = Engine(model, model.cfg)
    prompt = [A_TOK] * 6 + [B_TOK] * 2
    req = eng.add_request(prompt, SamplingParams(max_tokens=4, block_length=4, decode="verify",
                                                 threshold=1.0, gamma=0.01, early_stop=False,
                                                 cache="none"))
    eng.scheduler.admit()
    P = len(prompt)
    st = eng.runner.seq(req, eng.kv_manager.pages(req.request_id))
    st.drafts = (torch.tensor([P, P + 1, P + 2]), torch.tensor([A_TOK, B_TOK, A_TOK]))
    eng.step()
    assert int(req.canvas[P]) == A_TOK                        # M_1 (the canvas row) agrees
    assert int(req.canvas[P + 1]) == (B_TOK if leak else COUNT_MASK)


# ------------------------------------------------------------------------- reference loop
def _dense_masked_logits(model, ids, pos, allow):
    """Dense forward of one sequence in which row r attends to the keys ``allow[r]``."""
    x = model.embed(ids)
    n = ids.shape[0]
    for layer in model.layers:
        a = layer.attn
        h_in = layer.attn_norm(x)
        q = a.q_proj(h_in).view(n, a.num_heads, a.head_dim)
        k = a.k_proj(h_in).view(n, a.num_kv_heads, a.head_dim)
        v = a.v_proj(h_in).view(n, a.num_kv_heads, a.head_dim)
        q, k = a.rotary(q, pos), a.rotary(k, pos)
        rep = a.num_heads // a.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(a.head_dim)
        p = s.masked_fill(~allow, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", p, v).reshape(n, -1)
        h = x + a.o_proj(o)
        x = h + layer.mlp(layer.mlp_norm(h))
    return model.logits(x)


@torch.no_grad()
def reference_verify(model, prompt, gen, block, tau, gamma, rule, max_verify):
    shift = model.cfg.logit_shift
    P, L = len(prompt), len(prompt) + gen
    x = torch.full((L,), MASK, dtype=torch.long)
    x[:P] = torch.tensor(prompt)
    nfe = 0
    for b in range(gen // block):
        lo, hi = P + b * block, P + (b + 1) * block
        drafts: list[tuple[int, int]] = []
        while (x[lo:hi] == MASK).any():
            m = len(drafts)
            ids, pos = [x.clone()], [torch.arange(L)]
            n = L + 2 * m
            allow = torch.zeros(n, L + 2 * m, dtype=torch.bool)
            allow[:L, :L] = True
            for i, (p_i, d_i) in enumerate(drafts):
                filled = x.clone()
                for p_j, d_j in drafts[:i]:
                    filled[p_j] = d_j
                ids += [torch.tensor([d_i]), torch.tensor([int(filled[p_i - shift])])]
                pos += [torch.tensor([p_i]), torch.tensor([p_i - shift])]
                rd, rm = L + 2 * i, L + 2 * i + 1             # rows of D_i and M_i
                allow[rd, :L] = True
                allow[rm, :L] = True
                for j, (p_j, _) in enumerate(drafts):
                    if j <= i:
                        allow[rd, p_j] = False
                        allow[rd, L + 2 * j] = True
                    if j < i:
                        allow[rm, p_j] = False
                        allow[rm, L + 2 * j] = True
            logits = _dense_masked_logits(model, torch.cat(ids), torch.cat(pos), allow)
            nfe += 1
            masked = [p for p in range(lo, hi) if x[p] == MASK]
            accepted, prod = [], 1.0
            for i, (p_i, d_i) in enumerate(drafts):
                row = logits[L + 2 * i + 1].float()
                prob = float(torch.softmax(row, -1)[d_i])
                top = int(row.index_fill(0, torch.tensor([MASK]), -math.inf).argmax())
                prod *= prob
                ok = (top == d_i and prob >= gamma) if rule == "agree" else prod >= gamma
                if not ok:
                    break
                accepted.append((p_i, d_i))
            for p_i, d_i in accepted:
                x[p_i] = d_i
            prop = {}
            for p in masked:
                row = logits[p - shift].float()
                tok = int(row.index_fill(0, torch.tensor([MASK]), -math.inf).argmax())
                prop[p] = (tok, float(torch.softmax(row, -1)[tok]))
            rest = [p for p in masked if x[p] == MASK]
            commit = [p for p in rest if prop[p][1] >= tau]
            if not commit and not accepted:
                commit = [max(rest, key=lambda p: (prop[p][1], -p))]
            for p in commit:
                x[p] = prop[p][0]
            left = [p for p in rest if p not in commit]
            left.sort(key=lambda p: (-prop[p][1], p))
            drafts = [(p, prop[p][0]) for p in left[:max_verify]]
    return x[P:].tolist(), nfe


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("rule,gamma,max_verify", [("agree", 0.3, 8), ("agree", 0.05, 3),
                                                   ("cumprod", 0.2, 8), ("cumprod", 0.02, 4)])
def test_verify_matches_reference(family, rule, gamma, max_verify):
    model = tiny(family)
    params = SamplingParams(max_tokens=16, block_length=8, decode="verify", threshold=0.7,
                            gamma=gamma, verify_rule=rule, max_verify=max_verify, early_stop=False,
                            cache="none")
    reqs, outs = run_engine(model, PROMPTS, params)
    accepted = 0
    for prompt, req, out in zip(PROMPTS, reqs, outs):
        ref, nfe = reference_verify(model, prompt, 16, 8, 0.7, gamma, rule, max_verify)
        assert req.canvas[len(prompt):].tolist() == ref
        assert out.num_forwards == nfe
        accepted += out.metrics["verify_accepted"]
    assert accepted > 0          # the case exercises acceptance


# ------------------------------------------------------------------ threshold equivalence
@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("rule", ["agree", "cumprod"])
def test_gamma_above_one_commits_what_threshold_commits(family, cache, rule):
    """Forward for forward: same canvases after every step, same forward counts."""
    model = tiny(family)
    common = dict(max_tokens=16, block_length=8, threshold=0.6, cache=cache, early_stop=False)
    e1, e2 = Engine(model, model.cfg), Engine(model, model.cfg)
    r1 = [e1.add_request(p, SamplingParams(decode="threshold", **common)) for p in PROMPTS]
    r2 = [e2.add_request(p, SamplingParams(decode="verify", gamma=1.01, verify_rule=rule, **common))
          for p in PROMPTS]
    while e1.has_unfinished():
        e1.step()
        e2.step()
        for a, b in zip(r1, r2):
            assert torch.equal(a.canvas, b.canvas)
    assert not e2.has_unfinished()
    assert [r.num_forwards for r in r1] == [r.num_forwards for r in r2]
    assert e2.stats["verify_candidates"] > 0 and e2.stats["verify_accepted"] == 0


# --------------------------------------------------------------------------- batching
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_verify_batched_equals_solo(cache, family):
    model = tiny(family)
    plist = [SamplingParams(max_tokens=16, block_length=8, decode="verify", cache=cache,
                            threshold=0.7, gamma=0.2, early_stop=False),
             SamplingParams(max_tokens=24, block_length=8, decode="verify", cache=cache,
                            threshold=0.8, gamma=0.1, verify_rule="cumprod", max_verify=4,
                            entropy_max=1.0, perturb_sigma=0.5, kv_jaccard_min=0.6,
                            early_stop=False),
             SamplingParams(max_tokens=16, block_length=8, decode="threshold", cache=cache,
                            threshold=0.7, early_stop=False)]
    batched, bouts = run_engine(model, PROMPTS, plist)
    for prompt, p, b, bo in zip(PROMPTS, plist, batched, bouts):
        solo, souts = run_engine(model, [prompt], p)
        assert torch.equal(solo[0].canvas, b.canvas)
        assert souts[0].num_forwards == bo.num_forwards
        assert souts[0].metrics["sentinel_triggers"] == bo.metrics["sentinel_triggers"]


def test_verify_cuts_forwards_when_confident():
    """A model whose argmax everywhere is EOS at high confidence: threshold at tau=1.0 commits one
    slot per forward (saturated ties aside), verify accepts whole runs of drafts."""
    model = tiny("llada")
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight.abs().max() * 3
    common = dict(max_tokens=16, block_length=8, threshold=1.0, early_stop=False)
    _, th = run_engine(model, PROMPTS, SamplingParams(decode="threshold", **common))
    _, vf = run_engine(model, PROMPTS, SamplingParams(decode="verify", gamma=0.5, **common))
    assert sum(o.num_forwards for o in vf) < sum(o.num_forwards for o in th)
    assert [o.token_ids for o in vf] == [o.token_ids for o in th]


# ---------------------------------------------------------------------------- sentinels
def test_entropy_matches_definition():
    logits = torch.randn(5, 50) * 3
    logits[0, 3] = float("-inf")
    p = logits.softmax(-1)
    ref = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)
    assert torch.allclose(entropy(logits), ref, atol=1e-5)
    assert entropy(torch.zeros(1, 64)).item() == pytest.approx(math.log(64), abs=1e-5)


def test_perturbation_flips():
    logits = torch.tensor([[5.0, 0.0, 0.0], [1.0, 0.99, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert not perturbation_flips(logits, 1e-4, g).any()
    flips = [perturbation_flips(logits, 0.5, torch.Generator().manual_seed(s)) for s in range(20)]
    assert not any(f[0] for f in flips)                      # a wide margin never flips
    assert any(f[1] for f in flips)                          # a near-tie does
    # the forbidden id (MASK) is never the perturbed top-1
    lm = torch.tensor([[0.0, 10.0, 9.0]])
    assert not perturbation_flips(lm, 1e-4, g, forbid=1).any()


def test_topk_jaccard():
    a = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    b = torch.tensor([[4, 3, 2, 1], [1, 2, 9, 8]])
    assert topk_jaccard(a, b).tolist() == [1.0, pytest.approx(2 / 6)]


def test_entropy_sentinel_demotes_and_counts():
    """entropy_max near 0 demotes every threshold-passing slot; with gamma > 1 nothing is ever
    verified either, so each forward commits exactly one slot (the progress rule)."""
    model = tiny("llada")
    params = SamplingParams(max_tokens=16, block_length=8, decode="verify", threshold=0.5,
                            gamma=2.0, entropy_max=1e-6, early_stop=False, cache="none")
    eng = Engine(model, model.cfg)
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.output(r) for r in reqs]
    assert all(o.num_forwards == 16 for o in outs)
    st = eng.stats
    assert st["sentinel_triggers"]["entropy"] == st["sentinel_checks"]["entropy"] > 0
    assert sum(o.metrics["sentinel_triggers"]["entropy"] for o in outs) == \
        st["sentinel_triggers"]["entropy"]


def test_perturbation_sentinel_counts_and_is_seeded():
    model = tiny("dream")
    params = SamplingParams(max_tokens=16, block_length=8, decode="verify", threshold=0.3,
                            gamma=0.5, perturb_sigma=1.0, early_stop=False, cache="none")
    a, oa = run_engine(model, PROMPTS, params)
    b, _ob = run_engine(model, PROMPTS, params)
    assert all(torch.equal(x.canvas, y.canvas) for x, y in zip(a, b))
    trig = sum(o.metrics["sentinel_triggers"]["perturbation"] for o in oa)
    checks = sum(o.metrics["sentinel_checks"]["perturbation"] for o in oa)
    assert 0 < trig <= checks


def test_kv_sentinel_refreshes_the_keys_it_flags(monkeypatch):
    """kv_jaccard_min=1: any change of a slot's top-k triggers; the next forward of that request
    then also recomputes (and rewrites in the cache) the flagged keys outside its query range."""
    model = tiny("llada", seed=3)
    params = SamplingParams(max_tokens=16, block_length=8, decode="threshold", threshold=0.95,
                            cache="dual", kv_jaccard_min=1.0, kv_top_k=4, early_stop=False)
    eng = Engine(model, model.cfg)
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    seen = []
    orig = model.hidden

    def spy(ids, positions, ctx):
        seen.append([(seg.slots.clone(), seg.end - seg.start) for seg in ctx.segments])
        return orig(ids, positions, ctx)
    monkeypatch.setattr(model, "hidden", spy)
    refreshed = 0
    while eng.has_unfinished():
        states = [eng.runner._states.get(r.request_id) for r in eng.running]
        pending = [None if st is None or st.refresh is None else st.refresh.clone()
                   for st in states]
        eng.step()
        for ref, (slots, _) in zip(pending, seen[-1]):
            if ref is not None:
                assert set(ref.tolist()) <= set(slots.tolist())
                refreshed += 1
    assert eng.stats["sentinel_triggers"]["kv_consistency"] > 0 and refreshed > 0
    assert all(not (r.canvas == MASK).any() for r in reqs)


@pytest.mark.parametrize("kw,match", [
    (dict(gamma=0.0), "gamma"),
    (dict(gamma=float("inf")), "gamma"),
    (dict(verify_rule="max"), "verify_rule must be one of"),
    (dict(max_tokens=16, block_length=8, max_verify=9), "max_verify"),
    (dict(max_verify=0), "max_verify"),
    (dict(decode="threshold", entropy_max=1.0), "entropy_max needs decode='verify'"),
    (dict(decode="verify", perturb_sigma=-1.0), "perturb_sigma"),
    (dict(kv_jaccard_min=1.5), "kv_jaccard_min"),
    (dict(kv_top_k=0), "kv_top_k"),
])
def test_invalid_verify_params_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_reference_mask_semantics_cover_unused_rows():
    """Sanity of the engine's row saving: M_1 is the canvas row, D_m is attended by nobody."""
    blk = build_verify_block(torch.tensor([1, 2, MASK, MASK, MASK]), torch.tensor([3, 2, 4]),
                             torch.tensor([7, 8, 9]), 0)
    assert blk.num_rows == 4 and blk.ids.tolist() == [7, 8, MASK, MASK]
    assert blk.positions.tolist() == [3, 2, 2, 4]
    L = 5
    # D_1 and M_2: canvas without p_1=3, plus D_1; D_2 and M_3: without 3 and 2, plus D_1, D_2
    assert blk.allow[0].tolist() == [True, True, True, False, True, True, False]
    assert blk.allow[1].tolist() == [True, True, False, False, True, True, True]
    assert torch.equal(blk.allow[:2], blk.allow[2:])
    assert blk.allow.shape == (4, L + 2)


def test_verify_seeded_sampling_batched_equals_solo():
    """At temperature > 0 the mask views sample with the request's own generator too: a seeded
    request decodes the same alone and in a batch."""
    model = tiny("llada")
    p = SamplingParams(max_tokens=16, block_length=8, decode="verify", temperature=0.7, seed=5,
                       threshold=0.6, gamma=0.2, early_stop=False, cache="none")
    batched, _ = run_engine(model, PROMPTS, p)
    again, _ = run_engine(model, PROMPTS, p)
    for prompt, b, a in zip(PROMPTS, batched, again):
        solo, _ = run_engine(model, [prompt], p)
        assert torch.equal(solo[0].canvas, b.canvas) and torch.equal(a.canvas, b.canvas)


def test_batched_masked_attention_equals_per_request():
    """``masked_attention_batched`` (the fused verify step's) against ``masked_attention`` per
    request, with canvases of different lengths padded to one (the padding keys disallowed)."""
    from flash_dllm.layers.attention import masked_attention, masked_attention_batched
    g = torch.Generator().manual_seed(0)
    B, R, H, Hkv, D, L, M = 3, 6, 4, 2, 8, 20, 3
    q = torch.randn(B, R, H, D, generator=g)
    k1, v1 = torch.randn(B, L, Hkv, D, generator=g), torch.randn(B, L, Hkv, D, generator=g)
    k2, v2 = torch.randn(B, M, Hkv, D, generator=g), torch.randn(B, M, Hkv, D, generator=g)
    allow = torch.rand(B, R, L + M, generator=g) > 0.3
    allow[..., 0] = True
    lens = [12, 20, 7]
    for b, n in enumerate(lens):
        allow[b, :, n:L] = False
    got = masked_attention_batched(q, k1, v1, k2, v2, allow)
    for b, n in enumerate(lens):
        want = masked_attention(q[b], k1[b, :n], v1[b, :n], k2[b], v2[b],
                                torch.cat([allow[b, :, :n], allow[b, :, L:]], 1))
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-6)


def test_accept_prefix_zero_probability_stays_in_its_request():
    """A draft whose view probability underflows to 0 fails its own request's cumprod prefix
    and nothing else: the other requests' running products are not poisoned (an -inf in the
    shared cumsum made them NaN, so no later request accepted anything)."""
    from flash_dllm.decoding.verify import accept_prefix
    d = torch.tensor([1, 2, 3, 4])
    prob = torch.tensor([0.0, 0.9, 0.99, 0.99])
    got = accept_prefix(d, d.clone(), prob, torch.tensor([0, 0, 1, 1]), 2,
                        torch.tensor([0.5, 0.5]), torch.tensor([True, True]))
    assert got.tolist() == [False, False, True, True]
