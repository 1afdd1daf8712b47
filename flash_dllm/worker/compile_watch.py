"""Counts what makes a step stall the first time something new comes: Triton kernel compiles
(a new specialisation of a kernel; loading one from Triton's on-disk cache counts too, it is
fast) and CUDA graph captures (``worker/graphs.py`` counts those itself).

``KERNEL_COMPILES`` is process-wide, as Triton's compile hooks are: ``install()`` chains two hooks
onto ``triton.knobs.runtime`` (``jit_cache_hook`` before a compile, ``jit_post_compile_hook``
after it), keeping any hooks already set. Where Triton has no such hooks (older versions, the
CPU interpreter never compiles) the counters stay at 0 and ``available`` is False.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("flash_dllm.compile")


class KernelCompiles:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.seconds = 0.0
        self.by_kernel: dict[str, int] = {}
        self._started: dict[tuple, float] = {}
        self.available = False
        # set when a server became ready: from then on every compile is logged (a warning
        # naming the kernel and its specialisation)
        self.ready = False

    def install(self) -> bool:
        """Hook Triton's compiles (once per process); False when this Triton has no hooks."""
        with self._lock:
            if self.available:
                return True
            try:
                from triton import knobs
                rt = knobs.runtime
                prev_start, prev_end = rt.jit_cache_hook, rt.jit_post_compile_hook
            except (ImportError, AttributeError):
                return False

            def on_start(*args, **kw):
                self.started(kw.get("key"))
                # NOTE: a true value from this hook would skip the compile: pass on the
                # previous hook's answer, never our own
                return prev_start(*args, **kw) if prev_start is not None else None

            def on_end(*args, **kw):
                self.finished(kw.get("key"), _kernel_name(kw), str(kw.get("repr", "")))
                return prev_end(*args, **kw) if prev_end is not None else None

            rt.jit_cache_hook = on_start
            rt.jit_post_compile_hook = on_end
            self.available = True
            return True

    def started(self, key) -> None:
        with self._lock:
            self._started[_hashable(key)] = time.perf_counter()

    def finished(self, key, name: str, signature: str = "") -> None:
        with self._lock:
            t0 = self._started.pop(_hashable(key), None)
            dt = 0.0 if t0 is None else time.perf_counter() - t0
            self.count += 1
            self.seconds += dt
            self.by_kernel[name] = self.by_kernel.get(name, 0) + 1
            late = self.ready
        if late:
            log.warning("kernel %s compiled after ready (%.2f s): %s", name, dt,
                        signature or "(no signature)")

    def snapshot(self) -> dict:
        with self._lock:
            return {"compiles": self.count, "compile_seconds": self.seconds,
                    "by_kernel": dict(self.by_kernel), "available": self.available}


def _hashable(key):
    try:
        hash(key)
        return key
    except TypeError:
        return repr(key)


def _kernel_name(kw: dict) -> str:
    fn = kw.get("fn")
    inner = getattr(fn, "fn", None)              # JitFunctionInfo.fn / JITFunction.fn
    name = getattr(fn, "name", None) or getattr(inner, "__name__", None)
    return str(name or "kernel")


KERNEL_COMPILES = KernelCompiles()


def graph_counts(runner) -> dict:
    """CUDA graph captures and replays of a runner's two capture modes, and its eager steps."""
    out = {"graph_captures": 0, "graph_replays": 0, "eager_forwards": 0}
    fg = getattr(runner, "forward_graphs", None)
    if fg is not None:
        for k in out:
            out[k] += fg.stats.get(k, 0)
    sg = getattr(runner, "fused", None)
    if sg is not None:
        out["graph_captures"] += sg.stats.get("fused_captures", 0)
        out["graph_replays"] += sg.stats.get("fused_replays", 0)
    return out


def runtime_counts(engine) -> dict:
    """Kernel compiles (process-wide) and the engine runner's graph counters, now."""
    runner = getattr(engine, "runner", None)
    out = graph_counts(runner) if runner is not None else {}
    out["kernel_compiles"] = KERNEL_COMPILES.snapshot()["compiles"]
    return out
