"""Load generators and benchmarks (`flash-dllm bench ...`)."""
from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, path: str | None) -> bool:
    """Write a benchmark's JSON report to ``path`` (folders made as needed); False when no path
    was given."""
    if not path:
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return True
