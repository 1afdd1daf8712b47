"""Problem record, character set, length budgets and the hash-based train/test split of suites."""
from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass, field
from typing import Callable

# NOTE: the demo tokenizer is character level, so this string *is* its vocabulary (minus specials).
# Every prompt and answer of every suite uses only these characters (tests check it): printable
# ASCII (0x20..0x7e) plus newline; no tab, no carriage return.
CHARSET: str = string.digits + string.ascii_letters + string.punctuation + " \n"

# A tiny model generates the answer into a 64-slot canvas; the prompt budget keeps CPU eval fast.
MAX_PROMPT_CHARS = 90
MAX_ANSWER_CHARS = 60

# 1 in TEST_MODULUS question texts (by hash) is held out for test, whatever the seed.
TEST_MODULUS = 10


@dataclass(frozen=True)
class Problem:
    """One task instance: the model sees ``prompt`` and is trained to emit ``answer``.

    ``meta`` holds suite-specific facts the scorer needs (final integer, hidden unit tests, ...);
    it is excluded from hashing because dicts are unhashable.
    """

    id: str
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict, hash=False)


def format_prompt(question: str) -> str:
    """The model input for a question: the newline marks where the answer begins."""
    return question + "\n"


def split_of(question: str) -> str:
    """'test' or 'train', decided by a stable hash of the question text alone.

    Python's ``hash`` is salted per process, so sha256 is used: membership never depends on the
    seed, the process, or the draw order, hence no test question can ever reach training data.
    """
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_MODULUS == 0 else "train"


def problem_id(suite: str, question: str) -> str:
    return f"{suite}-{hashlib.sha256(question.encode('utf-8')).hexdigest()[:12]}"


def sample_split(make: Callable[[random.Random], Problem], suite: str, split: str, n: int,
                 seed: int, *, unique: bool) -> list[Problem]:
    """Draw problems from ``make`` until ``n`` of them fall in ``split``.

    ``unique`` drops repeats (test sets: every question scored once); training sets keep them
    because a long training run may ask for more samples than a suite has distinct questions.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # NOTE: a string seed is hashed with sha512 by ``random`` (not salted), so streams are stable
    # across processes; mixing in suite and split keeps the two splits' streams unrelated.
    rng = random.Random(f"{suite}:{split}:{seed}")
    out: list[Problem] = []
    seen: set[str] = set()
    # A draw lands in test ~1/TEST_MODULUS of the time; the cap turns an exhausted space into an
    # error instead of a hang.
    budget = 1000 + 200 * TEST_MODULUS * n
    while len(out) < n:
        budget -= 1
        if budget < 0:
            raise ValueError(f"{suite}: could not draw {n} {'distinct ' if unique else ''}"
                             f"{split} problems; the template space is too small")
        p = make(rng)
        # NOTE: a suite whose question text varies only cosmetically (code-long: names) sets
        # meta["split_key"] to what the problem really is, so a renamed copy of a test problem
        # can never be a training problem
        if split_of(p.meta.get("split_key", p.meta["question"])) != split:
            continue
        if unique:
            if p.prompt in seen:
                continue
            seen.add(p.prompt)
        out.append(p)
    return out
