"""Run untrusted Python programs out of process, with a wall-clock limit and rlimits, in bulk."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_WORKER = Path(__file__).with_name("_sandbox_worker.py")

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MEMORY_MB = 1024


@dataclass(frozen=True)
class SandboxResult:
    status: str   # "passed" | "failed" | "timeout" | "error" (the worker itself broke)
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_programs(programs: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT_S,
                 memory_mb: int = DEFAULT_MEMORY_MB, workers: int | None = None
                 ) -> list[SandboxResult]:
    """Run each program in its own forked process; a program passes if it runs to the end.

    Args:
        programs: complete Python sources (solution followed by its asserts).
        timeout: wall-clock seconds per program; over it the process group is SIGKILLed.
        memory_mb: address-space limit per program.
        workers: programs in flight at once (default: CPU count, at least 2).

    NOTE: nothing here runs in the calling process. One worker interpreter (``_sandbox_worker.py``,
    started with ``-I -S``: no site, no user paths, no PYTHON* env) forks a child per program, so a
    segfault, ``while True``, or a 10 GB list costs one failed sample, never the engine.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if memory_mb <= 0:
        raise ValueError(f"memory_mb must be > 0, got {memory_mb}")
    if not programs:
        return []
    workers = max(1, workers if workers is not None else max(2, os.cpu_count() or 1))
    workers = min(workers, len(programs))
    # Backstop for a broken worker: every wave of programs timing out, plus interpreter start.
    guard_s = math.ceil(len(programs) / workers) * (timeout + 0.5) + 30.0
    payload = "".join(json.dumps(p) + "\n" for p in programs)
    cmd = [sys.executable, "-I", "-S", str(_WORKER), str(workers), repr(float(timeout)),
           str(int(memory_mb))]
    with tempfile.TemporaryDirectory(prefix="flash_dllm_eval_") as scratch:
        try:
            proc = subprocess.run(cmd, input=payload.encode("utf-8", "surrogatepass"),
                                  capture_output=True, timeout=guard_s, cwd=scratch,
                                  env={"PATH": os.environ.get("PATH", "")})
            out, err = proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            out, err = e.stdout or b"", b"worker exceeded its guard time"
    results: list[SandboxResult | None] = [None] * len(programs)
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
            results[int(rec["i"])] = SandboxResult(str(rec["status"]), str(rec["detail"]))
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    missing = SandboxResult("error", err.decode("utf-8", "replace")[-300:] or "no result")
    return [r if r is not None else missing for r in results]


def run_program(program: str, *, timeout: float = DEFAULT_TIMEOUT_S,
                memory_mb: int = DEFAULT_MEMORY_MB) -> SandboxResult:
    """``run_programs`` for one program."""
    return run_programs([program], timeout=timeout, memory_mb=memory_mb)[0]
