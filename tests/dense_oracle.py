"""A plain-PyTorch attention backend for the engine, used only as a test oracle.

It replaces the runner's paged backend (``use_dense_oracle(engine)``): every request keeps a dense
canvas-sized cache ``[layers, 2, canvas, kv_heads, head_dim]``; each step's recomputed rows write
their fresh K/V into it, then every query attends to the whole cached canvas with one SDPA call
per request (verification rows, probes and the per-key attention mass with the exact helpers). No page table, no kernels: the
paged path is tested token for token against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flash_dllm.layers.attention import attention_weights, masked_attention
from flash_dllm.layers.attention_backend import Segment, VerifyRows  # noqa: F401 (re-export)


@dataclass
class DenseStep:
    """The oracle's per-step context: ``segments`` with their caches (``kv[request_id]``)."""

    segments: list[Segment]
    kv: dict = field(default_factory=dict)
    probe_layer: int | None = None
    mass_layer: int | None = None
    mass: torch.Tensor | None = None
    special: list = field(default_factory=list)

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
        q, k, v = attn.project(x)                               # q: [T, H, D], k/v: [T, Hkv, D]
        q, k = attn.rotary(q, positions), attn.rotary(k, positions)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for seg in self.segments:
            qs, ks, vs = q[seg.start:seg.end], k[seg.start:seg.end], v[seg.start:seg.end]
            cache = self.kv.get(seg.request_id)
            if cache is not None:
                # NOTE: fresh K/V overwrite their cache rows first, so a query sees the fresh
                # values of every recomputed position and cached values everywhere else.
                cache[layer, 0].index_copy_(0, seg.slots, ks)
                cache[layer, 1].index_copy_(0, seg.slots, vs)
                ks, vs = cache[layer, 0], cache[layer, 1]       # [canvas, Hkv, D]
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0), enable_gqa=qs.shape[1] != ks.shape[1])
            out[seg.start:seg.end] = o[0].transpose(0, 1).flatten(1)
            if seg.verify is not None:
                vr = seg.verify
                kd, vd = k[vr.start:vr.start + vr.num_keys], v[vr.start:vr.start + vr.num_keys]
                out[vr.start:vr.end] = masked_attention(q[vr.start:vr.end], ks, vs, kd, vd,
                                                        vr.allow)
            if seg.probe is not None and layer == self.probe_layer:
                seg.probe_weights = attention_weights(qs[seg.probe], ks)
        if layer == self.mass_layer:        # per-key mass: summed over heads and query rows
            width = max(s.length for s in self.segments)
            self.mass = torch.zeros(len(self.segments), width, device=q.device)
            for b, seg in enumerate(self.segments):
                w = attention_weights(q[seg.start:seg.end], self.kv[seg.request_id][layer, 0])
                self.mass[b, :seg.length] = w.sum(0) * q.shape[1]
        return out


class DenseOracleBackend:
    """Stands in for ``PagedAttentionBackend`` (same ``build`` / ``release``)."""

    def __init__(self, cfg, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.caches: dict[str, torch.Tensor] = {}

    def build(self, table, canvas_lens, positions, pos_host, cu, uncached, segments=None,
              probe_layer=None, mass_layer=None, block_size=0) -> DenseStep:
        assert not block_size, "the dense oracle attends bidirectionally"
        c = self.cfg
        for seg in segments:
            if seg.request_id not in self.caches:
                self.caches[seg.request_id] = torch.empty(
                    c.num_layers, 2, seg.length, c.num_kv_heads, c.head_dim, dtype=self.dtype,
                    device=self.device)
        return DenseStep(segments, {s.request_id: self.caches[s.request_id] for s in segments},
                         probe_layer, mass_layer)

    def release(self, request_id: str) -> None:
        self.caches.pop(request_id, None)


def use_dense_oracle(engine):
    """Swap ``engine``'s attention backend for the dense oracle (before its first step)."""
    r = engine.runner
    r.backend = DenseOracleBackend(engine.cfg, r.dtype, r.device)
    r.forward_graphs = None          # the oracle is eager only
    r.fused = None
    return engine
