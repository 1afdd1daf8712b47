"""HumanEval-like tiny Python function tasks, scored pass@1 by hidden asserts run out of process.

Prompt: ``"Write a Python function solve(xs) that adds 3 to every number in xs.\\n"``
Answer: ``"def solve(xs):\\n    return [x + 3 for x in xs]"``
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flash_dllm.evals.problem import (MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Problem, format_prompt,
                                      problem_id, sample_split)
from flash_dllm.evals.sandbox import DEFAULT_TIMEOUT_S, run_programs

SUITE = "code"


@dataclass(frozen=True)
class Task:
    """A function template; ``specs`` and ``expr`` use ``{a}`` (argument), ``{k}``, ``{c}``."""

    id: str
    kind: str                           # argument type: "list" (of ints) | "str" | "int"
    specs: tuple[str, ...]              # phrasings of the same task
    expr: str                           # the body is ``return <expr>``
    ref: Callable[[Any, int, str], Any]  # reference implementation: ref(arg, k, c)
    k: tuple[int, int] | None = None    # inclusive range of the constant, when the task has one
    uses_char: bool = False
    min_len: int = 0                    # shortest list/str input the task is defined on
    nonneg: bool = False                # int tasks: draw only non-negative inputs

    def __post_init__(self) -> None:
        if self.kind not in ("list", "str", "int"):
            raise ValueError(f"Task {self.id}: unknown kind {self.kind!r}")


def _t(tid, kind, specs, expr, ref, **kw) -> Task:
    return Task(tid, kind, tuple([specs] if isinstance(specs, str) else specs), expr, ref, **kw)


K19, K09, K29, K15 = (1, 9), (0, 9), (2, 9), (1, 5)
TASKS: tuple[Task, ...] = (
    # list -> list (map)
    _t("add_k", "list",
       ("adds {k} to every number in {a}", "returns {a} with {k} added to each item"),
       "[x + {k} for x in {a}]", lambda v, k, c: [x + k for x in v], k=K19),
    _t("sub_k", "list", "subtracts {k} from every number in {a}",
       "[x - {k} for x in {a}]", lambda v, k, c: [x - k for x in v], k=K19),
    _t("mul_k", "list",
       ("multiplies every number in {a} by {k}", "returns each item of {a} times {k}"),
       "[x * {k} for x in {a}]", lambda v, k, c: [x * k for x in v], k=K29),
    _t("square_each", "list", "squares every number in {a}",
       "[x * x for x in {a}]", lambda v, k, c: [x * x for x in v]),
    _t("negate", "list", "negates every number in {a}", "[-x for x in {a}]",
       lambda v, k, c: [-x for x in v]),
    # list -> list (filter, slice, order)
    _t("keep_gt", "list", ("keeps the numbers in {a} greater than {k}",
                           "returns the items of {a} that are > {k}"),
       "[x for x in {a} if x > {k}]", lambda v, k, c: [x for x in v if x > k], k=K09),
    _t("keep_lt", "list", "keeps the numbers in {a} less than {k}",
       "[x for x in {a} if x < {k}]", lambda v, k, c: [x for x in v if x < k], k=K09),
    _t("keep_even", "list", "keeps only the even numbers in {a}",
       "[x for x in {a} if x % 2 == 0]", lambda v, k, c: [x for x in v if x % 2 == 0]),
    _t("keep_odd", "list", "keeps only the odd numbers in {a}",
       "[x for x in {a} if x % 2]", lambda v, k, c: [x for x in v if x % 2 == 1]),
    _t("first_k", "list", "returns the first {k} items of {a}", "{a}[:{k}]",
       lambda v, k, c: v[:k], k=K15),
    _t("last_k", "list", "returns the last {k} items of {a}", "{a}[-{k}:]",
       lambda v, k, c: v[-k:], k=K15),
    _t("drop_k", "list", "drops the first {k} items of {a}", "{a}[{k}:]",
       lambda v, k, c: v[k:], k=K15),
    _t("reverse_list", "list", "returns {a} in reverse order", "{a}[::-1]",
       lambda v, k, c: v[::-1]),
    _t("sort", "list", ("returns {a} sorted in ascending order", "sorts the numbers in {a}"),
       "sorted({a})", lambda v, k, c: sorted(v)),
    # list -> number (reduce)
    _t("sum", "list", ("returns the sum of {a}", "adds up all the numbers in {a}"), "sum({a})",
       lambda v, k, c: sum(v)),
    _t("max", "list", "returns the largest number in {a}", "max({a})",
       lambda v, k, c: max(v), min_len=1),
    _t("min", "list", "returns the smallest number in {a}", "min({a})",
       lambda v, k, c: min(v), min_len=1),
    _t("count_eq", "list", "counts how many items of {a} equal {k}", "{a}.count({k})",
       lambda v, k, c: v.count(k), k=K09),
    _t("count_gt", "list", "counts the numbers in {a} greater than {k}",
       "sum(x > {k} for x in {a})", lambda v, k, c: len([x for x in v if x > k]), k=K09),
    _t("sum_sq", "list", "returns the sum of the squares of {a}", "sum(x * x for x in {a})",
       lambda v, k, c: sum(x * x for x in v)),
    _t("length", "list", "returns how many items {a} has", "len({a})", lambda v, k, c: len(v)),
    _t("contains", "list", "returns True if {k} is in {a}", "{k} in {a}",
       lambda v, k, c: k in v, k=K09),
    # str
    _t("reverse_str", "str", ("returns the string {a} reversed", "reverses the string {a}"),
       "{a}[::-1]", lambda v, k, c: v[::-1]),
    _t("upper", "str", ("returns {a} in upper case", "converts the string {a} to upper case"),
       "{a}.upper()", lambda v, k, c: v.upper()),
    _t("lower", "str", ("returns {a} in lower case", "converts the string {a} to lower case"),
       "{a}.lower()", lambda v, k, c: v.lower()),
    _t("repeat", "str", "returns the string {a} repeated {k} times", "{a} * {k}",
       lambda v, k, c: v * k, k=(2, 5)),
    _t("count_char", "str", "counts how many times '{c}' appears in {a}", "{a}.count('{c}')",
       lambda v, k, c: v.count(c), uses_char=True),
    _t("starts_with", "str", "returns True if {a} starts with '{c}'", "{a}.startswith('{c}')",
       lambda v, k, c: v.startswith(c), uses_char=True),
    _t("add_suffix", "str", "appends '{c}' to the end of the string {a}", "{a} + '{c}'",
       lambda v, k, c: v + c, uses_char=True),
    _t("str_len", "str", "returns the length of the string {a}", "len({a})",
       lambda v, k, c: len(v)),
    _t("first_char", "str", "returns the first character of {a}", "{a}[0]",
       lambda v, k, c: v[0], min_len=1),
    # int
    _t("plus_k", "int", ("returns {a} plus {k}", "adds {k} to {a}"), "{a} + {k}",
       lambda v, k, c: v + k, k=K19),
    _t("times_k", "int", ("returns {a} times {k}", "multiplies {a} by {k}"), "{a} * {k}",
       lambda v, k, c: v * k, k=K29),
    _t("is_even", "int", "returns True if {a} is even", "{a} % 2 == 0", lambda v, k, c: v % 2 == 0),
    _t("divisible", "int", "returns True if {a} is divisible by {k}", "{a} % {k} == 0",
       lambda v, k, c: v % k == 0, k=K29),
    _t("square", "int", "returns the square of {a}", "{a} * {a}", lambda v, k, c: v * v),
    _t("abs", "int", "returns the absolute value of {a}", "abs({a})", lambda v, k, c: abs(v)),
    _t("gt_k", "int", "returns True if {a} is greater than {k}", "{a} > {k}",
       lambda v, k, c: v > k, k=K09),
    _t("last_digit", "int", "returns the last digit of {a}", "{a} % 10", lambda v, k, c: v % 10,
       nonneg=True),
)
TASKS_BY_ID = {t.id: t for t in TASKS}
assert len(TASKS_BY_ID) == len(TASKS), "duplicate task id"

# NOTE: names never shadow a builtin the bodies call (sum, max, len, sorted, abs, ...).
FUNC_NAMES = ("f", "g", "h", "solve", "func", "calc", "fn", "run", "step", "apply", "work", "proc",
              "op", "task", "go", "helper", "make", "get", "do_it", "answer", "result", "transform",
              "convert", "process", "compute", "handle", "my_func", "foo", "bar", "baz")
ARG_NAMES = {"list": ("xs", "nums", "lst", "arr", "a", "vals", "data", "items"),
             "str": ("s", "text", "word", "w", "st", "name"),
             "int": ("n", "x", "num", "v", "m", "i")}
_CHARS = "abcde"
_STR_ALPHABET = "abcdexyzAB"
N_TESTS = 5


def _draw_input(task: Task, rng: random.Random) -> Any:
    if task.kind == "list":
        return [rng.randint(-3, 12) for _ in range(rng.randint(task.min_len, 7))]
    if task.kind == "str":
        return "".join(rng.choice(_STR_ALPHABET) for _ in range(rng.randint(task.min_len, 8)))
    return rng.randint(0, 99) if task.nonneg else rng.randint(-20, 60)


def hidden_tests(task: Task, name: str, k: int, c: str, seed: str) -> tuple[str, ...]:
    """``N_TESTS`` asserts from the reference implementation on inputs drawn from ``seed``.

    Inputs are distinct and redrawn until the expected outputs take at least two values, so a
    constant answer (``return True``, ``return []``) can never pass.
    """
    rng = random.Random(seed)
    for _ in range(100):
        drawn: dict[str, Any] = {}  # distinct inputs: no wasted asserts
        for _ in range(4 * N_TESTS):
            v = _draw_input(task, rng)
            drawn.setdefault(repr(v), v)
            if len(drawn) == N_TESTS:
                break
        inputs = list(drawn.values())
        expected = [task.ref(v, k, c) for v in inputs]
        if len({repr(e) for e in expected}) >= 2:
            break
    else:  # pragma: no cover - only a degenerate template gets here
        raise RuntimeError(f"task {task.id}: inputs never gave two distinct outputs")
    return tuple(f"assert {name}({v!r}) == {e!r}" for v, e in zip(inputs, expected))


def make_problem(rng: random.Random) -> Problem:
    """One random instance of a random task; redraws names on the rare length overflow."""
    task = rng.choice(TASKS)
    k = rng.randint(*task.k) if task.k else 0
    c = rng.choice(_CHARS) if task.uses_char else ""
    spec_fmt = rng.choice(task.specs)
    for _ in range(100):
        name, arg = rng.choice(FUNC_NAMES), rng.choice(ARG_NAMES[task.kind])
        spec = spec_fmt.format(a=arg, k=k, c=c)
        question = f"Write a Python function {name}({arg}) that {spec}."
        answer = f"def {name}({arg}):\n    return {task.expr.format(a=arg, k=k, c=c)}"
        prompt = format_prompt(question)
        if len(prompt) <= MAX_PROMPT_CHARS and len(answer) <= MAX_ANSWER_CHARS:
            break
    else:  # pragma: no cover
        raise RuntimeError(f"task {task.id} keeps overflowing the length budget")
    # NOTE: the hidden tests are seeded by the question, so a problem's tests never depend on the
    # sampling stream it was drawn from.
    tests = hidden_tests(task, name, k, c, seed=question)
    return Problem(id=problem_id(SUITE, question), prompt=prompt, answer=answer,
                   meta={"question": question, "template": task.id, "entry_point": name,
                         "tests": tests})


def train_problems(n: int, seed: int) -> list[Problem]:
    """``n`` training problems (repeats allowed), never a test question."""
    return sample_split(make_problem, SUITE, "train", n, seed, unique=False)


def test_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct held-out problems; ``test_problems(k)`` is a prefix of ``test_problems(m>k)``.
    """
    return sample_split(make_problem, SUITE, "test", n, seed, unique=True)


def extract_code(completion: str, *, many_defs: bool = False) -> str | None:
    """The first top-level ``def`` block of a completion (``many_defs``: and every ``def`` block
    right after it), or None.

    Like HumanEval's stop sequences: trailing junk on a later unindented line is cut, so a model
    that writes a correct function and then keeps babbling still passes.
    """
    if not isinstance(completion, str):
        return None
    lines = completion.replace("\r\n", "\n").split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("def ")), None)
    if start is None:
        return None
    block = [lines[start]]
    for line in lines[start + 1:]:
        if line.strip() and not line[0].isspace() and not (many_defs and line.startswith("def ")):
            break
        block.append(line)
    return "\n".join(block).rstrip()


def build_program(problem: Problem, completion: str, *, many_defs: bool = False) -> str | None:
    """Solution plus hidden asserts, or None when the completion has no function at all."""
    code = extract_code(completion, many_defs=many_defs)
    if code is None:
        return None
    return code + "\n\n" + "\n".join(problem.meta["tests"]) + "\n"


def score_batch(problems: Sequence[Problem], completions: Sequence[str], *,
                timeout: float = DEFAULT_TIMEOUT_S, workers: int | None = None) -> list[bool]:
    """pass@1 per (problem, completion), run concurrently in the sandbox; bad input is a miss."""
    return score_programs(build_program, problems, completions, timeout=timeout, workers=workers)


def score_programs(build: Callable[[Problem, str], str | None], problems: Sequence[Problem],
                   completions: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S,
                   workers: int | None = None) -> list[bool]:
    """pass@1 of ``build(problem, completion)`` (a program, or None for a miss) in the sandbox."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    programs: list[str | None] = []
    for p, c in zip(problems, completions):
        try:
            programs.append(build(p, c))
        except Exception:  # noqa: BLE001 - a malformed problem/completion is a miss
            programs.append(None)
    todo = [i for i, prog in enumerate(programs) if prog is not None]
    results = run_programs([programs[i] for i in todo], timeout=timeout, workers=workers)
    passed = [False] * len(problems)
    for i, r in zip(todo, results):
        passed[i] = r.passed
    return passed


def score(problem: Problem, completion: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """pass@1 of one completion (one sandbox process; prefer ``score_batch`` for many)."""
    return score_batch([problem], [completion], timeout=timeout)[0]
