"""The proxy models' long-answer suites (chain, code-long), their BPE tokenizers
(tools/proxy_tokenizer.py), the committed proxy checkpoints and ``--model NAME``."""
from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flash_dllm.evals import chain, code_long
from flash_dllm.evals.problem import split_of

_ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = _ROOT / "checkpoints"


def _load_tool(name: str):
    sys.path.insert(0, str(_ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(name, _ROOT / "tools" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(name, mod)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(_ROOT / "tools"))


pt = _load_tool("proxy_tokenizer")

# --- chain -----------------------------------------------------------------------------------

_STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)")


def test_chain_worked_steps_are_correct_and_end_in_the_final_count():
    for p in chain.train_problems(2000, 5) + chain.test_problems(200):
        steps = _STEP.findall(p.answer)
        assert len(steps) >= p.meta["events"] >= chain.MIN_EVENTS, p.answer
        for a, op, b, r in steps:
            a, b, r = int(a), int(b), int(r)
            assert {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op] == r, p.answer
            assert op != "/" or a % b == 0
            assert 0 <= r <= chain.MAX_VALUE
        assert p.meta["events"] <= chain.MAX_EVENTS
        assert p.answer.endswith(f"\n#### {p.meta['final']}")
        assert int(steps[-1][3]) == p.meta["final"]
        assert chain.score(p, p.answer)
        assert split_of(p.meta["question"]) in ("train", "test")


def test_chain_variety_and_scoring():
    problems = chain.train_problems(3000, 0)
    kinds = {k for p in problems for k in p.meta["template"].split("-")}
    assert kinds == set(chain.EVENTS)
    # phrasing is drawn per sentence: the same event reads differently across problems
    gains = [p for p in problems if p.meta["template"].startswith("gain")]
    second = {re.sub(r"[A-Z][a-z]+|\d+", "_", p.answer.split(". ")[1]).split(" _ + _")[0]
              for p in gains}
    assert len(second) >= 4, second
    p = problems[0]
    n = p.meta["final"]
    assert chain.score(p, f"lots of words\n#### {n}") and not chain.score(p, f"#### {n + 1}")
    assert chain.score_batch([p, p], [p.answer, ""]) == [True, False]
    with pytest.raises(ValueError):
        chain.score_batch([p], [])


# --- code-long -------------------------------------------------------------------------------


def test_code_long_reference_programs_pass_and_wrong_ones_fail():
    problems = code_long.test_problems(60)
    assert code_long.score_batch(problems, [p.answer for p in problems]) == [True] * 60
    p = problems[0]
    names = re.findall(r"^def (\w+)\(", p.answer, flags=re.M)
    assert names[-1] == "solve" and len(names) >= 4
    assert len(p.meta["tests"]) == code_long.N_SOLVE_TESTS + 2 * (len(names) - 1)
    assert "([])" not in " ".join(t for t in p.meta["tests"] if "solve(" not in t)
    wrong = [
        p.answer.replace("def solve(", "def solve_(", 1),                # solve missing
        p.answer.rsplit("\n", 1)[0] + "\n    return 0",                    # constant result
        p.answer.split("\n\ndef solve")[0],                                 # no solve at all
        "  " + p.answer,                               # first helper indented away: lost
        "", None,
    ]
    assert code_long.score_batch([p] * len(wrong), wrong) == [False] * len(wrong)
    # babble after the program is cut (HumanEval-style stop), every def before it is kept
    assert code_long.score(p, p.answer + "\nWrite Python functions junk(")
    assert code_long.extract_program("x = 1\ndef f():\n    return 1\n\ndef g():\n    return 2\n"
                                     "print('junk')") == "def f():\n    return 1\n\ndef g():\n    return 2"


def test_code_long_hidden_tests_discriminate():
    for p in code_long.test_problems(40):
        solve_tests = [t for t in p.meta["tests"] if t.startswith("assert solve(")]
        assert len({t.rsplit("==", 1)[1] for t in solve_tests}) >= 2, solve_tests


# --- tokenizers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return [x for s in (chain, code_long) for p in s.train_problems(400, 1)
            for x in (p.prompt, p.answer)]


@pytest.fixture(scope="module", params=pt.FORMATS)
def proxy_tok(request, corpus, tmp_path_factory):
    from transformers import PreTrainedTokenizerFast
    folder = pt.build_tokenizer(tmp_path_factory.mktemp(request.param), request.param, corpus,
                                vocab_size=600)
    return request.param, PreTrainedTokenizerFast.from_pretrained(str(folder),
                                                                  local_files_only=True)


def test_proxy_tokenizer_specials_bos_and_round_trip(proxy_tok):
    fmt, tok = proxy_tok
    ids = pt.token_ids(fmt)
    for role, tid in ids.items():
        assert tok.convert_ids_to_tokens(tid) == {"llada": dict(zip(
            ("bos", "eos", "mask", "eot"), pt.LLADA_SPECIALS)), "dream": {
            "bos": "<|beginoftext|>", "eos": "<|endoftext|>", "mask": "<|mask|>",
            "eot": "<|im_end|>"}}[fmt][role]
    assert tok.eos_token_id == ids["eos"] and tok.pad_token_id == ids["eos"]
    p = chain.test_problems(1)[0]
    enc = tok(p.prompt)["input_ids"]
    assert (enc[0] == ids["bos"]) == (fmt == "llada")   # LLaDA adds BOS, Qwen2/Dream does not
    assert tok.decode(tok(p.answer, add_special_tokens=False)["input_ids"]) == p.answer
    # digits are single tokens, so numbers are learnt digit by digit
    pieces = tok.convert_ids_to_tokens(tok("x 1234 y", add_special_tokens=False)["input_ids"])
    assert [t for t in pieces if any(c.isdigit() for c in t)] == ["1", "2", "3", "4"]
    # words are merged: far fewer tokens than characters
    assert len(tok(p.answer, add_special_tokens=False)["input_ids"]) < 0.6 * len(p.answer)


def test_proxy_tokenizer_chat_templates(proxy_tok):
    fmt, tok = proxy_tok
    text = tok.apply_chat_template([{"role": "user", "content": "hi\n"}],
                                   add_generation_prompt=True, tokenize=False)
    if fmt == "llada":
        assert text == ("<|start_header_id|>user<|end_header_id|>\n\nhi\n<|eot_id|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                        "<|im_start|>user\nhi\n<|im_end|>\n<|im_start|>assistant\n")
    # every special written in a template is one token
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert all(tok.convert_ids_to_tokens(i) != "<" for i in ids)


def test_proxy_tokenizer_rejects_unknown_format():
    with pytest.raises(ValueError, match="llada"):
        pt.specials("gpt")


# --- the committed proxy checkpoints and --model NAME ------------------------------------------


@pytest.mark.parametrize("name,arch", [("proxy-llada", "llada"), ("proxy-dream", "dream")])
def test_committed_proxy_checkpoints(name, arch):
    from flash_dllm.models.loader import load_model, model_path, read_config
    folder = model_path(name)
    assert folder == CHECKPOINTS / name
    family, cfg, _ = read_config(folder)
    assert family.name == arch and cfg.arch == arch
    shards = sorted(folder.glob("model-*.safetensors"))
    assert shards and all(f.stat().st_size < 16 * 2 ** 20 for f in shards)
    assert sum(f.stat().st_size for f in shards) <= 40 * 2 ** 20
    model, _ = load_model(folder)
    n = sum(p.numel() for p in model.parameters())
    assert 20e6 <= n <= 21e6, n
    if arch == "dream":
        assert cfg.logit_shift == 1 and cfg.num_kv_heads < cfg.num_heads and cfg.qkv_bias
    # the record ships with it: the runs' arguments and loss curves (train_log*.json; the second
    # training run split over two commands left its first part's, proxy-llada's third part its
    # whole record) and the exact-sampler score in the console logs
    logs = sorted(folder.glob("train_log*.json"))
    assert logs
    for log_file in logs:
        log = json.loads(log_file.read_text())
        assert log["args"]["format"] == arch and log["history"]
    console = "".join(f.read_text() for f in sorted(folder.glob("train*.log")))
    assert re.search(r"final eval \(plain, 200/suite, exact sampler", console)


def test_model_names_resolve(tmp_path, monkeypatch):
    from flash_dllm.models import loader
    assert loader.model_path(None) == loader.DEMO_MODEL == loader.model_path("demo")
    assert loader.model_path(str(tmp_path)) == tmp_path        # a folder is itself
    assert loader.model_path("some/where") == Path("some/where")  # not a name: load_model says
    # an installed package finds them through FLASH_DLLM_CHECKPOINTS, ahead of the checkout
    (tmp_path / "proxy-dream").mkdir()
    (tmp_path / "proxy-dream" / "config.json").write_text("{}")
    monkeypatch.setenv(loader.CHECKPOINTS_ENV, str(tmp_path))
    assert loader.model_path("proxy-dream") == tmp_path / "proxy-dream"
    monkeypatch.setattr(loader, "SOURCE_CHECKPOINTS", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="FLASH_DLLM_CHECKPOINTS"):
        loader.model_path("proxy-llada")


def test_proxy_generates_through_the_engine_and_counts_block_forwards():
    from flash_dllm import LLM, SamplingParams
    llm = LLM("proxy-dream")
    p = chain.test_problems(1)[0]
    params = SamplingParams(max_tokens=64, decode="threshold", threshold=0.9, cache="dual")
    out = llm.generate([p.prompt], params)[0]
    assert out.text and out.num_forwards > 2
    blocks = out.metrics["block_forwards"]
    assert 1 <= len(blocks) <= 2 and sum(blocks) == out.num_forwards


def test_eval_cli_defaults_to_the_suites_canvas(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "flash_dllm", "eval", "--suite", "code-long",
                        "--model", "proxy-llada", "--n", "2", "--decode", "threshold",
                        "--cache", "dual", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["params"]["max_tokens"] == 256 and rep["n"] == 2
    fpb = rep["forwards_per_block"]
    assert fpb["blocks"] == sum(fpb["histogram"].values()) > 0
    assert "fwd/block=" in r.stdout


def test_train_proxy_smoke(tmp_path):
    """The training tool end to end on the CPU (tiny Dream model: exercises the logit shift)."""
    out = tmp_path / "p"
    r = subprocess.run(
        [sys.executable, str(_ROOT / "tools" / "train_proxy.py"), "--format", "dream", "--out",
         str(out), "--device", "cpu", "--steps", "3", "--minutes", "5", "--pool", "200",
         "--tokenizer-corpus", "200", "--d-model", "64", "--n-layers", "1", "--n-heads", "2",
         "--n-kv-heads", "1", "--mlp", "64", "--batch-tokens", "2048", "--eval-n", "2",
         "--eval-every", "0", "--workers", "1", "--threads", "1", "--eval-gen-length", "32"],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    from flash_dllm import LLM, SamplingParams
    from flash_dllm.models.loader import read_config
    assert read_config(out)[0].name == "dream"
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 3 and set(log["final_eval"]["plain"]) == {"chain", "code-long"}
    o = LLM(str(out)).generate(["hi"], SamplingParams(max_tokens=8))[0]
    assert o.num_forwards == 8
    # continuing keeps the tokenizer the weights were trained with (no retraining of merges)
    again = tmp_path / "q"
    args = r.args[:]
    args[args.index(str(out))] = str(again)
    args[args.index("--tokenizer-corpus") + 1] = "50"
    r2 = subprocess.run(args + ["--init-from", str(out)], capture_output=True, text=True,
                        timeout=300)
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert (again / "tokenizer.json").read_text() == (out / "tokenizer.json").read_text()


def test_chain_problem_draws_are_reproducible():
    a = chain.make_problem(random.Random(3), n_events=5)
    b = chain.make_problem(random.Random(3), n_events=5)
    assert a == b and a.meta["events"] == 5


def test_train_proxy_split_run_equals_one_run(tmp_path):
    """--save-state / --resume carry weights, optimizer, step and data order exactly: two parts
    give the same weights as one run (in --steps mode with --schedule-steps the total, the
    parts follow one LR schedule); the second part reuses the pool from --pool-cache, and a
    part with other schedule arguments is refused."""
    import torch
    from safetensors.torch import load_file

    def run(out, steps, *extra, ok=True):
        r = subprocess.run(
            [sys.executable, str(_ROOT / "tools" / "train_proxy.py"), "--format", "llada",
             "--out", str(out), "--device", "cpu", "--steps", str(steps), "--pool", "200",
             "--tokenizer-corpus", "200", "--d-model", "64", "--n-layers", "1", "--n-heads", "2",
             "--mlp", "64", "--batch-tokens", "2048", "--eval-n", "0", "--eval-every", "0",
             "--workers", "1", "--threads", "1", "--warmup", "2", *extra],
            capture_output=True, text=True, timeout=300)
        assert (r.returncode == 0) == ok, r.stderr[-2000:] + r.stdout[-2000:]
        return r.stdout if ok else r.stderr

    def weights(folder):
        w = {}
        for f in sorted(folder.glob("*.safetensors")):
            w.update(load_file(f))
        return w

    run(tmp_path / "one", 4)
    state, cache = tmp_path / "s.pt", tmp_path / "pool.pt"
    run(tmp_path / "split", 2, "--save-state", str(state), "--pool-cache", str(cache),
        "--schedule-steps", "4")
    assert state.exists() and cache.exists()
    # a part that spans another LR schedule is refused: it would restart the decay
    bad = run(tmp_path / "bad", 4, "--resume", str(state), "--pool-cache", str(cache), ok=False)
    assert "schedule differs" in bad and "--schedule-steps 4 (saved) vs 0" in bad, bad
    second = run(tmp_path / "split", 4, "--resume", str(state), "--pool-cache", str(cache),
                 "--schedule-steps", "4")
    assert "resumed" in second and "pool loaded" in second
    a, b = weights(tmp_path / "one"), weights(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = json.loads((tmp_path / "split" / "train_log.json").read_text())
    assert log["steps"] == 4 and log["parts"] == 2


def test_committed_llada2_proxy_generates_on_its_exact_block_cache():
    """The LLaDA2-format proxy (block-causal MoE, issue 39): its real layout loads as the llada2
    family, its training record ships with it, and it answers a chain problem through the
    engine on the family's default (exact block) cache."""
    from flash_dllm import LLM, SamplingParams
    from flash_dllm.models.loader import model_path, read_config
    folder = model_path("proxy-llada2")
    family, cfg, _ = read_config(folder)
    assert family.name == "llada2" and cfg.attention.block_causal and cfg.moe is not None
    shards = sorted(folder.glob("model-*.safetensors"))
    assert shards and all(f.stat().st_size < 16 * 2 ** 20 for f in shards)
    assert re.search(r"trained \d+ steps", (folder / "train.log").read_text())
    llm = LLM("proxy-llada2")
    p = chain.test_problems(1)[0]
    out = llm.generate([p.prompt], SamplingParams(max_tokens=64))[0]
    assert out.text and out.num_forwards >= 2
