"""In-process transport for tests: endpoints of one ``FakeNetwork``, faults on demand.

A send and a receive with the same (src, dst, tag) are *matched* in posting order once both are
posted; a matched transfer completes after ``polls_to_complete`` polls (from either side) and then
copies the sender's bytes into the receiver's tensor (a size mismatch fails both sides, as gloo
does). Switches make the next N matched transfers, or every transfer with a tag, fail (both sides
raise ``TransferError``), hang (never complete: a ``wait`` ends in ``TransferTimeout``), or
arrive corrupted (``corrupt_tag``: done, with one byte flipped).

Cancelling a matched transfer fails the other side with ``TransferError`` and copies nothing, so a
cancelled handle is settled at once (stricter than gloo, where a posted receive cannot be taken
back; ``TorchDistTransport`` models that with ``settled``). Thread-safe: handshakes between two
endpoints of one process run in two threads.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from flash_dllm.distributed.transport import TransferError, TransferHandle, Transport, as_bytes

_OK, _FAIL, _HANG, _CORRUPT = "ok", "fail", "hang", "corrupt"


@dataclass(eq=False)
class _Wire:
    """A matched (send, recv) pair."""

    send: TransferHandle
    recv: TransferHandle
    polls_left: int
    fate: str
    state: str = "pending"      # pending | done | failed
    error: str = ""


class FakeNetwork:
    """Wires between ``world_size`` in-process endpoints (``endpoint(rank)``)."""

    def __init__(self, world_size: int = 2, polls_to_complete: int = 1) -> None:
        for name, v, lo in (("world_size", world_size, 2),
                            ("polls_to_complete", polls_to_complete, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.world_size = world_size
        self.polls_to_complete = polls_to_complete
        self._lock = threading.RLock()
        self._waiting: dict[tuple[str, int, int, int], deque[TransferHandle]] = {}
        self._fail_next = self._hang_next = 0
        self._fail_tags: set[int] = set()
        self._hang_tags: set[int] = set()
        self._corrupt_tags: set[int] = set()
        self.matched = 0            # transfers matched so far (for tests)
        self._endpoints = [FakeTransport(self, r) for r in range(world_size)]

    @classmethod
    def pair(cls, polls_to_complete: int = 1) -> tuple["FakeTransport", "FakeTransport"]:
        """Endpoints of ranks 0 and 1 of a fresh two-rank network."""
        net = cls(2, polls_to_complete)
        return net.endpoint(0), net.endpoint(1)

    def endpoint(self, rank: int) -> "FakeTransport":
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        return self._endpoints[rank]

    # ------------------------------------------------------------------------------- faults
    def fail_next(self, n: int = 1) -> None:
        """The next ``n`` transfers to be matched fail on both sides."""
        with self._lock:
            self._fail_next = self._check_count(n)

    def hang_next(self, n: int = 1) -> None:
        """The next ``n`` transfers to be matched never complete."""
        with self._lock:
            self._hang_next = self._check_count(n)

    def fail_tag(self, tag: int) -> None:
        """Every transfer with ``tag`` (matched from now on) fails."""
        with self._lock:
            self._fail_tags.add(tag)

    def hang_tag(self, tag: int) -> None:
        """Every transfer with ``tag`` (matched from now on) never completes."""
        with self._lock:
            self._hang_tags.add(tag)

    def corrupt_tag(self, tag: int) -> None:
        """Every transfer with ``tag`` (matched from now on) completes, with one byte flipped:
        what a torn or corrupted copy looks like to the receiver."""
        with self._lock:
            self._corrupt_tags.add(tag)

    def clear_faults(self) -> None:
        with self._lock:
            self._fail_next = self._hang_next = 0
            self._fail_tags.clear()
            self._hang_tags.clear()
            self._corrupt_tags.clear()

    @staticmethod
    def _check_count(n) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        return n

    # ---------------------------------------------------------------------------- matching
    def _post(self, src: int, h: TransferHandle) -> None:
        dst = h.peer if h.op == "send" else src
        src = src if h.op == "send" else h.peer
        other = "recv" if h.op == "send" else "send"
        with self._lock:
            queue = self._waiting.get((other, src, dst, h.tag))
            if not queue:
                self._waiting.setdefault((h.op, src, dst, h.tag), deque()).append(h)
                return
            peer_h = queue.popleft()
            s, r = (h, peer_h) if h.op == "send" else (peer_h, h)
            s.impl = r.impl = _Wire(s, r, self.polls_to_complete, self._fate(h.tag))
            self.matched += 1

    def _fate(self, tag: int) -> str:
        if self._fail_next:
            self._fail_next -= 1
            return _FAIL
        if self._hang_next:
            self._hang_next -= 1
            return _HANG
        if tag in self._fail_tags:
            return _FAIL
        if tag in self._hang_tags:
            return _HANG
        if tag in self._corrupt_tags:
            return _CORRUPT
        return _OK

    def _poll(self, h: TransferHandle) -> bool:
        with self._lock:
            w: _Wire | None = h.impl
            if w is None:
                return False                # not matched yet
            if w.state == "pending" and w.fate != _HANG:
                w.polls_left -= 1
                if w.polls_left <= 0:
                    self._complete(w)
            if w.state == "failed":
                raise TransferError(f"{h.describe()} failed: {w.error}")
            return w.state == "done"

    def _complete(self, w: _Wire) -> None:
        if w.fate == _FAIL:
            w.state, w.error = "failed", "injected failure"
        elif w.send.nbytes != w.recv.nbytes:
            w.state, w.error = "failed", (f"size mismatch: sender {w.send.nbytes} bytes, "
                                          f"receiver {w.recv.nbytes} bytes")
        else:
            as_bytes(w.recv.tensor).copy_(as_bytes(w.send.tensor))
            if w.fate == _CORRUPT and w.recv.nbytes:
                b = as_bytes(w.recv.tensor)
                b[b.numel() // 2] ^= 0x10
            w.state = "done"

    def _cancel(self, rank: int, h: TransferHandle) -> None:
        with self._lock:
            w: _Wire | None = h.impl
            if w is None:
                src, dst = (rank, h.peer) if h.op == "send" else (h.peer, rank)
                queue = self._waiting.get((h.op, src, dst, h.tag))
                if queue and h in queue:
                    queue.remove(h)
            elif w.state == "pending":
                w.state, w.error = "failed", f"rank {rank} cancelled it"


class FakeTransport(Transport):
    """One rank's endpoint of a ``FakeNetwork``; see the module docstring."""

    def __init__(self, network: FakeNetwork, rank: int) -> None:
        self.network = network
        self.rank = rank
        self.world_size = network.world_size

    def _start(self, handle: TransferHandle) -> None:
        self.network._post(self.rank, handle)

    def _poll(self, handle: TransferHandle) -> bool:
        return self.network._poll(handle)

    def _cancel(self, handle: TransferHandle) -> None:
        self.network._cancel(self.rank, handle)

    def __repr__(self) -> str:
        return f"FakeTransport(rank={self.rank}, world_size={self.world_size})"

