"""The one small interface every KV transfer between workers goes through.

Prefill/decode disaggregation moves a request's KV from a prefill worker to a decode worker as ONE
contiguous segment. The engine never talks to NCCL, gloo or NIXL directly; it posts a send or a
receive, polls it between steps, and gives up on it after a deadline:

    h = transport.recv(src, staging[off:off + n], tag)    # a slice the SegmentAllocator gave
    try:
        transport.wait(h, timeout_s=5.0)                   # or transport.poll(h) between steps
    except TransferError:                                  # TransferTimeout is one
        transport.cancel(h)
        fail(request)                                      # one request, never the server
        free_when(lambda: transport.settled(h), off)       # see the NOTE below

Implementations: ``FakeTransport`` (in-process, fails or hangs on demand, for tests),
``TorchDistTransport`` (``torch.distributed`` isend/irecv on an existing group: gloo on the CPU,
NCCL on GPUs, the same code) and ``NixlTransport`` (optional, one-sided WRITE + notification). All
three are importable from this module.

Peers first agree on what the bytes mean: ``handshake`` exchanges the fields of a ``Compat``
(model, dtype, page size, layout, cache mode, ...) with their hash, and raises
``IncompatiblePeerError`` naming every field that differs.

NOTE: a buffer handed to ``send``/``recv`` belongs to the transport until the handle is
*settled*: done, failed, or cancelled and ``settled(handle)`` is True. gloo and NCCL cannot take
back a posted receive, so after a timeout or ``cancel`` the peer's late data may still land in it:
freeing the staging slice before ``settled`` would let it overwrite the next request's KV.
"""
from __future__ import annotations

import abc
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

COMPAT_VERSION = 1          # bump when the segment layout or the handshake changes
MAX_TAG = 2**31 - 1
USER_TAG_LIMIT = MAX_TAG - 15   # user tags: [0, USER_TAG_LIMIT); the rest are reserved
_HS_LEN_TAG = MAX_TAG - 1
_HS_DATA_TAG = MAX_TAG
_MAX_HANDSHAKE_BYTES = 1 << 20


# ---------------------------------------------------------------------------------------- errors
class TransferError(RuntimeError):
    """A transfer failed; the caller fails the request it belonged to."""


class TransferTimeout(TransferError, TimeoutError):
    """A wait ran past its deadline. ``needs_teardown``: later transfers with this peer may be stuck
    behind this one (NCCL), so the caller should tear the group down once it has drained."""

    def __init__(self, message: str, handle: "TransferHandle | None" = None,
                 needs_teardown: bool = False) -> None:
        super().__init__(message)
        self.handle = handle
        self.needs_teardown = needs_teardown


class TransferCancelled(TransferError):
    """``poll``/``wait`` on a handle that was cancelled."""


class IncompatiblePeerError(RuntimeError):
    """The peer's model, dtype, page size, layout or cache mode differ from ours."""


# ---------------------------------------------------------------------------------------- compat
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Compat:
    """What a peer must agree on before our KV bytes mean anything to it. ``extra``: more
    ``(name, value)`` pairs (e.g. ``("kv_heads", 32)``, ``("tp_size", 1)``), stored sorted."""

    model: str
    dtype: str
    page_size: int
    layout: str
    cache_mode: str
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout", "cache_mode"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v:
                raise ValueError(f"{name} must be a non-empty string, got {v!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        extra = tuple(sorted((tuple(kv) for kv in self.extra), key=lambda kv: kv[0]))
        for kv in extra:
            if len(kv) != 2 or not isinstance(kv[0], str) or not kv[0].isidentifier() \
                    or not isinstance(kv[1], _SCALARS):
                raise ValueError(f"extra must hold (name, str|int|float|bool) pairs, got {kv!r}")
        names = [k for k, _ in extra]
        clash = sorted(set(names) & (set(self._base_fields()) | {"version"}))
        if clash or len(set(names)) != len(names):
            raise ValueError(f"extra names must be unique and not a base field, got {names}")
        object.__setattr__(self, "extra", extra)

    def _base_fields(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "page_size": self.page_size,
                "layout": self.layout, "cache_mode": self.cache_mode}

    def fields(self) -> dict[str, Any]:
        """Every compared field, the protocol version included."""
        return {"version": COMPAT_VERSION, **self._base_fields(), **dict(self.extra)}

    @property
    def digest(self) -> bytes:
        return _digest(self.fields())

    def to_bytes(self) -> bytes:
        """The handshake payload: the fields and their hash (so a mismatch can be named)."""
        return json.dumps({"fields": self.fields(), "hash": self.digest.hex()},
                          sort_keys=True).encode()


def _digest(fields: dict[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
                          ).digest()


def compat_hash(model: str, dtype: str, page_size: int, layout: str, cache_mode: str,
                **extra) -> bytes:
    """SHA-256 of the compatibility fields (see ``Compat``); ``extra`` keywords join them."""
    return Compat(model, dtype, page_size, layout, cache_mode, tuple(extra.items())).digest


def check_compat(local: Compat, payload: bytes, peer: int) -> dict[str, Any]:
    """The peer's fields from its handshake ``payload``; raises ``IncompatiblePeerError`` naming
    every field that differs from ``local``'s."""
    try:
        msg = json.loads(payload.decode())
        theirs, their_hash = dict(msg["fields"]), bytes.fromhex(msg["hash"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise IncompatiblePeerError(f"peer rank {peer} sent an unreadable handshake ({e})") from e
    if _digest(theirs) != their_hash:
        raise IncompatiblePeerError(f"peer rank {peer}'s handshake hash does not match its fields "
                                    f"(a different hashing version?): {theirs}")
    if their_hash == local.digest:
        return theirs
    mine = local.fields()
    missing = object()
    diffs = [f"{k}: local {mine.get(k, '<unset>')!r}, peer {theirs.get(k, '<unset>')!r}"
             for k in sorted(set(mine) | set(theirs))
             if mine.get(k, missing) != theirs.get(k, missing)]
    raise IncompatiblePeerError(f"peer rank {peer} is incompatible: " + "; ".join(diffs))


# --------------------------------------------------------------------------------------- handles
PENDING, DONE, FAILED, CANCELLED = "pending", "done", "failed", "cancelled"
_ids = itertools.count()


@dataclass(eq=False)
class TransferHandle:
    """One posted send or receive. Read-only for callers; the transport updates ``state``."""

    op: str                 # "send" | "recv"
    peer: int
    tag: int
    nbytes: int
    tensor: torch.Tensor = field(repr=False)   # kept alive until settled
    owner: "Transport" = field(repr=False)
    id: int = field(default_factory=lambda: next(_ids))
    state: str = PENDING
    error: BaseException | None = field(default=None, repr=False)
    impl: Any = field(default=None, repr=False)   # the implementation's per-transfer state

    @property
    def done(self) -> bool:
        return self.state == DONE

    def describe(self) -> str:
        way = "to" if self.op == "send" else "from"
        return f"{self.op} of tag {self.tag} {way} rank {self.peer} ({self.nbytes} bytes)"


# ------------------------------------------------------------------------------------- interface
class Transport(abc.ABC):
    """Point-to-point transfers of contiguous tensors between ranks ``0 .. world_size - 1``.

    ``send``/``recv`` post and return at once; ``poll`` never blocks; ``wait`` always has a
    deadline. Bytes are what travel: a send and its receive must have the same ``nbytes`` (dtypes
    and shapes may differ: a bf16 segment lands in a ``uint8`` staging slice). Sends and receives
    with the same (peer, tag) match in posting order (on NCCL, which ignores tags, all of a pair's
    transfers do). Not thread-safe: one thread drives a transport (the fake excepted).
    """

    rank: int
    world_size: int
    device: torch.device = torch.device("cpu")   # where handshake tensors live

    # ------------------------------------------------------------------------- implementation
    @abc.abstractmethod
    def _start(self, handle: TransferHandle) -> None:
        """Post ``handle`` (``op``, ``peer``, ``tag``, ``tensor`` are set); set ``handle.impl``."""

    @abc.abstractmethod
    def _poll(self, handle: TransferHandle) -> bool:
        """True once a pending transfer completed; raises ``TransferError`` if it failed."""

    def _cancel(self, handle: TransferHandle) -> None:
        """Withdraw what can be withdrawn (the handle is already marked cancelled)."""

    def _settled(self, handle: TransferHandle) -> bool:
        """For a cancelled handle: True once nothing will touch its buffer any more."""
        return True

    def _block(self, handle: TransferHandle, delay_s: float, left_s: float) -> None:
        """Let ``handle`` progress for a while: ``delay_s`` (backoff), at most ``left_s``."""
        time.sleep(min(delay_s, left_s))

    def _timeout_advice(self, handle: TransferHandle) -> tuple[str, bool]:
        """(text appended to a timeout's message, whether the group needs tearing down)."""
        return "", False

    # --------------------------------------------------------------------------------- API
    def send(self, dst_rank: int, tensor: torch.Tensor, tag: int) -> TransferHandle:
        """Post a send of ``tensor``'s bytes to ``dst_rank``. Do not modify or free ``tensor``
        until the handle is settled."""
        return self._post("send", dst_rank, tensor, tag, "dst_rank", "tensor", user_tag=True)

    def recv(self, src_rank: int, out_tensor: torch.Tensor, tag: int) -> TransferHandle:
        """Post a receive from ``src_rank`` into the preallocated contiguous ``out_tensor`` (e.g.
        a slice of the staging buffer): it must have exactly the sender's ``nbytes``."""
        return self._post("recv", src_rank, out_tensor, tag, "src_rank", "out_tensor",
                          user_tag=True)

    def poll(self, handle: TransferHandle) -> bool:
        """True once done; False while in flight. Raises ``TransferError`` if it failed,
        ``TransferCancelled`` if it was cancelled."""
        self._check_handle(handle)
        if handle.state == DONE:
            return True
        if handle.state == FAILED:
            raise handle.error
        if handle.state == CANCELLED:
            raise TransferCancelled(f"{handle.describe()} was cancelled")
        try:
            done = self._poll(handle)
        except TransferError as e:
            handle.state, handle.error = FAILED, e
            raise
        if done:
            handle.state = DONE
        return done

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        """Block until ``handle`` is done, at most ``timeout_s`` seconds. Raises
        ``TransferTimeout`` past it (the handle stays pending: ``cancel`` it), and what ``poll``
        raises."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        deadline = time.monotonic() + timeout_s
        delay = 50e-6
        while not self.poll(handle):
            left = deadline - time.monotonic()
            if left <= 0:
                advice, teardown = self._timeout_advice(handle)
                raise TransferTimeout(f"{handle.describe()} not done after {timeout_s:.3g} s"
                                      + (f"; {advice}" if advice else ""), handle, teardown)
            self._block(handle, delay, left)
            delay = min(2 * delay, 2e-3)

    def cancel(self, handle: TransferHandle) -> None:
        """Give up on a pending transfer (idempotent; a no-op once done or failed). Its buffer
        stays the transport's until ``settled(handle)``."""
        self._check_handle(handle)
        if handle.state == PENDING:
            handle.state = CANCELLED
            self._cancel(handle)

    def settled(self, handle: TransferHandle) -> bool:
        """True once nothing will read or write the handle's buffer any more: done, failed, or
        cancelled and withdrawn (or finished in the background)."""
        self._check_handle(handle)
        if handle.state == PENDING:
            return False
        if handle.state == CANCELLED:
            return self._settled(handle)
        return True

    def handshake(self, peer: int, compat: Compat, timeout_s: float = 30.0) -> dict[str, Any]:
        """Exchange compatibility fields with ``peer`` (both sides call it); returns the peer's
        fields. Raises ``IncompatiblePeerError`` naming the fields that differ,
        ``TransferTimeout`` if the peer does not answer within ``timeout_s``."""
        if not isinstance(compat, Compat):
            raise ValueError(f"compat must be a Compat, got {type(compat).__name__}")
        self._check_peer(peer, "peer")
        return check_compat(compat, self._exchange(peer, compat.to_bytes(), timeout_s), peer)

    def close(self) -> None:
        """Release the transport's own resources (never the process group it was given)."""

    # ---------------------------------------------------------------------------- internals
    def _exchange(self, peer: int, payload: bytes, timeout_s: float) -> bytes:
        # NOTE: the lower rank sends first and the higher rank receives first: unbatched NCCL
        # send/recv pairs posted in the same order on both sides would deadlock.
        deadline = time.monotonic() + timeout_s
        n_out = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        n_in = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._swap(peer, n_out, n_in, _HS_LEN_TAG, deadline)
        n = int(n_in.item())
        if not 0 < n <= _MAX_HANDSHAKE_BYTES:
            raise IncompatiblePeerError(f"peer rank {peer} announced a {n}-byte handshake")
        data_out = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        data_in = torch.empty(n, dtype=torch.uint8, device=self.device)
        self._swap(peer, data_out, data_in, _HS_DATA_TAG, deadline)
        return bytes(data_in.cpu().numpy())

    def _swap(self, peer: int, out: torch.Tensor, into: torch.Tensor, tag: int,
              deadline: float) -> None:
        steps = [("send", out), ("recv", into)]
        for op, t in (steps if self.rank < peer else steps[::-1]):
            h = self._post(op, peer, t, tag, "peer", "tensor", user_tag=False)
            try:
                self.wait(h, max(deadline - time.monotonic(), 1e-3))
            except TransferError:
                self.cancel(h)
                raise

    def _post(self, op: str, peer: int, tensor: torch.Tensor, tag: int, peer_name: str,
              tensor_name: str, user_tag: bool) -> TransferHandle:
        self._check_peer(peer, peer_name)
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{tensor_name} must be a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError(f"{tensor_name} must be contiguous and non-empty, got shape "
                             f"{tuple(tensor.shape)} with strides {tensor.stride()}")
        limit = USER_TAG_LIMIT if user_tag else MAX_TAG + 1
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < limit:
            raise ValueError(f"tag must be an integer in [0, {limit}), got {tag!r}")
        handle = TransferHandle(op, peer, tag, tensor.numel() * tensor.element_size(), tensor,
                                self)
        try:
            self._start(handle)
        except TransferError as e:
            handle.state, handle.error = FAILED, e
        return handle

    def _check_peer(self, peer: int, name: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) \
                or not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"{name} must be a rank in [0, {self.world_size}) other than this "
                             f"one ({self.rank}), got {peer!r}")

    def _check_handle(self, handle: TransferHandle) -> None:
        if not isinstance(handle, TransferHandle) or handle.owner is not self:
            raise ValueError(f"handle must be a TransferHandle of this transport, got {handle!r}")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat ``uint8`` view (no copy)."""
    return t.reshape(-1).view(torch.uint8)
