"""The lm-evaluation-harness adapter (``flash_dllm.integrations.lm_eval``) on the demo model.

Offline: the tasks are local YAMLs over local data (``tests/data/lm_eval/``), run through lm-eval's
own Python API (``simple_evaluate`` + ``TaskManager(include_path=...)``)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from flash_dllm.integrations.lm_eval import FlashDLLM
except ImportError as e:           # lm-eval is in the 'dev' extra
    pytest.skip(f"lm-eval cannot be imported: {e}", allow_module_level=True)

DATA = Path(__file__).parent / "data" / "lm_eval"
Q = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?\n"
A = "23-12=11. 23+11=34. #### 34"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The demo model's ops are too small for intra-op threads: on a shared 2-core machine two
    OpenMP threads made this file 3x slower than one. Restored for the tests after this file."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm(one_thread):
    return FlashDLLM(decode="threshold", cache="dual", gen_length=64, mc_num=8)


def gen(context, **gen_kwargs):
    return Instance("generate_until", {}, (context, gen_kwargs), 0)


def ll(context, continuation):
    return Instance("loglikelihood", {}, (context, continuation), 0)


# ----------------------------------------------------------------------------------- model_args
def test_registered_under_flash_dllm():
    assert get_model("flash-dllm") is FlashDLLM


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")   # runpy, in-process
def test_module_main_registers_then_runs_lm_eval_cli(monkeypatch):
    """``python -m flash_dllm.integrations.lm_eval ARGS``: the file runs as ``__main__`` (which
    must not register a second class under the same name), imports itself, hands ARGS to
    lm-eval's command line."""
    import runpy
    import sys

    import lm_eval.__main__

    seen = {}
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate",
                        lambda: seen.update(argv=sys.argv[1:], cls=get_model("flash-dllm")))
    monkeypatch.setattr(sys, "argv", ["lm_eval.py", "--model", "flash-dllm", "--tasks", "gsm8k"])
    runpy.run_module("flash_dllm.integrations.lm_eval", run_name="__main__")
    assert seen == {"argv": ["--model", "flash-dllm", "--tasks", "gsm8k"], "cls": FlashDLLM}


@pytest.mark.parametrize("args, match", [
    ("cache=dual,bogus_knob=1", "bogus_knob"),
    ("decode=nope", "decode must be one of"),
    ("threshold=1.5", "threshold must be in"),
    ("gen_length=64,max_tokens=64", "not both"),
    ("mc_num=0", "mc_num"),
    ("steps=7", "steps"),
])
def test_bad_model_args_are_errors_naming_the_key(args, match):
    # raised before any model is loaded
    with pytest.raises(ValueError, match=match):
        FlashDLLM.create_from_arg_string(args)


# ----------------------------------------------------------------------------------- generation
def test_generate_until_cuts_at_until(lm):
    full, cut, none = lm.generate_until([gen(Q), gen(Q, until=["####"]), gen(Q, until="zzz")],
                                        disable_tqdm=True)
    assert full == A                           # the demo model's answer
    assert cut == A[:A.index("####")]
    assert none == A


def test_max_gen_toks_rounds_canvas_up_to_blocks_and_cuts(lm):
    lm32 = FlashDLLM(llm=lm.llm, decode="threshold", cache="dual", block_length=32, steps=64,
                     gen_length=64)
    until, n, p = lm32._params_for({"max_gen_toks": 10, "until": ["\n\n"]}, 0)
    assert (n, p.max_tokens, p.block_length, p.steps) == (10, 32, 32, 32)   # 2 steps per block kept
    assert lm32._params_for({"max_gen_toks": 500}, 0)[2].max_tokens == 64   # gen_length caps it
    assert lm32._params_for({}, 0)[2].max_tokens == 64
    p = lm32._params_for({"do_sample": True, "temperature": 0.5, "seed": 3}, 4)[2]
    assert (p.temperature, p.seed) == (0.5, 7)                              # repeats differ
    assert lm32._params_for({"do_sample": False, "temperature": 0.5}, 0)[2].temperature == 0.0
    (text,) = lm32.generate_until([gen(Q, max_gen_toks=10)], disable_tqdm=True)
    assert text == A[:10]                      # char-level tokenizer: 10 tokens = 10 characters


# ----------------------------------------------------------------------------------- likelihood
def _masked_log_probs(model, ids, slots, mask_id):
    """log p(ids[s]) for s in slots, those slots MASK: one dense forward, Dream's shift applied."""
    x = torch.tensor([ids])
    x[0, slots] = mask_id
    with torch.no_grad():
        logits = model(x)[0].float()
    shift = model.cfg.logit_shift
    return [F.log_softmax(logits[s - shift], -1)[ids[s]].item() for s in slots]


def test_loglikelihood_short_continuations_are_exact(lm):
    """Continuations short enough to enumerate every masking (2^T - 1 <= mc_num) get LLaDA's bound
    exactly: T=1 is the masked token's log-probability; T=2 averages over m in {1, 2}."""
    tok, model, mask = lm.tokenizer, lm.model, lm.cfg.mask_token_id
    c1, c2 = Q + "23-12=11. 23+11=34. #### 3", Q + "23-12=11. 23+11=3"
    (lp1, greedy1), (lp_wrong, greedy_wrong), (lp2, _) = lm.loglikelihood(
        [ll(c1, "4"), ll(c1, "7"), ll(c2, "4.")], disable_tqdm=True)
    ids1 = tok.encode(c1 + "4")
    (ref1,) = _masked_log_probs(model, ids1, [len(ids1) - 1], mask)
    assert lp1 == pytest.approx(ref1, abs=1e-4)
    assert greedy1 and not greedy_wrong and lp_wrong < lp1
    ids2 = tok.encode(c2 + "4.")
    P = len(ids2) - 2
    a, = _masked_log_probs(model, ids2, [P], mask)
    b, = _masked_log_probs(model, ids2, [P + 1], mask)
    ab = sum(_masked_log_probs(model, ids2, [P, P + 1], mask))
    # m=1 (prob 1/2, weight T/m = 2): one slot, each w.p. 1/2; m=2 (prob 1/2, weight 1): both
    assert lp2 == pytest.approx(0.5 * 2 * (a + b) / 2 + 0.5 * ab, abs=1e-4)


def test_mask_plan_is_stratified_and_weighted(lm):
    masks, w = lm._mask_plan(20, seed=5)              # 2^20 - 1 > mc_num: Monte Carlo rows
    assert masks.shape == (8, 20)
    m = masks.sum(1)
    assert sorted(((m - m[0]) % 20).tolist()) == [0, 2, 5, 7, 10, 12, 15, 17]  # evenly spread
    assert torch.allclose(w, 20 / (m.double() * 8))   # (T / m) / mc_num
    again, _ = lm._mask_plan(20, seed=5)
    assert torch.equal(masks, again)                  # seeded: choices share their masks
    exact, we = lm._mask_plan(3, seed=5)              # 7 subsets <= 8: enumerated
    assert exact.shape == (7, 3) and len({tuple(r) for r in exact.tolist()}) == 7
    assert we.sum().item() == pytest.approx(sum(1 / m for m in (1, 2, 3)))


def test_loglikelihood_monte_carlo_prefers_right_answer(lm):
    res = lm.loglikelihood([ll(Q, A), ll(Q, A[:-2] + "35"), ll(Q, "")], disable_tqdm=True)
    assert all(math.isfinite(lp) for lp, _ in res)
    assert res[0][0] > res[1][0]
    assert res[2] == (0.0, True)


def test_dream_logit_shift(tmp_path):
    """Dream reads slot i from output i - 1."""
    from conftest import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "dream", "dream", seed=0)
    dream = FlashDLLM(pretrained=str(folder), mc_num=4)
    assert dream.cfg.logit_shift == 1
    ctx = dream.tokenizer.encode("ab")
    ((lp, _),) = dream.loglikelihood([ll("ab", "c")], disable_tqdm=True)
    (ref,) = _masked_log_probs(dream.model, ctx + dream.tokenizer.encode("abc")[len(ctx):],
                               [len(ctx)], dream.cfg.mask_token_id)
    assert lp == pytest.approx(ref, abs=1e-4)


def test_loglikelihood_rolling_is_not_supported(lm):
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("text",), 0)])


# ------------------------------------------------------------------------- lm-eval end to end
def test_simple_evaluate_local_tasks(lm):
    tm = TaskManager(include_path=str(DATA), include_defaults=False)
    lm4 = FlashDLLM(llm=lm.llm, decode="threshold", cache="dual", gen_length=64, mc_num=4)
    out = lm_eval.simple_evaluate(model=lm4, tasks=["flash_dllm_arith_gen", "flash_dllm_arith_mc"],
                                  task_manager=tm, bootstrap_iters=0, log_samples=True)
    res = out["results"]
    assert res["flash_dllm_arith_gen"]["exact_match,strict-match"] == 1.0   # 6/6
    assert res["flash_dllm_arith_mc"]["acc,none"] >= 5 / 6
    gen_samples = out["samples"]["flash_dllm_arith_gen"]
    assert len(gen_samples) == 6
    assert all(s["resps"][0][0].split("#### ")[-1] == str(s["doc"]["final"]) for s in gen_samples)
