"""Fork-per-sample runner for untrusted Python, started by ``sandbox.run_programs`` as a process.

Usage: ``python -I -S _sandbox_worker.py CONCURRENCY TIMEOUT_S MEMORY_MB`` with one JSON string
(a program) per stdin line; prints one JSON object per program, ``{"i", "status", "detail"}``.

NOTE: this file runs in a fresh interpreter and must import nothing from flash_dllm. Forking from a
small warm interpreter costs ~1 ms per sample where a cold ``python`` costs ~70 ms, which is what
makes hundreds of samples score in seconds. It isolates the engine from crashes, hangs and memory
blowups; it is not a security boundary against hostile code.
"""
import json
import math
import os
import signal
import sys
import time

try:
    import resource
except ImportError:  # pragma: no cover - non-Unix: run without rlimits
    resource = None

try:  # Linux: children die with the worker even if the worker itself is killed.
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    _PR_SET_PDEATHSIG = 1
except (ImportError, OSError):  # pragma: no cover
    _libc = None

OK = b"__ok__"


def _set_limits(timeout, memory_mb):
    if resource is None:
        return
    limits = (
        ("RLIMIT_AS", memory_mb << 20),               # address space: a runaway list dies fast
        ("RLIMIT_CPU", int(math.ceil(timeout)) + 1),  # CPU seconds: backstop for the wall timer
        ("RLIMIT_FSIZE", 1 << 20),                    # no multi-GB files in the scratch dir
        ("RLIMIT_CORE", 0),
    )
    for name, value in limits:
        lim = getattr(resource, name, None)
        if lim is None:
            continue
        try:
            _, hard = resource.getrlimit(lim)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(lim, (value, value))
        except (ValueError, OSError):
            pass


def _child(program, w, timeout, memory_mb):
    """Runs in the forked child: never returns."""
    try:
        os.setsid()  # own process group, so the worker can kill grandchildren too
        if _libc is not None:
            _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        _set_limits(timeout, memory_mb)
        try:
            exec(compile(program, "<sample>", "exec"), {"__name__": "__main__"})
            msg = OK
        except BaseException as e:  # noqa: BLE001 - SystemExit at def time is a failure too
            try:
                msg = f"{type(e).__name__}: {e}"[:300].encode("utf-8", "replace")
            except BaseException:  # noqa: BLE001
                msg = b"exception"
        # NOTE: success is the OK token on the pipe, not the exit status: a sample that calls
        # os._exit(0) before the asserts run must not pass.
        os.write(w, msg)
    finally:
        os._exit(0)


def _finish(pid, status, r, timed_out):
    os.set_blocking(r, False)
    try:
        data = os.read(r, 4096)
    except (BlockingIOError, OSError):
        data = b""
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)  # stragglers the sample forked
    except (ProcessLookupError, PermissionError):
        pass
    if timed_out:
        return "timeout", "killed at the time limit"
    if data == OK:
        return "passed", ""
    if data:
        return "failed", data.decode("utf-8", "replace")
    if os.WIFSIGNALED(status):
        return "failed", f"killed by signal {os.WTERMSIG(status)}"
    return "failed", "exited without finishing"


def main():
    concurrency, timeout, memory_mb = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    programs = [json.loads(line) for line in sys.stdin if line.strip()]
    running = {}  # pid -> (index, deadline, read end of the result pipe)
    nxt = 0
    delay = 0.0005

    def emit(i, status, detail):
        sys.stdout.write(json.dumps({"i": i, "status": status, "detail": detail}) + "\n")
        sys.stdout.flush()

    while nxt < len(programs) or running:
        while nxt < len(programs) and len(running) < concurrency:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(programs[nxt], w, timeout, memory_mb)
            os.close(w)
            running[pid] = (nxt, time.monotonic() + timeout, r)
            nxt += 1
        progressed = False
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in running:
                i, _, r = running.pop(pid)
                emit(i, *_finish(pid, status, r, timed_out=False))
                progressed = True
        now = time.monotonic()
        for pid, (i, deadline, r) in list(running.items()):
            if now >= deadline:
                # The plain kill covers a child that has not reached setsid() yet.
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                _, status = os.waitpid(pid, 0)
                del running[pid]
                emit(i, *_finish(pid, status, r, timed_out=True))
                progressed = True
        # Back off while long samples run; a fresh batch of short ones is polled every 0.5 ms.
        delay = 0.0005 if progressed else min(delay * 2, 0.02)
        if running and not progressed:
            time.sleep(delay)


if __name__ == "__main__":
    main()
