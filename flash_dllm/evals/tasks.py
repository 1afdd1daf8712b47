"""Registry of evaluation suites: every suite is used through the same ``Suite`` record."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from flash_dllm.evals import arith, chain, code, code_long
from flash_dllm.evals.problem import Problem, format_prompt


@dataclass(frozen=True)
class Suite:
    """One task family. Train on ``p.prompt -> p.answer``; evaluate with ``score_batch``.

    ``score_batch(problems, completions, *, timeout=5.0, workers=None) -> list[bool]`` has the same
    signature for every suite (arith ignores the sandbox knobs).
    """

    name: str
    train_problems: Callable[[int, int], list[Problem]]
    test_problems: Callable[..., list[Problem]]
    score: Callable[[Problem, str], bool]
    score_batch: Callable[..., list[bool]]
    format_prompt: Callable[[str], str] = format_prompt
    gen_length: int = 64  # the default canvas (``--max-tokens``) its answers are made for

    def accuracy(self, problems: Sequence[Problem], completions: Sequence[str], **kw) -> float:
        """Fraction of completions that pass; 0.0 for an empty set."""
        ok = self.score_batch(problems, completions, **kw)
        return sum(ok) / len(ok) if ok else 0.0


# NOTE: arith and code fit the demo model's 64-slot canvas; chain and code-long are the proxy
# models' long-answer suites (~80-260 BPE tokens), decoded into 256 slots by default.
SUITES: dict[str, Suite] = {
    m.SUITE: Suite(name=m.SUITE, train_problems=m.train_problems, test_problems=m.test_problems,
                   score=m.score, score_batch=m.score_batch, gen_length=gen_length)
    for m, gen_length in ((arith, 64), (code, 64), (chain, 256), (code_long, 256))
}
SHORT_SUITES = tuple(n for n, s in SUITES.items() if s.gen_length <= 64)
LONG_SUITES = tuple(n for n, s in SUITES.items() if s.gen_length > 64)


def get_suite(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise KeyError(f"unknown eval suite {name!r}; known: {sorted(SUITES)}") from None
