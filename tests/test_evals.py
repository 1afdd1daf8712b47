"""Offline eval suites: determinism, train/test disjointness, length budgets, charset, scorers.

The long suites' own checks (worked steps, programs, token lengths) are in test_long_suites.py."""
from __future__ import annotations

import random
import re
import time

import pytest

from flash_dllm.evals import (CHARSET, MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, SUITES, Problem,
                              get_suite, split_of)
from flash_dllm.evals import arith, code
from flash_dllm.evals.sandbox import run_programs
from flash_dllm.evals.tasks import SHORT_SUITES

SUITE_NAMES = sorted(SUITES)


# --- shared interface ------------------------------------------------------------------------


def test_registry():
    assert set(SUITES) == {"arith", "code", "chain", "code-long"}
    assert {n: s.gen_length for n, s in SUITES.items()} == {
        "arith": 64, "code": 64, "chain": 256, "code-long": 256}
    for name, suite in SUITES.items():
        assert suite.name == name and get_suite(name) is suite
    with pytest.raises(KeyError, match="unknown eval suite"):
        get_suite("nope")


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_deterministic_for_a_seed(name):
    s = SUITES[name]
    assert s.train_problems(300, 7) == s.train_problems(300, 7)
    assert s.train_problems(300, 7) != s.train_problems(300, 8)
    assert s.test_problems(100) == s.test_problems(100, seed=0)
    # A bigger test set extends a smaller one, so "first 200" means the same thing everywhere.
    assert s.test_problems(200)[:50] == s.test_problems(50)


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_train_and_test_are_disjoint(name):
    s = SUITES[name]
    train = s.train_problems(2000, 0) + s.train_problems(2000, 1)
    test = s.test_problems(400) + s.test_problems(400, seed=5)
    train_q = {p.meta["question"] for p in train}
    test_q = {p.meta["question"] for p in test}
    assert not train_q & test_q
    # the split key is the question unless the suite names what the problem really is
    train_k = {p.meta.get("split_key", p.meta["question"]) for p in train}
    test_k = {p.meta.get("split_key", p.meta["question"]) for p in test}
    assert not train_k & test_k
    assert all(split_of(k) == "train" for k in train_k)
    assert all(split_of(k) == "test" for k in test_k)
    assert len({p.prompt for p in s.test_problems(400)}) == 400  # test sets have no repeats


@pytest.mark.parametrize("name", SHORT_SUITES)
def test_lengths_charset_and_shape(name):
    s = SUITES[name]
    problems = s.train_problems(4000, 3) + s.test_problems(500, seed=3)
    allowed = set(CHARSET)
    for p in problems:
        assert isinstance(p, Problem)
        assert len(p.prompt) <= MAX_PROMPT_CHARS, p.prompt
        assert len(p.answer) <= MAX_ANSWER_CHARS, p.answer
        assert set(p.prompt) <= allowed and set(p.answer) <= allowed, (p.prompt, p.answer)
        assert p.prompt == s.format_prompt(p.meta["question"])
        assert p.id.startswith(name + "-")
    assert MAX_ANSWER_CHARS <= 64  # the answer must fit the 64-slot generation canvas


def test_charset_is_printable_ascii_plus_newline():
    assert len(set(CHARSET)) == len(CHARSET) == 96
    assert set(CHARSET) == {chr(i) for i in range(32, 127)} | {"\n"}


# --- arith -----------------------------------------------------------------------------------


def test_arith_worked_steps_are_correct():
    step = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")
    for p in arith.train_problems(3000, 11):
        work, final = p.answer.split(" #### ")
        steps = [st.rstrip(".") for st in work.split(" ")]
        assert 2 <= len(steps) <= 3, p.answer
        for st in steps:
            a, op, b, r = step.match(st).groups()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(r)
            assert 0 <= int(r) < 1000
        assert int(final) == p.meta["final"] == int(step.match(steps[-1]).group(4))
        assert arith.score(p, p.answer)


def test_arith_variety():
    problems = arith.train_problems(10000, 0)
    assert len({p.meta["question"] for p in problems}) > 9500
    assert {p.meta["template"] for p in problems} == set(arith.TEMPLATES)
    ops = "".join(p.answer for p in problems)
    assert all(op in ops for op in "+-*")


def test_arith_score():
    p = arith.test_problems(1)[0]
    n = p.meta["final"]
    assert arith.score(p, p.answer)
    assert arith.score(p, f"#### {n}")
    assert arith.score(p, f"####{n}")
    assert arith.score(p, f"1+1=2. #### {n}\n\nxx#!junk")          # trailing junk
    assert arith.score(p, f"#### {n + 1}. oops #### {n}")           # the LAST #### counts
    assert not arith.score(p, f"#### {n}. oops #### {n + 1}")
    assert not arith.score(p, f"#### {n}7")
    assert not arith.score(p, f"#### {n} ####")                      # last #### has no number
    assert not arith.score(p, f"{n}")                                # no #### at all
    for junk in ("", "####", "#### ", "#### -", "\x00\n####x", "#" * 500, None, 12, b"#### 1"):
        assert arith.score(p, junk) is False
    bad = Problem(id="x", prompt="q\n", answer="#### 1", meta={})
    assert arith.score(bad, "#### 1") is False  # malformed problem: a miss, not an exception
    assert arith.score_batch([p, p], [p.answer, "nope"]) == [True, False]
    with pytest.raises(ValueError):
        arith.score_batch([p], [])


# --- code ------------------------------------------------------------------------------------


def _one_per_task() -> list[Problem]:
    rng, found = random.Random(0), {}
    while len(found) < len(code.TASKS):
        p = code.make_problem(rng)
        found.setdefault(p.meta["template"], p)
    return list(found.values())


def test_code_reference_solutions_pass():
    problems = code.test_problems(300) + _one_per_task()
    t0 = time.monotonic()
    assert code.score_batch(problems, [p.answer for p in problems]) == [True] * len(problems)
    assert time.monotonic() - t0 < 15  # hundreds of samples in seconds, not minutes


def test_code_tests_are_deterministic_and_discriminating():
    p = code.test_problems(1)[0]
    assert code.test_problems(1)[0].meta["tests"] == p.meta["tests"]
    problems = _one_per_task()
    for p in problems:
        assert len(p.meta["tests"]) == code.N_TESTS
        assert all(t.startswith(f"assert {p.meta['entry_point']}(") for t in p.meta["tests"])
    # Any constant answer fails every task: the hidden asserts expect two or more distinct values.
    wrong = []
    for p in problems:
        head = p.answer.split("\n")[0]
        for const in ("None", "0", "[]", "True", "False", "''"):
            wrong.append((p, f"{head}\n    return {const}"))
    ok = code.score_batch([p for p, _ in wrong], [c for _, c in wrong])
    assert not any(ok), [c for (_, c), o in zip(wrong, ok) if o]


def test_code_wrong_and_broken_completions_fail():
    p = next(q for q in code.test_problems(200) if q.meta["template"] == "add_k")
    name, arg = p.meta["entry_point"], p.answer.split("(")[1].split(")")[0]
    head = f"def {name}({arg}):"
    completions = [
        p.answer,                                               # reference
        p.answer + "\nWrite a Python function junk(xs) that",  # trailing junk after the block
        "  " + p.answer,                                        # no top-level def: miss
        f"{head}\n    return [x + 100 for x in {arg}]",         # wrong
        f"def other({arg}):\n    return [x for x in {arg}]",    # wrong name -> NameError
        f"{head}\n    return [x +",                             # stopped early: syntax error
        f"{head}\n    raise RuntimeError('boom')",              # crash
        f"{head}\n    return 1 / 0",
        f"{head}\n    import os; os._exit(0)\n",                # exits before the asserts finish
        "", "\n\n", "garbage ¿ \x00 ####", "def", "def (", None, 42,
    ]
    got = code.score_batch([p] * len(completions), completions)
    assert got == [True, True] + [False] * (len(completions) - 2)
    assert code.score(p, p.answer) is True
    assert code.score(p, "") is False
    with pytest.raises(ValueError):
        code.score_batch([p], [])


def test_code_infinite_loop_is_killed_without_hanging():
    p = code.test_problems(1)[0]
    head = p.answer.split("\n")[0]
    hangs = [f"{head}\n    while True:\n        pass",
             f"{head}\n    import time\n    time.sleep(1000)",
             f"{head}\n    import os, time\n    os.fork()\n    time.sleep(1000)"]
    problems = [p] * (len(hangs) + 1)
    t0 = time.monotonic()
    got = code.score_batch(problems, hangs + [p.answer], timeout=1.0, workers=4)
    elapsed = time.monotonic() - t0
    assert got == [False, False, False, True]  # a hang costs its own sample only
    assert elapsed < 1.0 + 4.0, elapsed


def test_sandbox_reports_why():
    res = run_programs(["assert 1 == 1", "assert 1 == 2", "x = [0] * (10 ** 10)",
                        "while True: pass", "def f(:"], timeout=1.0, memory_mb=256)
    assert [r.status for r in res] == ["passed", "failed", "failed", "timeout", "failed"]
    assert "MemoryError" in res[2].detail and "SyntaxError" in res[4].detail
    assert run_programs([]) == []
    with pytest.raises(ValueError):
        run_programs(["pass"], timeout=0)
