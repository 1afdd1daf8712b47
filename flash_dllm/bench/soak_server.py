"""The soak's servers (``bench/soak.py``): a real ``flash-dllm serve`` subprocess each, its
/metrics parsed, its RSS (with its worker processes'), its disaggregated workers found by their
command line, and the disk tier's file corrupted under it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from flash_dllm.cache.disk_format import ALIGN, HEADER_BYTES, MAGIC


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m flash_dllm serve --port P *flags`` with its output in ``workdir/<name>.log``."""

    def __init__(self, name: str, flags: list[str], workdir: Path):
        self.name, self.flags, self.port = name, flags, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self, timeout: float = 300.0) -> None:
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "flash_dllm", "serve", "--port", str(self.port),
               "--log-level", "warning", *self.flags]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited ({self.proc.returncode}) before "
                                   f"ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    self.ready_s = round(time.monotonic() - t0, 2)
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server {self.name} not ready after {timeout:.0f} s:\n"
                           f"{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed ``name{labels}`` as the exposition writes it."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def quiesce(self, timeout: float = 60.0) -> dict[str, float]:
        """/metrics once nothing runs or waits (the engine publishes its snapshot when idle)."""
        t0 = time.monotonic()
        while True:
            m = self.metrics()
            idle = (m.get("flash_dllm_requests_running", 0) == 0
                    and m.get("flash_dllm_requests_waiting", 0) == 0)
            if idle or time.monotonic() - t0 > timeout:
                time.sleep(0.6)              # one more publish period
                return self.metrics()
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """The server and every process under it."""
        if self.proc is None:
            return []
        out, frontier = [self.proc.pid], [self.proc.pid]
        kids: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d.name))
        while frontier:
            frontier = [c for p in frontier for c in kids.get(p, [])]
            out += frontier
        return out

    def rss_bytes(self) -> int:
        total = 0
        for pid in self.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def workers(self) -> list[int]:
        """Disaggregated worker pids in rank order (spawned one after another: ascending start
        time), read from their command lines."""
        found = []
        for pid in self.pids()[1:]:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                start = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
            except (OSError, IndexError, ValueError):
                continue
            if b"flash_dllm.distributed.launch" in cmd:
                found.append((start, pid))
        return [pid for _, pid in sorted(found)]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 60 s; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(60) is None:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def corrupt_disk_records(path: Path) -> int:
    """Flip 8 payload bytes of every record in the disk tier's file (a 4 KiB-aligned slot that
    starts with the record magic), on disk under the live server; the number corrupted."""
    n = 0
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        for off in range(ALIGN, size, ALIGN):
            if os.pread(fd, len(MAGIC), off) != MAGIC:
                continue
            at = off + HEADER_BYTES + 64
            os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 8, at)), at)
            n += 1
        os.fsync(fd)
    finally:
        os.close(fd)
    return n
