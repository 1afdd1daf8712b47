"""Pipelined sends: a prefill worker sends a request's KV in layer groups during its first forward.

With ``groups`` > 1, the worker's runner calls ``LayerSender`` after every layer's attention
(``ModelRunner.layer_hook``). At the first layer of a step that runs the first forward of
requests to be moved, it announces them (``Announce``: the decode worker reserves pages and
staging and posts one receive per group); after the last layer of group g it packs that group
of each such request (``pack_pages(..., layers=(l0, l1))``) into its send buffer and posts the
send (tag ``tag + g``), so the transfer of early layers overlaps the compute of later ones and
what stays visible after the step is the last group's transfer. After the step the worker
sends only the snapshot (``Exported``).

NOTE: an announced request's sends are always posted (the forward that announced it runs to
its end), so the decode worker's receives always complete: an abort, or a request that finished
in its first step, is received and dropped there, never left hanging.
"""
from __future__ import annotations

import math

import torch

from flash_dllm.disagg import migrate
from flash_dllm.disagg.messages import Announce, Failed
from flash_dllm.distributed.transport import TransferError
from flash_dllm.kernels.kv_pages import pack_pages, packed_shape


class LayerSender:
    def __init__(self, worker, groups: int) -> None:
        self.worker = worker
        eng = worker.engine
        self.groups = migrate.layer_groups(eng.cfg.num_layers, groups)
        self.ends = {l1 - 1: g for g, (_, l1) in enumerate(self.groups)}
        self.pending: dict[str, tuple[int, int]] = {}     # request id -> (dst, tag)
        self.active: dict[str, tuple] = {}   # in this forward: (dst, tag, ids, parts, sends, buf)
        self.sent: dict[str, tuple] = {}   # every group posted: (dst, tag, checksum), exported
        #                                    after the step

    def wants(self, plan) -> bool:
        return plan is not None and any(r.request_id in self.pending and r.num_forwards == 0
                                        for r in plan.requests)

    def __call__(self, plan, layer: int) -> None:
        if layer == 0:
            self._start(plan)
        g = self.ends.get(layer)
        if g is None or not self.active:
            return
        w = self.worker
        for rid, (dst, tag, ids, parts, sends, _) in self.active.items():
            if sends is None:              # its send failed: nothing more for it
                continue
            l0, l1 = self.groups[g]
            pack_pages(w.engine.runner.kv, ids, parts[g], layers=(l0, l1))
            buf = parts[g] if parts[g].device == w.wire else parts[g].to(w.wire)
            try:
                sends.append(w.transport.send(dst, buf, tag + g))
            except (TransferError, ValueError, RuntimeError) as e:
                w.emit(Failed(rid, f"sending its KV to worker {dst} failed: {e}"))
                self.active[rid] = (dst, tag, ids, parts, None, None)
                continue
            w.track_send(sends[-1], buf, rid)
        if g == len(self.groups) - 1:
            for rid, (dst, tag, _, _, sends, buf) in self.active.items():
                if sends is not None:        # the whole segment (the parts are views of it)
                    self.sent[rid] = (dst, tag, migrate.segment_checksum(
                        buf if buf.device == w.wire else buf.to(w.wire)))
            self.active = {}

    def _start(self, plan) -> None:
        w = self.worker
        eng = w.engine
        kv = eng.runner.kv
        self.active = {}
        for r in plan.requests:
            rid = r.request_id
            if rid not in self.pending or r.num_forwards != 0:
                continue
            dst, tag = self.pending.pop(rid)
            pages = eng.kv_manager.pages(rid)
            shape = packed_shape(kv.shape, len(pages))
            buf = torch.empty(math.prod(shape) * kv.element_size(), dtype=torch.uint8,
                              device=eng.device)
            parts = migrate.group_views(buf, shape, kv.dtype, self.groups)
            ids = torch.tensor(pages, dtype=torch.int32, device=eng.device)
            self.active[rid] = (dst, tag, ids, parts, [], buf)
            w.emit(Announce(rid, dst, tag, r.canvas_len, len(self.groups)))

    def forget(self, rid: str) -> None:
        self.pending.pop(rid, None)
        self.sent.pop(rid, None)
