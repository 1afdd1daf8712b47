"""The end of a disaggregated worker process, as the router sees it: reap it (no zombie), say
how it ended (exit code or signal), log it once.

The router (``disagg/router.py``) notices a lost worker (its process exited, or its control
connection broke) and calls ``reap`` then ``log_lost``; the stats snapshot carries the exit code,
so ``/health`` and ``/metrics`` show it.
"""
from __future__ import annotations

import logging
import signal
import subprocess

REAP_WAIT_S = 2.0        # a worker whose connection broke gets this long to exit, then is killed

log = logging.getLogger("flash_dllm.disagg")


def reap(proc) -> int | None:
    """Wait for a lost worker's process (``Popen``); one that does not exit within
    ``REAP_WAIT_S`` (its control connection broke, yet it runs) is killed: nothing can reach
    it. Its return code (None if even the kill did not end it)."""
    try:
        return proc.wait(timeout=REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            return proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None


def exit_text(code: int | None) -> str:
    """``Popen.returncode`` in words: "exited with code 1", "was killed by SIGKILL"."""
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def log_lost(rank: int, role: str, pid: int | None, why: str, exit_code: int | None,
             left: int) -> None:
    """One WARNING line: the worker, its role, why it was lost and how its process ended, and
    how many live workers its role has left."""
    how = "" if why.startswith("its process") else f"; its process {exit_text(exit_code)}"
    log.warning("disaggregated worker %d (%s, pid %s) lost: %s%s; the router sends it nothing "
                "more (%d live %s worker%s left)", rank, role, pid, why, how, left, role,
                "" if left == 1 else "s")
