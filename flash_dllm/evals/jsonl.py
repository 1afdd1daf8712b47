"""``--suite jsonl``: a user's own question/answer file as an eval suite.

One JSON object per line; the question and the gold answer are read from named fields. A
completion is right when the answer extracted from it equals the gold answer:

- ``answer_regex`` given: its first match in the completion (the first capture group when the
  pattern has one), like lm-eval's "strict-match"; no match is a miss;
- otherwise: the last number in the completion when the gold answer is a number (lm-eval's
  "flexible-extract"), else the whole completion.

``gold_regex`` does the same to the gold field (GSM8K's answers end in ``#### 72``). Numbers
compare as numbers (``1,000`` == ``1000.0``; a leading ``$`` is dropped); text compares after
stripping surrounding white space.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Sequence

from flash_dllm.evals.problem import Problem, format_prompt

SUITE = "jsonl"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


def _number(text: str) -> Decimal | None:
    """``text`` as a number (commas, a leading ``$`` and a trailing ``.`` allowed), else None."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not t:
        return None
    try:
        value = Decimal(t)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def _extract(pattern: re.Pattern | None, text: str, numeric: bool) -> str | None:
    if pattern is not None:
        m = pattern.search(text)
        if m is None:
            return None
        return m.group(1) if pattern.groups else m.group(0)
    if numeric:
        found = _NUMBER.findall(text)
        return found[-1] if found else None
    return text


def compile_regex(pattern: str | None, flag: str) -> re.Pattern | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{flag} {pattern!r} is not a valid regular expression: {e}") from None


@dataclass(frozen=True)
class JsonlSpec:
    path: str
    question_field: str = "question"
    answer_field: str = "answer"
    answer_regex: str | None = None
    gold_regex: str | None = None


def load_problems(spec: JsonlSpec, n: int | None = None) -> list[Problem]:
    """The first ``n`` (all when None) problems of the file; a bad line is a ``ValueError``
    naming the file, the line and what is wrong with it."""
    path = Path(spec.path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    gold_re = compile_regex(spec.gold_regex, "--gold-regex")
    compile_regex(spec.answer_regex, "--answer-regex")
    problems: list[Problem] = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if n is not None and len(problems) >= n:
                    break
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") \
                        from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: a line must be a JSON object, got "
                                     f"{type(row).__name__}")
                for name, flag in ((spec.question_field, "--question-field"),
                                   (spec.answer_field, "--answer-field")):
                    if name not in row:
                        raise ValueError(f"{where}: no field {name!r} ({flag}); the line has "
                                         f"{sorted(row)}")
                question, gold = row[spec.question_field], row[spec.answer_field]
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{where}: field {spec.question_field!r} must be a "
                                     "non-empty string")
                if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
                    raise ValueError(f"{where}: field {spec.answer_field!r} must be a string "
                                     f"or a number, got {type(gold).__name__}")
                gold = str(gold)
                target = _extract(gold_re, gold, numeric=False)
                if target is None:
                    raise ValueError(f"{where}: --gold-regex {spec.gold_regex!r} does not match "
                                     f"the answer {gold[:80]!r}")
                problems.append(Problem(id=f"{path.name}:{lineno}",
                                        prompt=format_prompt(question), answer=gold,
                                        meta={"question": question, "target": target.strip(),
                                              "line": lineno}))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text (byte 0x{e.object[e.start]:02x})") \
                from None
    if not problems:
        raise ValueError(f"--data {path} holds no problems (one JSON object per line)")
    return problems


def score(problem: Problem, completion: str, answer_regex: re.Pattern | None = None) -> bool:
    """The completion's extracted answer against the problem's target; never raises."""
    try:
        target = problem.meta["target"]
        want = _number(target)
        got = _extract(answer_regex, completion, numeric=want is not None)
        if got is None:
            return False
        if want is not None:
            have = _number(got)
            return have is not None and have == want
        return got.strip() == target
    except Exception:  # noqa: BLE001 - a scorer turns malformed input into a miss
        return False


def make_suite(spec: JsonlSpec, problems: list[Problem] | None = None):
    """A ``tasks.Suite`` over the file (test problems only: a user's file is never trained on);
    ``problems``: the file already read with ``load_problems`` (it is not read again)."""
    from flash_dllm.evals.tasks import Suite

    answer_re = compile_regex(spec.answer_regex, "--answer-regex")
    loaded = problems

    def test_problems(n: int | None = None, seed: int = 0) -> list[Problem]:
        del seed                               # the file's order is kept
        if loaded is None:
            return load_problems(spec, n)
        return list(loaded if n is None else loaded[:n])

    def train_problems(n: int, seed: int) -> list[Problem]:
        raise ValueError("the jsonl suite is for evaluation only")

    def score_batch(problems: Sequence[Problem], completions: Sequence[str], **_) -> list[bool]:
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        return [score(p, c, answer_re) for p, c in zip(problems, completions)]

    return Suite(name=SUITE, train_problems=train_problems, test_problems=test_problems,
                 score=lambda p, c: score(p, c, answer_re), score_batch=score_batch)
