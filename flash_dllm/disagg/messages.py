"""The messages of prefill/decode disaggregation (plain picklable data) and their channel.

Front end -> worker: ``Add``, ``Import``, ``Expect``, ``Abort``, ``Stop``, ``Peers``, ``Release``.
Worker -> front end: ``Out``, ``Announce``, ``Exported``, ``Imported``, ``Failed``, ``Consumed``,
``Stats``.
KV bytes never travel here: they go worker to worker on the transport (or CUDA IPC).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

from flash_dllm.disagg.migrate import RequestSnapshot


class Channel:
    """A control connection that pickles with the plain pickler: ``Connection.send`` uses
    multiprocessing's, for which torch registers tensor reductions through shared-memory file
    descriptors (a handshake of its own that the peer's authkey would have to match)."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def send(self, obj) -> None:
        self.conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


# --------------------------------------------------------------------------- messages (picklable)
@dataclass(frozen=True)
class Add:
    """Front end -> prefill worker: run this request's first step, then move it to ``dst``
    (``None``: keep it here to the end)."""

    request_id: str
    prompt_ids: list
    params: object
    prompt: str | None
    dst: int | None
    tag: int
    groups: int = 1             # > 1: send its KV in this many layer groups during the forward


@dataclass(frozen=True)
class Import:
    """Front end -> decode worker: ``snap``'s segment comes from worker ``src`` with ``tag``
    (CUDA IPC: it lies at ``offset`` of ``src``'s staging buffer, to be read from there)."""

    snap: RequestSnapshot
    src: int
    tag: int
    offset: int | None = None


@dataclass(frozen=True)
class Peers:
    """Front end -> every worker: how to reach each worker, ``rank -> (kind, payload)``: its
    staging buffer as a CUDA IPC handle, or its NIXL agent's metadata."""

    handles: dict


@dataclass(frozen=True)
class Release:
    """Front end -> prefill worker (CUDA IPC): the segment at ``offset`` was read; free it."""

    offset: int


@dataclass(frozen=True)
class Consumed:
    """Decode worker -> front end (CUDA IPC): done with ``src``'s segment at ``offset``."""

    src: int
    offset: int


@dataclass(frozen=True)
class Announce:
    """Prefill worker -> front end -> decode worker (as ``Expect``): a pipelined request's first
    forward has started; its KV comes in ``groups`` layer-group sends with tags ``tag + g``."""

    request_id: str
    dst: int
    tag: int
    canvas_len: int
    groups: int


@dataclass(frozen=True)
class Expect:
    """Front end -> decode worker: post the receives of ``Announce``'s sends from ``src``."""

    request_id: str
    src: int
    tag: int
    canvas_len: int
    groups: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Out:
    """Worker -> front end: a request's committed prefix grew, or it finished."""

    request_id: str
    new_ids: list
    num_tokens: int
    num_forwards: int
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class Exported:
    """Prefill worker -> front end: the request left; forward ``snap`` to ``dst``."""

    snap: RequestSnapshot
    dst: int
    tag: int
    offset: int | None = None          # CUDA IPC: where it lies in this worker's staging
    groups: int = 1                    # > 1: its KV already went in layer groups (pipelined)


@dataclass(frozen=True)
class Imported:
    """Decode worker -> front end: the request's segment landed; it runs here now."""

    request_id: str
    seconds: float             # from the Import message to the unpacked pages
    nbytes: int


@dataclass(frozen=True)
class Failed:
    """Worker -> front end: this request failed (a transfer error or timeout); others go on."""

    request_id: str
    message: str
    kind: str = "transfer"      # "transfer" | "checksum" (arrived corrupted) | "request"


@dataclass(frozen=True)
class Stats:
    rank: int
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    staging_used: int          # staging segments held (receives in flight + stranded)
    sends: int                 # sends in flight
    recvs: int                 # receives posted or queued
    steps: int
    step_seconds: float
    prefill_steps: int
