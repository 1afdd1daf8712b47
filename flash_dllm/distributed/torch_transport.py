"""``torch.distributed`` point-to-point transport on an existing process group: gloo on the CPU,
NCCL on GPUs, the same code.

Every segment travels as its bytes (a flat ``uint8`` view), so a bf16 segment lands in a ``uint8``
staging slice and NCCL sees matching counts and dtypes on both sides.

How completion is observed differs by backend, and it matters for ``poll``:
- NCCL: ``Work.is_completed()`` queries the transfer's CUDA event without blocking: poll it.
- gloo: a p2p ``Work`` only reports completion from inside ``wait()``, and ``wait(timeout)``
  that expires signals an error to *every* pair of the gloo context (the group is broken for
  all peers). So each gloo transfer gets a daemon thread that calls ``wait()`` with no timeout
  of its own (the group's timeout, given to ``init_process_group``, is the backstop) and sets an
  event; ``poll`` reads the event and ``wait`` blocks on it with our deadline. ``Work.wait``
  releases the GIL, so the threads cost nothing while they wait.

NOTE: gloo and NCCL cannot cancel a posted isend/irecv. ``cancel`` therefore only marks the
handle: the operation stays posted, and a late send from the peer still lands in the receive
buffer, which stays the transport's until ``settled(handle)`` (the background op finished or
failed). On gloo other transfers with the same peer go on (other tags match independently), and a
stuck one ends when the peer sends, when the peer's connection closes (its process died), or at
the group's timeout; a process that exits with one still blocked lingers until then. On
NCCL the pair's later operations queue behind the stuck one on the communicator's stream, so a
timeout there means: fail the pair's other requests and ``abort()`` and rebuild the group
(``TransferTimeout.needs_teardown`` is True). Set the group's own timeout well above every
``wait`` deadline: NCCL's watchdog takes the whole process down when it fires.

NOTE: NCCL ignores tags: a pair's transfers match in posting order. Post a pair's receives in the
order its sends were posted (one segment per request, in request order), and never send and
receive between the same two ranks in the same order on both sides without batching.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flash_dllm.distributed.transport import (USER_TAG_LIMIT, TransferError, TransferHandle,
                                              Transport, as_bytes)


@dataclass(eq=False)
class _Pending:
    work: object
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def _watch(p: _Pending) -> None:
    try:
        p.work.wait()
    except BaseException as e:     # noqa: BLE001 -- reported through poll()
        p.error = e
    finally:
        p.done.set()


class TorchDistTransport(Transport):
    """Transfers over ``group`` (default: the world group); ranks are ranks of ``group``.
    ``device``: where handshake tensors live (default: the current CUDA device on NCCL, else the
    CPU); segments may live anywhere the backend accepts."""

    def __init__(self, group=None, *, device: str | torch.device | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group(...) first")
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._event_poll = self.backend == "nccl"
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self._event_poll
                      else torch.device("cpu"))
        self.device = torch.device(device)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    # --------------------------------------------------------------------------- transport
    def _start(self, handle: TransferHandle) -> None:
        if self._event_poll and handle.tensor.device.type != "cuda":
            raise ValueError(f"NCCL transfers need CUDA tensors, got one on "
                             f"{handle.tensor.device}")
        post = dist.isend if handle.op == "send" else dist.irecv
        try:
            work = post(as_bytes(handle.tensor), self._global(handle.peer), group=self.group,
                        tag=handle.tag)
        except RuntimeError as e:
            raise TransferError(f"{handle.describe()} could not be posted: {e}") from e
        p = _Pending(work)
        handle.impl = p
        if not self._event_poll:
            threading.Thread(target=_watch, args=(p,), daemon=True,
                             name=f"flash-dllm-transfer-{handle.id}").start()

    def _poll(self, handle: TransferHandle) -> bool:
        p: _Pending = handle.impl
        if self._event_poll:
            try:
                if not p.work.is_completed():
                    return False
                p.error = p.work.exception()
            except RuntimeError as e:
                p.error = e
            p.done.set()
        elif not p.done.is_set():
            return False
        if p.error is not None:
            raise TransferError(f"{handle.describe()} failed: {p.error}") from p.error
        return True

    def _block(self, handle: TransferHandle, delay_s: float, left_s: float) -> None:
        if self._event_poll:
            # An event query costs microseconds; sleeping up to the base 2 ms would add
            # milliseconds to a 15 ms NVLink transfer.
            time.sleep(min(delay_s, 2e-4, left_s))
        else:
            handle.impl.done.wait(left_s)        # wakes the moment the watcher finishes

    def _settled(self, handle: TransferHandle) -> bool:
        p: _Pending = handle.impl
        if p is None or p.done.is_set():
            return True
        if self._event_poll:
            try:
                return bool(p.work.is_completed())
            except RuntimeError:
                return True
        return False

    def _timeout_advice(self, handle: TransferHandle) -> tuple[str, bool]:
        if self._event_poll:
            return ("NCCL cannot cancel the posted operation and this pair's later transfers "
                    "queue behind it: cancel() it, fail the pair's other requests, then abort() "
                    "and rebuild the process group", True)
        return ("gloo cannot cancel the posted operation: cancel() it and keep its buffer until "
                "settled() (the peer sends late, its connection closes, or the group's timeout "
                "fires); other transfers with this peer go on", False)

    def abort(self) -> None:
        """Abort the process group's backend; the group is unusable afterwards (the caller
        rebuilds it). On NCCL every pending transfer fails, and settles, at once. gloo's abort
        does not reach posted p2p operations: they end when the peer's connection closes (its
        process exited) or at the group's timeout."""
        pg = self.group if self.group is not None else dist.group.WORLD
        backend = pg._get_backend(self.device) if hasattr(pg, "_get_backend") else pg
        backend.abort()

    def __repr__(self) -> str:
        return (f"TorchDistTransport(backend={self.backend!r}, rank={self.rank}, "
                f"world_size={self.world_size})")


# ------------------------------------------------------------------------ benchmarking only
def fragment_views(kv: torch.Tensor) -> list[torch.Tensor]:
    """The per-(layer, page) fragments of a page-first segment ``(pages, layers, 2, page_size,
    kv_heads, head_dim)``, layer by layer as a layer-major pool would send them."""
    if kv.dim() != 6 or not kv.is_contiguous():
        raise ValueError(f"kv must be a contiguous (pages, layers, 2, page_size, kv_heads, "
                         f"head_dim) tensor, got shape {tuple(kv.shape)}")
    pages, layers = kv.shape[:2]
    return [kv[p, l] for l in range(layers) for p in range(pages)]   # each [2, ps, H, D]


def _fragments(op, kv: torch.Tensor, peer: int, batched: bool, group, tag_base: int) -> list:
    frags = fragment_views(kv)
    if not 0 <= tag_base <= USER_TAG_LIMIT - len(frags):
        raise ValueError(f"tag_base must be in [0, {USER_TAG_LIMIT - len(frags)}], got {tag_base}")
    if group is not None:
        peer = dist.get_global_rank(group, peer)
    if batched:
        return dist.batch_isend_irecv([dist.P2POp(op, as_bytes(f), peer, group, tag_base + i)
                                       for i, f in enumerate(frags)])
    for i, f in enumerate(frags):
        op(as_bytes(f), peer, group=group, tag=tag_base + i).wait()
    return []


def send_fragments(kv: torch.Tensor, dst: int, *, batched: bool, group=None,
                   tag_base: int = 0) -> list:
    """Send ``kv`` as per-(layer, page) fragments, for comparing with one contiguous send.
    ``batched``: all at once through ``batch_isend_irecv`` (returns the works to wait for);
    otherwise one ``isend`` per fragment, each waited before the next (returns ``[]``). Bench
    only: the waits have no deadline but the group's timeout."""
    return _fragments(dist.isend, kv, dst, batched, group, tag_base)


def recv_fragments(kv: torch.Tensor, src: int, *, batched: bool, group=None,
                   tag_base: int = 0) -> list:
    """The receiving side of ``send_fragments`` (same ``batched`` and ``tag_base``), into
    ``kv``'s fragments."""
    return _fragments(dist.irecv, kv, src, batched, group, tag_base)
