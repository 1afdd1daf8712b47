"""NIXL transport (optional: only when ``import nixl`` works; never a required dependency).

NIXL moves bytes one-sidedly: an initiator WRITEs from its registered memory into a peer's
registered memory (UCX: RDMA, NVLink, shared memory or TCP, whatever connects the two) and the peer
learns of it from a notification delivered after the data. ``send``/``recv`` map onto that with a
receiver-driven rendezvous over notifications (``kind`` byte + JSON):

    receiver  recv(src, out, tag)   -> R{tag, seq, addr, len, dev, mem} to src
    sender    poll: R arrived       -> WRITE local -> remote, notification D{tag, seq}
    receiver  poll: D arrived       -> done (F{tag, seq} from the sender: failed)

``seq`` counts a (peer, tag)'s transfers on each side, so the k-th send matches the k-th receive.
``cancel`` of a receive sends C: a sender that has not posted its WRITE yet fails its send and
answers A; one already posted completes, and its D settles the receiver. ``cancel`` of a send
before the WRITE sends F; after it, NIXL is asked to abort the request.

Setup, out of band: ``register`` the long-lived buffers (the staging buffer, the pack buffer)
*before* ``metadata()``, since a peer only sees regions registered when it loaded the metadata;
then ``add_peer(rank, peer_metadata)`` on both sides. A send from unregistered memory registers it
for the transfer and deregisters it after.
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from flash_dllm.distributed.transport import (TransferError, TransferHandle, TransferTimeout,
                                              Transport, as_bytes)

try:    # pragma: no cover - depends on the machine
    from nixl._api import nixl_agent, nixl_agent_config
    _NIXL_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 -- ImportError, or a broken native library
    nixl_agent = nixl_agent_config = None
    _NIXL_ERROR = e


def nixl_available() -> bool:
    return _NIXL_ERROR is None


@dataclass(eq=False)
class _Nx:
    seq: int
    xfer: Any = None            # nixl_xfer_handle once the WRITE is posted (send)
    temp_reg: Any = None        # registration made for this send only
    finished: bool = False      # nothing will touch the buffer any more


class NixlTransport(Transport):
    """One NIXL agent for ``rank`` of ``world_size``; peers join with ``add_peer``."""

    def __init__(self, rank: int, world_size: int, *, backends: tuple[str, ...] = ("UCX",),
                 name: str | None = None) -> None:
        if _NIXL_ERROR is not None:
            raise RuntimeError(f"NIXL is not available: {_NIXL_ERROR}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size must be an integer >= 2, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        self.rank, self.world_size = rank, world_size
        self.name = name or f"flash-dllm-r{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=list(backends)))
        self._peer_name: dict[int, str] = {}
        self._peer_rank: dict[str, int] = {}
        self._regions: list[tuple[int, int, Any]] = []        # (addr, nbytes, reg descs)
        self._seq: dict[tuple[str, int, int], int] = {}       # (op, peer, tag) -> next seq
        self._inbox: dict[tuple[int, bytes, int, int], dict] = {}
        self._hello: dict[int, bytes] = {}

    # ----------------------------------------------------------------------------- setup
    def register(self, tensor: torch.Tensor) -> None:
        """Register a long-lived contiguous buffer (before ``metadata()`` if peers write to it)."""
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous to be registered")
        descs = self.agent.register_memory(as_bytes(tensor))
        self._regions.append((tensor.data_ptr(), tensor.numel() * tensor.element_size(), descs))

    def metadata(self) -> bytes:
        """This agent's metadata, for the peers' ``add_peer``."""
        return self.agent.get_agent_metadata()

    def add_peer(self, rank: int, metadata: bytes) -> None:
        self._check_peer(rank, "rank")
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peer_name[rank], self._peer_rank[name] = name, rank

    def close(self) -> None:
        for name in list(self._peer_rank):
            self.agent.remove_remote_agent(name)
        for _, _, descs in self._regions:
            self.agent.deregister_memory(descs)
        self._regions.clear()
        self._peer_name.clear()
        self._peer_rank.clear()

    # --------------------------------------------------------------------------- messages
    def _notify(self, peer: int, kind: bytes, body: dict) -> None:
        self.agent.send_notif(self._name_of(peer), kind + json.dumps(body).encode())

    def _name_of(self, peer: int) -> str:
        name = self._peer_name.get(peer)
        if name is None:
            raise TransferError(f"rank {peer} is not a known peer: call add_peer({peer}, ...)")
        return name

    def _pump(self) -> None:
        for name, msgs in self.agent.get_new_notifs().items():
            name = name.decode() if isinstance(name, bytes) else str(name)
            peer = self._peer_rank.get(name)
            if peer is None:
                continue
            for m in msgs:
                kind, body = bytes(m[:1]), bytes(m[1:])
                if kind == b"H":
                    self._hello[peer] = body
                else:
                    msg = json.loads(body)
                    self._inbox[(peer, kind, msg["tag"], msg["seq"])] = msg

    def _take(self, h: TransferHandle, kind: bytes) -> dict | None:
        return self._inbox.pop((h.peer, kind, h.tag, h.impl.seq), None)

    def _registered(self, addr: int, nbytes: int) -> bool:
        return any(a <= addr and addr + nbytes <= a + n for a, n, _ in self._regions)

    def _next_seq(self, op: str, peer: int, tag: int) -> int:
        k = (op, peer, tag)
        self._seq[k] = self._seq.get(k, -1) + 1
        return self._seq[k]

    # --------------------------------------------------------------------------- transport
    def _start(self, h: TransferHandle) -> None:
        self._name_of(h.peer)
        addr = h.tensor.data_ptr()
        if h.op == "recv" and not self._registered(addr, h.nbytes):
            raise ValueError("out_tensor must lie in a registered buffer: register() the "
                             "staging buffer before exchanging metadata")
        h.impl = _Nx(self._next_seq(h.op, h.peer, h.tag))     # after every check: seqs match
        if h.op == "recv":
            dev = h.tensor.get_device()
            self._notify(h.peer, b"R", {"tag": h.tag, "seq": h.impl.seq, "addr": addr,
                                        "len": h.nbytes, "dev": max(dev, 0),
                                        "mem": "VRAM" if dev >= 0 else "DRAM"})

    def _poll(self, h: TransferHandle) -> bool:
        self._pump()
        nx: _Nx = h.impl
        if h.op == "recv":
            if self._take(h, b"D") is not None:
                nx.finished = True
                return True
            f = self._take(h, b"F")
            if f is not None:
                nx.finished = True
                raise TransferError(f"{h.describe()} failed on the sender: {f.get('why')}")
            return False
        if nx.xfer is None:
            if self._take(h, b"C") is not None:
                self._notify(h.peer, b"A", {"tag": h.tag, "seq": nx.seq})
                nx.finished = True
                raise TransferError(f"{h.describe()}: the receiver cancelled it")
            r = self._take(h, b"R")
            if r is None:
                return False
            self._post_write(h, r)
        state = self.agent.check_xfer_state(nx.xfer)
        if state == "PROC":
            return False
        self._finish_send(h)
        if state != "DONE":
            self._fail_send(h, f"NIXL reported {state}")
        return True

    def _post_write(self, h: TransferHandle, r: dict) -> None:
        nx: _Nx = h.impl
        if r["len"] != h.nbytes:
            self._fail_send(h, f"size mismatch: sender {h.nbytes} bytes, receiver {r['len']}")
        src = as_bytes(h.tensor)
        if not self._registered(src.data_ptr(), h.nbytes):
            nx.temp_reg = self.agent.register_memory(src)
        remote = self.agent.get_xfer_descs([(r["addr"], r["len"], r["dev"])], r["mem"])
        nx.xfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(src), remote,
                                             self._name_of(h.peer),
                                             b"D" + json.dumps({"tag": h.tag,
                                                                "seq": nx.seq}).encode())
        if self.agent.transfer(nx.xfer) == "ERR":
            self._finish_send(h)
            self._fail_send(h, "NIXL refused to post the WRITE")

    def _finish_send(self, h: TransferHandle) -> None:
        nx: _Nx = h.impl
        if nx.xfer is not None:
            self.agent.release_xfer_handle(nx.xfer)
        if nx.temp_reg is not None:
            self.agent.deregister_memory(nx.temp_reg)
            nx.temp_reg = None
        nx.finished = True

    def _fail_send(self, h: TransferHandle, why: str) -> None:
        h.impl.finished = True
        self._notify(h.peer, b"F", {"tag": h.tag, "seq": h.impl.seq, "why": why})
        raise TransferError(f"{h.describe()} failed: {why}")

    def _cancel(self, h: TransferHandle) -> None:
        nx: _Nx = h.impl
        if nx is None or nx.finished:
            return
        if h.op == "recv":
            self._notify(h.peer, b"C", {"tag": h.tag, "seq": nx.seq})
        elif nx.xfer is None:
            self._notify(h.peer, b"F", {"tag": h.tag, "seq": nx.seq, "why": "sender cancelled"})
            nx.finished = True

    def _settled(self, h: TransferHandle) -> bool:
        nx: _Nx = h.impl
        if nx is None or nx.finished:
            return True
        if h.op == "recv":
            self._pump()
            if any(self._take(h, k) is not None for k in (b"D", b"F", b"A")):
                nx.finished = True
        elif self.agent.check_xfer_state(nx.xfer) != "PROC":
            self._finish_send(h)
        return nx.finished

    def _exchange(self, peer: int, payload: bytes, timeout_s: float) -> bytes:
        self.agent.send_notif(self._name_of(peer), b"H" + payload)
        deadline = time.monotonic() + timeout_s
        while peer not in self._hello:
            if time.monotonic() > deadline:
                raise TransferTimeout(f"handshake with rank {peer}: no answer after "
                                      f"{timeout_s:.3g} s")
            self._pump()
            time.sleep(1e-4)
        return self._hello.pop(peer)

    def __repr__(self) -> str:
        return f"NixlTransport(name={self.name!r}, rank={self.rank}, peers={self._peer_name})"
