"""Long-answer multi-step word problems (GSM8K-like chains) for the proxy models.

A person starts with some things, then 4 to 7 events change the count (buying more, giving some
away, buying packs, doubling, halving, handing some to each of several friends). The answer is a
worked solution in varied natural phrasing, one or two sentences per event, each with its
arithmetic written out (``23 + 14 = 37``), then the final count after ``####``:

    Mia starts with 23 marbles. She buys 14 more, so she has 23 + 14 = 37 marbles. Each of the
    3 boxes holds 6 marbles, so that is 3 * 6 = 18 marbles. Now she has 37 + 18 = 55 marbles. ...
    The answer is 46.
    #### 46

Phrasing is drawn independently for every sentence, so the model cannot know a later sentence's
words before it has written the earlier ones: like a real model's answer, and unlike the demo's
fixed ``12+7=19.`` steps, a block cannot be committed in one or two forwards. Answers run 79-264
tokens of the proxies' BPE tokenizer (median 155; 0.2 % exceed the 256-slot canvas and cannot
score). Scoring: exact match of the integer after the LAST ``####`` (the arith suite's
extractor); every intermediate count stays in 0..999.
"""
from __future__ import annotations

import random
from typing import Callable

# NOTE: scored exactly like arith (the integer after the last ####): its scorers are this suite's
from flash_dllm.evals.arith import _PEOPLE, extract_final, score, score_batch
from flash_dllm.evals.problem import Problem, format_prompt, problem_id, sample_split

SUITE = "chain"
MIN_EVENTS, MAX_EVENTS = 4, 7
MAX_VALUE = 999

_THINGS = ("marbles", "stickers", "apples", "coins", "shells", "cards", "books", "pencils",
           "stamps", "beads", "cookies", "toy cars", "seeds", "buttons", "rocks", "ribbons")
_PACKS = ("bags", "boxes", "packs", "jars", "crates", "tins")
_GAIN = (("buys", "bought", "buying"), ("finds", "found", "finding"), ("wins", "won", "winning"),
         ("gets", "got", "getting"), ("picks up", "picked up", "picking up"))
_LOSS = (("gives away", "gave away", "giving away"), ("sells", "sold", "selling"),
         ("loses", "lost", "losing"), ("trades away", "traded away", "trading away"))
_LINKS = ("Then", "Next", "After that", "Later", "The next day")


class _Story:
    """The state of one problem while its events are drawn: question parts and answer parts."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.name, self.P, _ = rng.choice(_PEOPLE)
        self.p = self.P.lower()
        self.pos = "her" if self.P == "She" else "his"
        self.o = rng.choice(_THINGS)
        self.v = rng.randint(5, 60)
        self.q: list[str] = [f"{self.name} has {self.v} {self.o}."]
        start = rng.choice((f"{self.name} starts with {self.v} {self.o}.",
                            f"At first {self.name} has {self.v} {self.o}.",
                            f"{self.name} begins with {self.v} {self.o}."))
        self.a: list[str] = [start]

    def say(self, *phrasings: str) -> None:
        self.a.append(self.rng.choice(phrasings))

    def link(self, first: bool) -> str:
        return self.P if first else f"{self.rng.choice(_LINKS)} {self.p}"


def _gain(s: _Story, first: bool) -> bool:
    b = s.rng.randint(1, 30)
    if s.v + b > MAX_VALUE:
        return False
    now, past, ing = s.rng.choice(_GAIN)
    s.q.append(f"{s.link(first)} {now} {b} more.")
    v, r, o, p, P = s.v, s.v + b, s.o, s.p, s.P
    s.say(f"{P} {past} {b} more, so {p} has {v} + {b} = {r} {o}.",
          f"After {ing} {b} more, {p} has {v} + {b} = {r} {o}.",
          f"Adding the {b} new {o} gives {v} + {b} = {r}.",
          f"Now {s.name} has {v} + {b} = {r} {o}.")
    s.v = r
    return True


def _loss(s: _Story, first: bool) -> bool:
    if s.v < 2:
        return False
    c = s.rng.randint(1, min(30, s.v - 1))
    now, past, ing = s.rng.choice(_LOSS)
    s.q.append(f"{s.link(first)} {now} {c} of them.")
    v, r, o, p, P = s.v, s.v - c, s.o, s.p, s.P
    s.say(f"{P} {past} {c}, which leaves {v} - {c} = {r} {o}.",
          f"After {ing} {c}, {p} has {v} - {c} = {r} {o} left.",
          f"Taking away {c} leaves {v} - {c} = {r}.",
          f"So {s.name} is left with {v} - {c} = {r} {o}.")
    s.v = r
    return True


def _packs(s: _Story, first: bool) -> bool:
    k, m, box = s.rng.randint(2, 5), s.rng.randint(2, 9), s.rng.choice(_PACKS)
    if s.v + k * m > MAX_VALUE:
        return False
    s.q.append(f"{s.link(first)} buys {k} {box} with {m} {s.o} in each.")
    v, km, r, o, p = s.v, k * m, s.v + k * m, s.o, s.p
    s.say(f"Each of the {k} {box} has {m} {o}, so that is {k} * {m} = {km} {o}.",
          f"The {k} {box} hold {k} * {m} = {km} {o} in all.",
          f"{k} {box} of {m} make {k} * {m} = {km} {o}.")
    s.say(f"Now {p} has {v} + {km} = {r} {o}.",
          f"Adding them gives {v} + {km} = {r} {o}.",
          f"So {s.name} has {v} + {km} = {r}.")
    s.v = r
    return True


def _double(s: _Story, first: bool) -> bool:
    if s.v > 200:
        return False
    s.q.append(s.rng.choice((f"{s.link(first)} doubles {s.pos} {s.o}.",
                             f"{s.link(first)} gets as many {s.o} again.")))
    v, r, o, p = s.v, 2 * s.v, s.o, s.p
    s.say(f"Doubling gives {v} * 2 = {r} {o}.",
          f"Twice as many is {v} * 2 = {r}.",
          f"Now {p} has {v} * 2 = {r} {o}.")
    s.v = r
    return True


def _half(s: _Story, first: bool) -> bool:
    if s.v % 2 or s.v < 4:
        return False
    friend = s.rng.choice([n for n, _, _ in _PEOPLE if n != s.name])
    s.q.append(f"{s.link(first)} gives half of {s.pos} {s.o} to {friend}.")
    v, r, o, p = s.v, s.v // 2, s.o, s.p
    s.say(f"Half of {v} is {v} / 2 = {r}, so {p} keeps {r} {o}.",
          f"Giving half away leaves {v} / 2 = {r} {o}.",
          f"{friend} gets {v} / 2 = {r}, and {s.name} keeps the other {r}.")
    s.v = r
    return True


def _each_friend(s: _Story, first: bool) -> bool:
    n, k = s.rng.randint(2, 5), s.rng.randint(2, 6)
    if n * k >= s.v:
        return False
    s.q.append(f"{s.link(first)} gives {k} {s.o} to each of {n} friends.")
    v, t, r, o, p = s.v, n * k, s.v - n * k, s.o, s.p
    s.say(f"The {n} friends get {k} each, which is {n} * {k} = {t} {o}.",
          f"{p.capitalize()} gives away {n} * {k} = {t} {o} in all.",
          f"That is {n} * {k} = {t} {o} for the friends.")
    s.say(f"So {p} has {v} - {t} = {r} {o} left.",
          f"That leaves {v} - {t} = {r}.",
          f"Now {s.name} has {v} - {t} = {r} {o}.")
    s.v = r
    return True


EVENTS: dict[str, Callable[[_Story, bool], bool]] = {
    f.__name__.lstrip("_"): f for f in (_gain, _loss, _packs, _double, _half, _each_friend)}
_EVENT_NAMES = tuple(EVENTS)


def make_problem(rng: random.Random, n_events: int | None = None) -> Problem:
    """One random chain of ``n_events`` events (default: uniform in MIN_EVENTS..MAX_EVENTS)."""
    s = _Story(rng)
    n = n_events if n_events is not None else rng.randint(MIN_EVENTS, MAX_EVENTS)
    kinds: list[str] = []
    while len(kinds) < n:
        kind = rng.choice(_EVENT_NAMES)
        if EVENTS[kind](s, not kinds):
            kinds.append(kind)
    assert 0 <= s.v <= MAX_VALUE, s.v
    s.q.append(rng.choice((f"How many {s.o} does {s.name} have now?",
                           f"How many {s.o} does {s.p} have in the end?")))
    s.say(f"The answer is {s.v}.", f"{s.name} ends with {s.v} {s.o}.",
          f"So the final count is {s.v} {s.o}.")
    question = " ".join(s.q)
    answer = " ".join(s.a) + f"\n#### {s.v}"
    return Problem(id=problem_id(SUITE, question), prompt=format_prompt(question), answer=answer,
                   meta={"question": question, "template": "-".join(kinds), "final": s.v,
                         "events": len(kinds)})


def train_problems(n: int, seed: int) -> list[Problem]:
    """``n`` training problems (repeats allowed), never a test question."""
    return sample_split(make_problem, SUITE, "train", n, seed, unique=False)


def test_problems(n: int, seed: int = 0) -> list[Problem]:
    """``n`` distinct held-out problems; ``test_problems(k)`` is a prefix of ``test_problems(m>k)``.
    """
    return sample_split(make_problem, SUITE, "test", n, seed, unique=True)


__all__ = ["SUITE", "EVENTS", "make_problem", "train_problems", "test_problems", "score",
           "score_batch", "extract_final"]
