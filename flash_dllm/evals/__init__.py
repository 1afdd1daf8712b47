"""Offline evaluation suites for the self-trained demo dLLM (char-level tokenizer).

``SUITES["arith"]`` (GSM8K-like word problems, exact match after ``####``) and ``SUITES["code"]``
(HumanEval-like one-line functions, pass@1 in a subprocess sandbox) share one interface; see
``tasks.Suite``. Train and test questions are disjoint by a hash of the question text.
"""
from flash_dllm.evals.problem import (CHARSET, MAX_ANSWER_CHARS, MAX_PROMPT_CHARS, Problem,
                                      format_prompt, split_of)
from flash_dllm.evals.tasks import SUITES, Suite, get_suite

__all__ = ["CHARSET", "MAX_ANSWER_CHARS", "MAX_PROMPT_CHARS", "Problem", "SUITES", "Suite",
           "format_prompt", "get_suite", "split_of"]
