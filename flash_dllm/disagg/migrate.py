"""Moving a running request from one engine to another between steps (prefill -> decode).

Prefill/decode disaggregation runs a request's first forward (the whole prompt and masked canvas:
the expensive one) on a prefill worker, then hands the request to a decode worker, which runs
every later denoising step. What crosses is everything the next step reads, so the decode
worker's steps are exactly the ones the prefill engine would have run (temperature 0: token for
token; sampled requests carry their generator's state):

- the **KV segment**: the request's pages, packed page-first ``[pages, layers, 2, page_size,
  kv_heads, head_dim]`` (FlowKV's ``(blocks, layers, 2, hidden)``) by ``kernels/kv_pages.py``'s
  gather kernel into ONE contiguous tensor, and scattered into the receiver's own pages by the
  unpack kernel: one send per request, bit-exact;
- a ``RequestSnapshot`` (host data, picklable): the host request (canvas, block, step, counters)
  and the runner's per-request device state (Flash-Verify drafts, the KV sentinel's history and
  pending refresh, ``cache="flash"``'s attention mass, sampling generators), copied to the host.

``export_request`` packs and detaches (the request's pages and device state are freed at once:
the segment is a copy); ``import_request`` allocates pages, unpacks and puts the request in the
running batch. Both run between steps, on the engine's thread. Pipelined, the worker packs layer
groups during the step's forward instead (``layer_groups``, ``group_views``,
``import_request(..., groups=...)``). ``segment_checksum`` travels in the snapshot: the receiver
checks the bytes before it unpacks them.

NOTE: the receiver keeps the sender's ``reused_len`` (prompt positions never recomputed), so its
windows are the sender's. Imported pages are private (not in the receiver's prefix tree) and are
not published when the request finishes.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from flash_dllm.cache.checksum import device_checksum, xxh3_64
from flash_dllm.cache.paged import kv_pool
from flash_dllm.config import SamplingParams
from flash_dllm.decoding.policies import DECODE_POLICIES
from flash_dllm.core.request import Request
from flash_dllm.kernels.kv_pages import pack_pages, packed_shape, unpack_pages

# host request fields copied verbatim (see ``Request``)
_REQ_FIELDS = ("block", "num_masked", "step_in_block", "block_forwards", "first_step", "stale",
               "num_forwards", "num_tokens", "reused_len", "arrival_time", "first_token_time",
               "early_stopped", "post_edit_steps")
# runner device state (``SeqState``) that outlives a step
_STATE_TENSORS = ("refresh", "kv_history")


@dataclass
class RequestSnapshot:
    """A running request between two steps, as host data (the KV travels separately)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None
    tokens: np.ndarray                    # [canvas] the canvas as the device had it
    fields: dict                          # _REQ_FIELDS
    counters: dict
    num_pages: int
    kv_shape: tuple[int, ...]             # the segment: packed_shape(pool, num_pages)
    kv_dtype: str
    device_state: dict = field(default_factory=dict)   # name -> CPU tensor (or None)
    kv_checksum: tuple | None = None      # segment_checksum of the segment as it was sent

    @property
    def kv_nbytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * getattr(torch, self.kv_dtype).itemsize


class MigrationError(RuntimeError):
    """A request cannot move: unknown, finished, or its pages do not match the receiver's."""


class CorruptSegment(MigrationError):
    """A segment's bytes do not match the checksum its sender took: never unpacked."""


def refuse_fp8_kv(config) -> None:
    """Disaggregation moves page codes without fp8 pages' scales (``kernels/kv_quant.py``):
    refused with ``kv_cache_dtype="fp8"`` until transfers carry them."""
    if kv_pool(getattr(config, "kv_cache_dtype", "auto")).quantized:
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} is not supported with "
                         "prefill/decode disaggregation yet (KV transfers do not carry fp8 "
                         "scales): use kv_cache_dtype='auto'")


def segment_checksum(buf: torch.Tensor) -> tuple:
    """A checksum of a segment's bytes where they are: xxh3 on the host, the device checksum
    kernel on a GPU (one host sync for its 16 bytes). The receiver checks the bytes it got
    against the sender's before unpacking: a torn or corrupted segment is never served."""
    if buf.device.type == "cpu":
        return ("xxh3", xxh3_64(buf.contiguous().view(torch.uint8).view(-1)))
    return ("device", tuple(device_checksum(buf.contiguous().view(torch.uint8)).tolist()))


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def snapshot(engine, request_id: str) -> RequestSnapshot:
    """The host half of ``export_request`` (nothing is freed)."""
    req = engine.scheduler.find(request_id)
    if req is None or req not in engine.running:
        raise MigrationError(f"request {request_id!r} is not running in this engine")
    runner = engine.runner
    st = engine.device_state(request_id)
    if st is None:
        raise MigrationError(f"request {request_id!r} has not run a step yet: nothing to move")
    pages = engine.kv_manager.pages(request_id)
    dev: dict = {"canvas": _cpu(st.canvas)}
    for name in _STATE_TENSORS:
        dev[name] = _cpu(getattr(st, name))
    runner.state_to_host(st)       # (a fused verify step leaves its drafts on the device)
    dev["drafts"] = None if st.drafts is None else tuple(_cpu(t) for t in st.drafts)
    dev["attn_mass"] = _cpu(st.attn_mass)
    if st.drift_prev is not None:     # the drift test's last step (``decoding/drift.py``)
        mass, window, block = st.drift_prev
        dev["drift_prev"] = (_cpu(mass), tuple(window), block)
    for name in ("generator", "sentinel_generator"):
        g = getattr(st, name)
        dev[name] = None if g is None else g.get_state()
    return RequestSnapshot(
        request_id=req.request_id, prompt_ids=list(req.prompt_ids), params=req.params,
        prompt=req.prompt, tokens=dev["canvas"].numpy().copy(),
        fields={f: getattr(req, f) for f in _REQ_FIELDS}, counters=copy.deepcopy(req.counters),
        num_pages=len(pages), kv_shape=tuple(packed_shape(runner.kv.shape, len(pages))),
        kv_dtype=str(runner.kv.dtype).removeprefix("torch."), device_state=dev)


def pack_request(engine, request_id: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The request's KV as one contiguous page-first segment (``out``: where to pack it)."""
    pages = engine.kv_manager.pages(request_id)
    if pages is None:
        raise MigrationError(f"request {request_id!r} holds no KV pages")
    ids = torch.tensor(pages, dtype=torch.int32, device=engine.device)
    refuse_fp8_kv(engine.config)
    buf, _ = pack_pages(engine.runner.kv, ids, out)
    return buf


def detach(engine, request_id: str) -> None:
    """Take a running request out of ``engine`` without finishing it (``Engine.detach``: its
    pages and device state are freed, never published)."""
    engine.detach(request_id)


def export_request(engine, request_id: str, out: torch.Tensor | None = None
                   ) -> tuple[RequestSnapshot, torch.Tensor]:
    """(snapshot, KV segment) of a running request, which leaves ``engine``. Call between
    steps. On a GPU the pack is queued on the current stream before the pages are freed, so a
    later step that reuses them runs after it."""
    snap = snapshot(engine, request_id)
    seg = pack_request(engine, request_id, out)
    detach(engine, request_id)
    return snap, seg


def check_segment(engine, snap: RequestSnapshot) -> None:
    """Raise ``MigrationError`` unless ``snap``'s segment fits this engine's pool."""
    kv = engine.runner.kv
    want = tuple(packed_shape(kv.shape, snap.num_pages))
    if tuple(snap.kv_shape) != want or snap.kv_dtype != str(kv.dtype).removeprefix("torch."):
        raise MigrationError(f"request {snap.request_id!r}: segment {snap.kv_shape} "
                             f"{snap.kv_dtype} does not fit this pool ({want} {kv.dtype})")
    if snap.num_pages != engine.kv_manager.pages_for(len(snap.tokens)):
        raise MigrationError(f"request {snap.request_id!r}: {snap.num_pages} pages for a "
                             f"{len(snap.tokens)}-token canvas (page size differs?)")


def reserve(engine, snap: RequestSnapshot) -> list[int] | None:
    """Reserve the receiver's pages for ``snap`` (None: they do not fit now)."""
    check_segment(engine, snap)
    return reserve_pages(engine, snap.request_id, len(snap.tokens))


def reserve_pages(engine, request_id: str, n_tokens: int) -> list[int] | None:
    """Reserve private pages for an incoming ``n_tokens``-token canvas (None: not now)."""
    alloc = engine.kv_manager.allocate(request_id, n_tokens, None, reuse=False)
    return None if alloc is None else alloc.pages


def layer_groups(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` contiguous layer ranges covering ``[0, num_layers)`` as evenly as possible."""
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= num_layers:
        raise ValueError(f"layer groups must be an integer in [1, {num_layers}], got {groups!r}")
    cuts = [round(i * num_layers / groups) for i in range(groups + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def group_views(buf: torch.Tensor, kv_shape, dtype: torch.dtype,
                groups: list[tuple[int, int]]) -> list[torch.Tensor]:
    """The segment split by layer group: part g is ``[pages, l1 - l0, 2, S, H, D]``, the parts
    back to back in ``buf`` (bytes or ``dtype``); with one group, the whole segment."""
    flat = buf.view(torch.uint8).view(-1) if buf.dtype != torch.uint8 else buf.view(-1)
    n, _, *rest = kv_shape
    out, off = [], 0
    for l0, l1 in groups:
        shape = (n, l1 - l0, *rest)
        size = math.prod(shape) * dtype.itemsize
        out.append(flat[off:off + size].view(dtype).view(shape))
        off += size
    return out


def import_request(engine, snap: RequestSnapshot, segment: torch.Tensor,
                   pages: list[int] | None = None,
                   groups: list[tuple[int, int]] | None = None) -> Request | None:
    """Unpack ``segment`` into this engine's pages (``pages`` from ``reserve``, else reserved
    here) and add the request to the running batch at the step it left; None when its pages do
    not fit now. The caller checks that a running slot is free (``can_import``)."""
    if pages is None:
        pages = reserve(engine, snap)
        if pages is None:
            return None
    if not can_import(engine):
        engine.kv_manager.free(snap.request_id, None)
        raise MigrationError(f"request {snap.request_id!r}: no free running slot "
                             f"(max_num_seqs {engine.config.max_num_seqs})")
    dev = engine.device
    ids = torch.tensor(pages, dtype=torch.int32, device=dev)
    kv = engine.runner.kv
    groups = groups or [(0, kv.shape[0])]
    for (l0, l1), part in zip(groups, group_views(segment, snap.kv_shape, kv.dtype, groups)):
        unpack_pages(part.to(dev), ids, kv, layers=(l0, l1))
    cfg = engine.cfg
    req = Request(snap.request_id, snap.prompt_ids, snap.params, cfg.mask_token_id,
                  cfg.eos_token_ids, snap.prompt, grid=cfg.attention.block_size,
                  edits=DECODE_POLICIES[snap.params.decode].edits)
    req.tokens[:] = snap.tokens
    for f, v in snap.fields.items():
        setattr(req, f, v)
    req.counters = copy.deepcopy(snap.counters)
    engine.attach(req, pages, lambda st: _restore(st, snap.device_state, dev))
    return req


def _restore(st, ds: dict, dev: torch.device) -> None:
    """Put a snapshot's device state ``ds`` into the receiver's new ``SeqState``."""
    for name in _STATE_TENSORS:
        t = ds.get(name)
        setattr(st, name, None if t is None else t.to(dev))
    if ds.get("drafts") is not None:
        st.drafts = tuple(t.to(dev) for t in ds["drafts"])
    if ds.get("attn_mass") is not None:
        st.mass_src = (ds["attn_mass"].to(dev)[None, :], 0)
    if ds.get("drift_prev") is not None:
        mass, window, block = ds["drift_prev"]
        st.drift_prev = (mass.to(dev), tuple(window), block)
    for name in ("generator", "sentinel_generator"):
        state = ds.get(name)
        if state is None:
            continue
        g = getattr(st, name)
        if g is None:
            g = torch.Generator(device=dev)
            setattr(st, name, g)
        g.set_state(state)


def can_import(engine) -> bool:
    running, _ = engine.counts()
    return running < engine.config.max_num_seqs
