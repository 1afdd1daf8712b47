"""Several-function Python programs for the proxy models, scored by hidden asserts in the sandbox.

The prompt names three or four list helpers and one reducer, each by a spec, and a ``solve`` that
chains them; the answer defines all of them. Each body is written, at random, in one of the
styles people use (a comprehension or a loop with ``append``; a builtin or an accumulator loop),
so the answer (~80-220 BPE tokens of the proxies' tokenizer) has later lines that cannot be known
before the earlier ones are written. The hidden asserts call ``solve`` on five inputs and every
helper on two lists of three or more items, from the reference implementations.

Train and test are split on the program itself (helpers, their constants, their order:
``meta["split_key"]``), not on the question text: function and argument names are cosmetic, so a
renamed copy of a test program never reaches training.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flash_dllm.evals.code import build_program as _build_program
from flash_dllm.evals.code import extract_code, score_programs
from flash_dllm.evals.problem import Problem, format_prompt, problem_id, sample_split
from flash_dllm.evals.sandbox import DEFAULT_TIMEOUT_S

SUITE = "code-long"
N_SOLVE_TESTS = 5


@dataclass(frozen=True)
class Helper:
    """One function: ``specs`` use ``{a}`` (argument) and ``{k}``; ``bodies`` are the styles, each
    a list of lines that use ``{a}`` and ``{k}``; ``ref(xs, k)`` is the reference."""

    id: str
    specs: tuple[str, ...]
    bodies: tuple[tuple[str, ...], ...]
    ref: Callable[[list, int], Any]
    k: tuple[int, int] | None = None


def _map(tid, specs, expr, ref, k=None) -> Helper:
    return Helper(tid, specs, (
        (f"return [{expr} for x in {{a}}]",),
        ("out = []", "for x in {a}:", f"    out.append({expr})", "return out")), ref, k)


def _filter(tid, specs, cond, ref, k=None) -> Helper:
    return Helper(tid, specs, (
        (f"return [x for x in {{a}} if {cond}]",),
        ("out = []", "for x in {a}:", f"    if {cond}:", "        out.append(x)", "return out")),
        ref, k)


TRANSFORMS: tuple[Helper, ...] = (
    _map("add_k", ("adds {k} to every number in {a}", "returns {a} with {k} added to each item"),
         "x + {k}", lambda v, k: [x + k for x in v], (1, 9)),
    _map("sub_k", ("subtracts {k} from every number in {a}",), "x - {k}",
         lambda v, k: [x - k for x in v], (1, 9)),
    _map("mul_k", ("multiplies every number in {a} by {k}", "returns each item of {a} times {k}"),
         "x * {k}", lambda v, k: [x * k for x in v], (2, 5)),
    _map("square", ("squares every number in {a}",), "x * x", lambda v, k: [x * x for x in v]),
    _map("negate", ("negates every number in {a}",), "-x", lambda v, k: [-x for x in v]),
    _filter("keep_gt", ("keeps the numbers in {a} greater than {k}",
                        "returns the items of {a} that are > {k}"),
            "x > {k}", lambda v, k: [x for x in v if x > k], (0, 9)),
    _filter("keep_lt", ("keeps the numbers in {a} less than {k}",), "x < {k}",
            lambda v, k: [x for x in v if x < k], (0, 9)),
    _filter("keep_even", ("keeps only the even numbers in {a}",), "x % 2 == 0",
            lambda v, k: [x for x in v if x % 2 == 0]),
    _filter("keep_odd", ("keeps only the odd numbers in {a}",), "x % 2 == 1",
            lambda v, k: [x for x in v if x % 2 == 1]),
    Helper("drop_k", ("drops the first {k} items of {a}",), (("return {a}[{k}:]",),),
           lambda v, k: v[k:], (1, 3)),
    Helper("reverse", ("returns {a} in reverse order",),
           (("return {a}[::-1]",), ("return list(reversed({a}))",)), lambda v, k: v[::-1]),
    Helper("sort", ("returns {a} sorted in ascending order", "sorts the numbers in {a}"),
           (("return sorted({a})",), ("out = list({a})", "out.sort()", "return out")),
           lambda v, k: sorted(v)),
)

REDUCERS: tuple[Helper, ...] = (
    Helper("sum", ("returns the sum of {a}", "adds up all the numbers in {a}"),
           (("return sum({a})",), ("total = 0", "for x in {a}:", "    total += x", "return total")),
           lambda v, k: sum(v)),
    Helper("count", ("returns how many items {a} has",),
           (("return len({a})",), ("count = 0", "for x in {a}:", "    count += 1", "return count")),
           lambda v, k: len(v)),
    Helper("sum_sq", ("returns the sum of the squares of {a}",),
           (("return sum(x * x for x in {a})",),
            ("total = 0", "for x in {a}:", "    total += x * x", "return total")),
           lambda v, k: sum(x * x for x in v)),
    Helper("count_gt", ("counts the numbers in {a} greater than {k}",),
           (("return len([x for x in {a} if x > {k}])",),
            ("count = 0", "for x in {a}:", "    if x > {k}:", "        count += 1", "return count")),
           lambda v, k: len([x for x in v if x > k]), (0, 9)),
)

NAMES = ("f", "g", "h", "step", "clean", "prep", "adjust", "fix", "shift", "pick", "tidy", "scale",
         "part_a", "part_b", "part_c", "first", "second", "third", "stage", "mix", "pass_one",
         "pass_two", "change", "apply", "work", "total_of", "score", "measure", "tally", "check")
ARGS = ("xs", "nums", "items", "vals", "data", "lst")
_ORDINAL = ("first", "then", "then")


def _draw_list(rng: random.Random, min_len: int = 0) -> list[int]:
    return [rng.randint(-3, 12) for _ in range(rng.randint(min_len, 7))]


def _function(name: str, arg: str, helper: Helper, k: int, style: int) -> str:
    lines = [line.format(a=arg, k=k) for line in helper.bodies[style % len(helper.bodies)]]
    return f"def {name}({arg}):\n" + "\n".join("    " + line for line in lines)


def make_problem(rng: random.Random) -> Problem:
    """One random program: three or four transforms, one reducer, and ``solve``; a composition
    whose output barely depends on its input (``keep_gt 9`` then ``keep_lt 0``) is redrawn."""
    for _ in range(100):
        p = _draw_problem(rng)
        if p is not None:
            return p
    raise RuntimeError("code-long: every composition drawn was degenerate")  # pragma: no cover


def _draw_problem(rng: random.Random) -> Problem | None:
    parts = rng.sample(TRANSFORMS, rng.randint(3, 4)) + [rng.choice(REDUCERS)]
    names = rng.sample(NAMES, len(parts))
    arg = rng.choice(ARGS)
    ks = [rng.randint(*h.k) if h.k else 0 for h in parts]
    specs = [rng.choice(h.specs).format(a=arg, k=k) for h, k in zip(parts, ks)]
    chain = ", then ".join(names[:-1])
    lines = [f"Write Python functions {', '.join(names)} and solve."]
    lines += [f"- {n}({arg}) {s}." for n, s in zip(names, specs)]
    lines.append(f"- solve({arg}) applies {chain} to {arg}, and returns {names[-1]} of the result.")
    question = "\n".join(lines)
    funcs = [_function(n, arg, h, k, rng.randrange(2)) for n, h, k in zip(names, parts, ks)]
    if rng.randrange(2):
        expr = arg
        for n in names:
            expr = f"{n}({expr})"
        solve = f"def solve({arg}):\n    return {expr}"
    else:
        body = [f"    out = {names[0]}({arg})"] + [f"    out = {n}(out)" for n in names[1:-1]]
        solve = f"def solve({arg}):\n" + "\n".join(body) + f"\n    return {names[-1]}(out)"
    answer = "\n\n".join(funcs + [solve])
    tests = hidden_tests(parts, names, ks, seed=question)
    if tests is None:
        return None
    return Problem(id=problem_id(SUITE, question), prompt=format_prompt(question), answer=answer,
                   meta={"question": question, "template": "-".join(h.id for h in parts),
                         "split_key": "|".join(f"{h.id}:{k}" for h, k in zip(parts, ks)),
                         "entry_point": "solve", "tests": tests})


def _solve_ref(parts: Sequence[Helper], ks: Sequence[int], xs: list) -> Any:
    v: Any = xs
    for h, k in zip(parts, ks):
        v = h.ref(v, k)
    return v


def hidden_tests(parts: Sequence[Helper], names: Sequence[str], ks: Sequence[int],
                 seed: str) -> tuple[str, ...] | None:
    """Asserts: ``solve`` on ``N_SOLVE_TESTS`` inputs (redrawn until the outputs take at least two
    values, so a constant answer never passes) and each helper on two lists of 3+ items (an empty
    list would pass most wrong helpers); None when 100 draws never give two distinct outputs."""
    rng = random.Random(seed)
    for _ in range(100):
        inputs = [_draw_list(rng) for _ in range(N_SOLVE_TESTS)]
        expected = [_solve_ref(parts, ks, xs) for xs in inputs]
        if len({repr(e) for e in expected}) >= 2:
            break
    else:
        return None
    tests = [f"assert solve({v!r}) == {e!r}" for v, e in zip(inputs, expected)]
    for n, h, k in zip(names, parts, ks):
        for _ in range(2):
            v = _draw_list(rng, min_len=3)
            tests.append(f"assert {n}({v!r}) == {h.ref(v, k)!r}")
    return tuple(tests)


def train_problems(n: int, seed: int) -> list[Problem]:
    """``n`` training problems (repeats allowed), never a test question."""
    return sample_split(make_problem, SUITE, "train", n, seed, unique=False)


def test_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct held-out problems; ``test_problems(k)`` is a prefix of ``test_problems(m>k)``.
    """
    return sample_split(make_problem, SUITE, "test", n, seed, unique=True)


def extract_program(completion: str) -> str | None:
    """Every top-level ``def`` block from the first one on, up to the first other top-level line
    (HumanEval-style stop: babble after a correct program does not fail it); None without a def."""
    return extract_code(completion, many_defs=True)


def build_program(problem: Problem, completion: str) -> str | None:
    """The program's functions plus the hidden asserts; None without a def."""
    return _build_program(problem, completion, many_defs=True)


def score_batch(problems: Sequence[Problem], completions: Sequence[str], *,
                timeout: float = DEFAULT_TIMEOUT_S, workers: int | None = None) -> list[bool]:
    """pass@1 per (problem, completion), run concurrently in the sandbox; bad input is a miss."""
    return score_programs(build_program, problems, completions, timeout=timeout, workers=workers)


def score(problem: Problem, completion: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """pass@1 of one completion (one sandbox process; prefer ``score_batch`` for many)."""
    return score_batch([problem], [completion], timeout=timeout)[0]
