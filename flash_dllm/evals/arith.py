"""GSM8K-like multi-step arithmetic word problems, short enough for a tiny char-level dLLM.

Answer format: worked steps then the final integer, e.g. ``"12+7=19. 19-3=16. #### 16"``.
Scoring: exact match of the integer after the LAST ``####`` in the completion.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Sequence

from flash_dllm.evals.problem import (MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Problem, format_prompt,
                                      problem_id, sample_split)

SUITE = "arith"

# (name, subject pronoun, object pronoun); short names keep prompts inside the budget.
_PEOPLE = (
    ("Ann", "She", "her"), ("Bob", "He", "him"), ("Cara", "She", "her"), ("Dan", "He", "him"),
    ("Eve", "She", "her"), ("Finn", "He", "him"), ("Gia", "She", "her"), ("Hal", "He", "him"),
    ("Ivy", "She", "her"), ("Jon", "He", "him"), ("Kim", "She", "her"), ("Leo", "He", "him"),
    ("Mia", "She", "her"), ("Ned", "He", "him"), ("Ola", "She", "her"), ("Paul", "He", "him"),
    ("Rosa", "She", "her"), ("Sam", "He", "him"), ("Tess", "She", "her"), ("Omar", "He", "him"),
    ("Uma", "She", "her"), ("Vic", "He", "him"), ("Zoe", "She", "her"), ("Max", "He", "him"),
    ("Lily", "She", "her"), ("Raj", "He", "him"), ("Nia", "She", "her"), ("Ben", "He", "him"),
    ("Amy", "She", "her"), ("Tom", "He", "him"),
)
_THINGS = ("apples", "pens", "books", "cards", "coins", "eggs", "stamps", "shells", "marbles",
           "cookies", "beads", "rocks", "toys", "cups", "plums", "nuts", "bells", "keys", "pears",
           "socks", "stickers", "candles", "buttons", "pencils")
_PACKS = ("bags", "boxes", "packs", "jars", "cases", "crates")
_HOLDERS = ("jar", "box", "bag", "bin", "tin", "bowl", "crate")
_GAIN = ("buys", "finds", "gets", "wins", "picks up", "is given")
_LOSS = ("loses", "gives away", "sells", "drops", "trades", "uses")
_ITEMS = ("pen", "book", "toy", "cup", "cake", "kite", "ball", "hat", "mug", "card", "lamp", "map")
_DAILY = (("reads", "pages"), ("bakes", "cakes"), ("writes", "lines"), ("runs", "laps"),
          ("folds", "cranes"), ("paints", "cards"), ("swims", "laps"), ("sews", "patches"))
_DAYS = ("Monday", "Tuesday", "Friday", "Sunday")

Step = tuple[int, str, int, int]  # (left, op, right, result)


def _step(a: int, op: str, b: int) -> Step:
    r = {"+": a + b, "-": a - b, "*": a * b}[op]
    return (a, op, b, r)


def _people(rng: random.Random, k: int) -> list[tuple[str, str, str]]:
    return rng.sample(_PEOPLE, k)


# Each template draws its numbers, then returns (question, steps). Operands stay in 1..50 for +/-,
# multiplications are (2..9) x (2..12): small enough that a ~5M-param model can learn them.

def _gain_loss(rng):
    (n, P, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    a, b = rng.randint(2, 50), rng.randint(1, 50)
    c = rng.randint(1, min(50, a + b))
    q = (f"{n} has {a} {o}. {P} {rng.choice(_GAIN)} {b} more and {rng.choice(_LOSS)} {c}. "
         f"How many does {P.lower()} have?")
    s1 = _step(a, "+", b)
    return q, [s1, _step(s1[3], "-", c)]


def _loss_gain(rng):
    (n, P, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    a = rng.randint(2, 50)
    b, c = rng.randint(1, a), rng.randint(1, 50)
    q = (f"{n} has {a} {o}. {P} {rng.choice(_LOSS)} {b}, then {rng.choice(_GAIN)} {c} more. "
         f"How many {o} now?")
    s1 = _step(a, "-", b)
    return q, [s1, _step(s1[3], "+", c)]


def _packs_loss(rng):
    (n, P, _), o, box = _people(rng, 1)[0], rng.choice(_THINGS), rng.choice(_PACKS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, min(50, a * b))
    q = f"{n} buys {a} {box} of {b} {o}. {P} {rng.choice(_LOSS)} {c}. How many {o} are left?"
    s1 = _step(a, "*", b)
    return q, [s1, _step(s1[3], "-", c)]


def _more_than(rng):
    (n, _, _), (m, _, _) = _people(rng, 2)
    o = rng.choice(_THINGS)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    q = f"{n} has {a} {o}. {m} has {b} more than {n}. How many {o} do they have in all?"
    s1 = _step(a, "+", b)
    return q, [s1, _step(a, "+", s1[3])]


def _fewer_than(rng):
    (n, _, _), (m, _, _) = _people(rng, 2)
    o = rng.choice(_THINGS)
    a = rng.randint(2, 50)
    b = rng.randint(1, a - 1)
    q = f"{n} has {a} {o}. {m} has {b} fewer than {n}. How many {o} do they have in all?"
    s1 = _step(a, "-", b)
    return q, [s1, _step(a, "+", s1[3])]


def _times_as_many(rng):
    (n, _, _), (m, _, _) = _people(rng, 2)
    o = rng.choice(_THINGS)
    a, k = rng.randint(2, 12), rng.randint(2, 9)
    q = f"{n} has {a} {o}. {m} has {k} times as many. How many {o} do they have in all?"
    s1 = _step(a, "*", k)
    return q, [s1, _step(a, "+", s1[3])]


def _per_day(rng):
    (n, _, _), (verb, unit) = _people(rng, 1)[0], rng.choice(_DAILY)
    a, k, b = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 50)
    q = f"{n} {verb} {a} {unit} a day for {k} days, then {b} more. How many {unit} in all?"
    s1 = _step(a, "*", k)
    return q, [s1, _step(s1[3], "+", b)]


def _change(rng):
    (n, _, _), item = _people(rng, 1)[0], rng.choice(_ITEMS)
    a, k = rng.randint(2, 12), rng.randint(2, 9)
    pay = a * k + rng.randint(0, 50)
    q = f"A {item} costs {a} dollars. {n} buys {k} and pays {pay} dollars. What is the change?"
    s1 = _step(a, "*", k)
    return q, [s1, _step(pay, "-", s1[3])]


def _give_two(rng):
    (n, P, _), (m, _, _), (r, _, _) = _people(rng, 3)
    o = rng.choice(_THINGS)
    a = rng.randint(3, 50)
    b = rng.randint(1, a - 2)
    c = rng.randint(1, a - b)
    q = f"{n} had {a} {o}. {P} gave {b} to {m} and {c} to {r}. How many {o} are left?"
    s1 = _step(a, "-", b)
    return q, [s1, _step(s1[3], "-", c)]


def _two_days(rng):
    (n, P, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    d1, d2 = rng.sample(_DAYS, 2)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    c = rng.randint(1, min(50, a + b))
    q = f"{n} gets {a} {o} on {d1} and {b} on {d2}. {P} {rng.choice(_LOSS)} {c}. How many are left?"
    s1 = _step(a, "+", b)
    return q, [s1, _step(s1[3], "-", c)]


def _holder(rng):
    (n, _, _), o, h = _people(rng, 1)[0], rng.choice(_THINGS), rng.choice(_HOLDERS)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    c = rng.randint(1, min(50, a + b))
    q = f"A {h} has {a} {o}. {n} adds {b} more, then takes out {c}. How many are in the {h}?"
    s1 = _step(a, "+", b)
    return q, [s1, _step(s1[3], "-", c)]


def _packs_loose_loss(rng):
    (n, P, _), o, box = _people(rng, 1)[0], rng.choice(_THINGS), rng.choice(_PACKS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 50)
    d = rng.randint(1, min(50, a * b + c))
    q = (f"{n} has {a} {box} of {b} {o} and {c} more. {P} {rng.choice(_LOSS)} {d}. "
         "How many are left?")
    s1 = _step(a, "*", b)
    s2 = _step(s1[3], "+", c)
    return q, [s1, s2, _step(s2[3], "-", d)]


def _doubles(rng):
    (n, P, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    a = rng.randint(1, 50)
    b = rng.randint(1, min(50, 2 * a))
    q = f"{n} has {a} {o}. {P} doubles them, then {rng.choice(_LOSS)} {b}. How many {o} now?"
    s1 = _step(a, "*", 2)
    return q, [s1, _step(s1[3], "-", b)]


def _three_people(rng):
    (n, _, _), (m, _, _), (r, _, _) = _people(rng, 3)
    o = rng.choice(_THINGS)
    a, b, c = rng.randint(1, 50), rng.randint(1, 50), rng.randint(1, 50)
    q = f"{n} has {a} {o}, {m} has {b} and {r} has {c}. How many {o} do they have in all?"
    s1 = _step(a, "+", b)
    return q, [s1, _step(s1[3], "+", c)]


def _rows(rng):
    (n, _, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    place = rng.choice(("shelf", "tray", "table", "box", "wall"))
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, min(50, a * b))
    q = f"A {place} has {a} rows of {b} {o}. {n} takes {c}. How many {o} are left?"
    s1 = _step(a, "*", b)
    return q, [s1, _step(s1[3], "-", c)]


def _have_buy_packs(rng):
    (n, P, _), o, box = _people(rng, 1)[0], rng.choice(_THINGS), rng.choice(_PACKS)
    a, b, c = rng.randint(1, 50), rng.randint(2, 9), rng.randint(2, 12)
    q = f"{n} has {a} {o}. {P} buys {b} {box} of {c} more. How many {o} does {P.lower()} have?"
    s1 = _step(b, "*", c)
    return q, [s1, _step(a, "+", s1[3])]


def _friends_each(rng):
    (n, _, _), o = _people(rng, 1)[0], rng.choice(_THINGS)
    k, a, b = rng.randint(2, 9), rng.randint(2, 12), rng.randint(1, 50)
    q = f"{n} gives {k} friends {a} {o} each and keeps {b}. How many {o} at first?"
    s1 = _step(k, "*", a)
    return q, [s1, _step(s1[3], "+", b)]


def _gave_then_got(rng):
    (n, P, _), (m, _, _) = _people(rng, 2)
    o = rng.choice(_THINGS)
    a = rng.randint(2, 50)
    b = rng.randint(1, a)
    c = rng.randint(1, b)
    q = f"{n} has {a} {o}. {P} gives {m} {b}, and {m} gives back {c}. How many has {n} now?"
    s1 = _step(a, "-", b)
    return q, [s1, _step(s1[3], "+", c)]


TEMPLATES: dict[str, Callable[[random.Random], tuple[str, list[Step]]]] = {
    f.__name__.lstrip("_"): f for f in (
        _gain_loss, _loss_gain, _packs_loss, _more_than, _fewer_than, _times_as_many, _per_day,
        _change, _give_two, _two_days, _holder, _packs_loose_loss, _doubles, _three_people, _rows,
        _have_buy_packs, _friends_each, _gave_then_got)
}
_TEMPLATE_NAMES = tuple(TEMPLATES)


def format_answer(steps: Sequence[Step]) -> str:
    """``[(12,'+',7,19), (19,'-',3,16)]`` -> ``"12+7=19. 19-3=16. #### 16"``."""
    worked = " ".join(f"{a}{op}{b}={r}." for a, op, b, r in steps)
    return f"{worked} #### {steps[-1][3]}"


def make_problem(rng: random.Random) -> Problem:
    """One random problem from a random template; redraws the rare one over a length budget."""
    for _ in range(100):
        template = rng.choice(_TEMPLATE_NAMES)
        question, steps = TEMPLATES[template](rng)
        prompt, answer = format_prompt(question), format_answer(steps)
        if len(prompt) <= MAX_PROMPT_CHARS and len(answer) <= MAX_ANSWER_CHARS:
            break
    else:  # pragma: no cover - only a broken template gets here
        raise RuntimeError("arith templates keep overflowing the length budget")
    # NOTE: every intermediate is a non-negative integer < 1000, so the model never needs a sign.
    assert all(0 <= x < 1000 for s in steps for x in s if isinstance(x, int)), steps
    final = steps[-1][3]
    return Problem(id=problem_id(SUITE, question), prompt=prompt, answer=answer,
                   meta={"question": question, "template": template, "final": final})


def train_problems(n: int, seed: int) -> list[Problem]:
    """``n`` training problems (repeats allowed), never a test question."""
    return sample_split(make_problem, SUITE, "train", n, seed, unique=False)


def test_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct held-out problems; ``test_problems(k)`` is a prefix of ``test_problems(m>k)``.
    """
    return sample_split(make_problem, SUITE, "test", n, seed, unique=True)


_FINAL = re.compile(r"####\s*(-?\d+)")


def extract_final(completion: str) -> int | None:
    """The integer right after the last ``####``; None when there is none (early stop, garbage)."""
    if not isinstance(completion, str):
        return None
    pos = completion.rfind("####")
    if pos < 0:
        return None
    m = _FINAL.match(completion, pos)
    return int(m.group(1)) if m else None


def score(problem: Problem, completion: str) -> bool:
    """Exact match of the final integer; never raises."""
    try:
        got = extract_final(completion)
        return got is not None and got == int(problem.meta["final"])
    except Exception:  # noqa: BLE001 - a scorer must turn any malformed input into a miss
        return False


def score_batch(problems: Sequence[Problem], completions: Sequence[str], *, timeout: float = 5.0,
                workers: int | None = None) -> list[bool]:
    """``score`` per pair, in-process. ``timeout``/``workers`` are unused here; they exist so that
    every suite's ``score_batch`` has the code suite's signature."""
    del timeout, workers
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    return [score(p, c) for p, c in zip(problems, completions)]
