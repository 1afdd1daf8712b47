"""Offline data for the local lm-eval tasks: ``arith.jsonl`` beside this file (held-out problems
of ``flash_dllm.evals`` arith suite that the shipped demo model answers; ``choices`` holds the
worked answer with its final number and two wrong final numbers, ``label`` the right one).

lm-eval resolves ``data_files`` against the working directory, so the YAMLs load the data through
``custom_dataset`` and this function, which resolves it against this file."""
from __future__ import annotations

import json
from pathlib import Path


def load_arith(**_metadata):
    import datasets

    rows = [json.loads(line) for line in
            (Path(__file__).parent / "arith.jsonl").read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
