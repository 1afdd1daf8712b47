"""Bidirectional self-attention and the contexts that say which keys each query sees.

The attention module owns the projections and RoPE; *where keys come from* is the context's job:

- ``DenseContext``: a padded batch ``[B, L]`` attends to itself (training, parity tests, the
  exact reference). An optional key mask hides padding.
- ``PackedContext``: the plain PyTorch engine layout (``EngineConfig(kv_layout="dense")``). Tokens
  of many requests are packed into one ``[T]`` axis with no padding; each request (a *segment*)
  writes its fresh K/V into its own dense canvas-sized cache at the positions it recomputes, then
  attends to the whole cached canvas, one SDPA call per request.
- ``PagedContext``: the default engine layout. K/V live in the shared page pool
  ``[layers, 2, pages, page_size, kv_heads, head_dim]``; per layer, one fused kernel rotates q/k
  and writes k/v into the recomputed positions' page slots (``kernels.rope_cache``) and one paged
  attention launch serves every request through its block table (``kernels.paged_attention``).
  On the CPU the same calls run the kernels' PyTorch references.

Cache modes differ only in which positions a step recomputes (see ``flash_dllm.cache.modes``).
Contexts own RoPE (``attend`` gets un-rotated q/k) so the paged path can fuse it with the cache write.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flash_dllm.kernels import paged_attention as paged_attention_op
from flash_dllm.kernels import qkv_rope_cache as qkv_rope_cache_op
from flash_dllm.kernels import rope_cache as rope_cache_op
from flash_dllm.layers.rotary import Rotary


class DenseContext:
    """Every query of a row attends to every (unmasked) key of the same row."""

    def __init__(self, key_mask: torch.Tensor | None = None) -> None:
        self.key_mask = key_mask  # [B, L] bool, True = real token

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        # q: [B, L, H, D], k/v: [B, L, Hkv, D]
        q, k = rotary(q, positions), rotary(k, positions)
        mask = None
        if self.key_mask is not None:
            mask = self.key_mask[:, None, None, :]            # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=q.shape[2] != k.shape[2])               # [B, H, L, D]
        return out.transpose(1, 2).flatten(2)                  # [B, L, H*D]


@dataclass
class Segment:
    """One request's slice of a packed step.

    ``start:end`` indexes the packed token axis; ``slots`` are the canvas positions of those tokens
    (also their cache rows); ``kv`` is the request's cache ``[layers, 2, canvas, kv_heads, head_dim]``
    or None when the step recomputes the whole canvas and nothing is kept.
    """

    start: int
    end: int
    slots: torch.Tensor
    kv: torch.Tensor | None
    verify: VerifyRows | None = None     # decode="verify": extra rows after ``end``
    probe: torch.Tensor | None = None      # rows (from ``start``) whose attention is recorded
    probe_weights: torch.Tensor | None = None   # out: [probe rows, canvas], mean over heads
    pages: torch.Tensor | None = None      # paged layout: the request's page ids (int32)
    length: int = 0                        # paged layout: the request's canvas length


@dataclass
class VerifyRows:
    """A segment's verification block (``flash_dllm.decoding.verify``): packed rows
    ``start:end``, of which the first ``num_keys`` (the draft views) also serve as extra keys.
    ``allow`` [rows, canvas + num_keys] says which keys each row sees. The rows attend to the
    request's canvas keys (its cache, or this step's full-canvas K/V) and to those extra keys;
    their K/V are never written to the cache and no canvas row ever sees them."""

    start: int
    end: int
    num_keys: int
    allow: torch.Tensor


def _masked_attention(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, k2: torch.Tensor,
                      v2: torch.Tensor, allow: torch.Tensor) -> torch.Tensor:
    """Attention of a few rows over two key sets without concatenating them (the first is a whole
    canvas cache, which is read in place): q [R, H, D], k1/v1 [L, Hkv, D], k2/v2 [M, Hkv, D],
    allow [R, L + M] bool -> [R, H * D]."""
    R, H, D = q.shape
    L, Hkv = k1.shape[0], k1.shape[1]
    g = H // Hkv
    qh = q.reshape(R, Hkv, g, D).permute(1, 2, 0, 3).reshape(Hkv, g * R, D)   # [Hkv, g*R, D]
    s = torch.cat([qh @ k1.permute(1, 2, 0), qh @ k2.permute(1, 2, 0)], dim=-1)  # [Hkv, g*R, L+M]
    s = s.float().view(Hkv, g, R, -1) * D ** -0.5
    p = s.masked_fill(~allow, float("-inf")).softmax(-1).to(q.dtype).view(Hkv, g * R, -1)
    o = p[..., :L] @ v1.transpose(0, 1) + p[..., L:] @ v2.transpose(0, 1)      # [Hkv, g*R, D]
    return o.view(Hkv, g, R, D).permute(2, 0, 1, 3).reshape(R, H * D)


def _attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax attention weights averaged over heads: q [R, H, D], k [L, Hkv, D] -> [R, L]."""
    R, H, D = q.shape
    Hkv = k.shape[1]
    qh = q.reshape(R, Hkv, H // Hkv, D).permute(1, 2, 0, 3).reshape(Hkv, -1, D)  # [Hkv, g*R, D]
    p = ((qh @ k.permute(1, 2, 0)).float() * D ** -0.5).softmax(-1)             # [Hkv, g*R, L]
    return p.view(H, R, -1).mean(0)


class PackedContext:
    """``probe_layer``: the layer at which segments with ``probe`` rows record attention weights
    (the KV-consistency sentinel)."""

    def __init__(self, segments: list[Segment], probe_layer: int | None = None) -> None:
        self.segments = segments
        self.probe_layer = probe_layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        # q: [T, H, D], k/v: [T, Hkv, D]
        q, k = rotary(q, positions), rotary(k, positions)
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for seg in self.segments:
            qs, ks, vs = q[seg.start:seg.end], k[seg.start:seg.end], v[seg.start:seg.end]
            if seg.kv is not None:
                # NOTE: fresh K/V overwrite their cache rows first, so a query sees the fresh
                # values of every recomputed position and cached values everywhere else.
                seg.kv[layer, 0].index_copy_(0, seg.slots, ks)
                seg.kv[layer, 1].index_copy_(0, seg.slots, vs)
                ks, vs = seg.kv[layer, 0], seg.kv[layer, 1]       # [canvas, Hkv, D]
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                enable_gqa=qs.shape[1] != ks.shape[1])             # [1, H, Tq, D]
            out[seg.start:seg.end] = o[0].transpose(0, 1).flatten(1)
            # NOTE: ks/vs are indexed by canvas position here: the cache, or (no cache) the whole
            # canvas recomputed in order.
            if seg.verify is not None:
                vr = seg.verify
                kd, vd = k[vr.start:vr.start + vr.num_keys], v[vr.start:vr.start + vr.num_keys]
                out[vr.start:vr.end] = _masked_attention(q[vr.start:vr.end], ks, vs, kd, vd,
                                                         vr.allow)
            if seg.probe is not None and layer == self.probe_layer:
                seg.probe_weights = _attention_weights(qs[seg.probe], ks)
        return out

@dataclass
class PagedBatch:
    """What one packed step needs on the paged cache (built once per step by the engine).

    ``slots`` [T] int32 or int64: the page slot (``page * page_size + offset``) each packed row's K/V goes to,
    -1 for rows that are never cached (verification rows). Request b owns packed rows
    ``cu_q[b]:cu_q[b+1]`` and attends to its ``seq_lens[b]`` canvas keys through
    ``block_table[b]``; ``max_q`` is a host bound on every request's row count (kernel grid)."""

    kv: torch.Tensor               # [layers, 2, pages, page_size, kv_heads, head_dim]
    slots: torch.Tensor            # [T] int32 (host-built) or int64
    cu_q: torch.Tensor             # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_table: torch.Tensor      # [B, max_pages] int32
    max_q: int
    inv_freq: torch.Tensor         # [head_dim / 2] float32
    # host bound on seq_lens (``paged_attention.seqlen_bound``): lets small batches split each
    # request's keys over more programs (split-KV); 0 = unknown, never split
    max_k: int = 0


class PagedContext:
    """Attention over the shared page pool: per layer one RoPE + cache-write launch and one paged
    attention launch for the whole batch (no per-request loop, no host sync), so the forward can be
    captured in a CUDA graph.

    Segments with verification rows or probes (decode="verify", the KV sentinel) additionally get
    their exact special rows recomputed from a dense copy of their canvas K/V; a batch without them
    never takes that path. ``mass_layer``: the layer whose per-key attention mass is kept in
    ``self.mass`` [B, max_pages * page_size] (the ``flash`` cache mode's top-k tracking)."""

    def __init__(self, batch: PagedBatch, segments: list[Segment] | None = None,
                 probe_layer: int | None = None, mass_layer: int | None = None) -> None:
        self.batch = batch
        self.segments = segments or []
        self.special = [s for s in self.segments if s.verify is not None or s.probe is not None]
        self.probe_layer = probe_layer
        self.mass_layer = mass_layer
        self.mass: torch.Tensor | None = None

    def fuses_projection(self, x: torch.Tensor, proj: nn.Linear) -> bool:
        """Can ``attend_projected`` run this layer: the fused QKV + RoPE + page-write kernel
        takes these rows (few, half precision, on CUDA) and no segment needs the raw k/v."""
        return (qkv_rope_cache_op.ENABLED and not self.special and x.dim() == 2
                and qkv_rope_cache_op.takes_triton(x, proj.weight, self.batch.kv))

    def attend_projected(self, layer: int, x: torch.Tensor, proj: nn.Linear, num_heads: int,
                         num_kv_heads: int, positions: torch.Tensor, rotary: Rotary
                         ) -> torch.Tensor:
        """``attend`` from the layer's normed input ``x`` [T, d]: one kernel projects q/k/v,
        rotates q/k and writes k/v into their page slots (``kernels.qkv_rope_cache``)."""
        b = self.batch
        kc, vc = b.kv[layer, 0], b.kv[layer, 1]
        qr = qkv_rope_cache_op.op(x, proj.weight, proj.bias, positions, kc, vc, b.slots,
                                  b.inv_freq, num_heads, num_kv_heads, rotary.apply_in_fp32)
        return self._attend_rotated(layer, qr)

    def attend_chunked(self, layer: int, x: torch.Tensor, proj: nn.Linear, num_heads: int,
                       num_kv_heads: int, positions: torch.Tensor, rotary: Rotary,
                       chunk: int) -> torch.Tensor:
        """``attend`` from ``x`` [T, d] for a step of many rows (a full-canvas refresh): the
        projection + RoPE + page write run in row chunks, so the [T, (H + 2 Hkv) D] projection
        never exists whole (805 MB for batch 32 x 1024 rows of LLaDA-8B); only the rotated
        queries are kept for the attention, which runs once every key is in the pages."""
        b = self.batch
        kc, vc = b.kv[layer, 0], b.kv[layer, 1]
        T, D = x.shape[0], kc.shape[-1]
        qr = torch.empty(T, num_heads, D, dtype=x.dtype, device=x.device)
        for i in range(0, T, chunk):
            j = min(T, i + chunk)
            q, k, v = rope_cache_op.split_qkv(proj(x[i:j]), num_heads, num_kv_heads, D)
            qr[i:j] = rope_cache_op.op(q, k, v, positions[i:j], kc, vc, b.slots[i:j],
                                       b.inv_freq, rotary.apply_in_fp32)
        return self._attend_rotated(layer, qr)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        b = self.batch
        kc, vc = b.kv[layer, 0], b.kv[layer, 1]                   # [pages, page_size, Hkv, D]
        qr = rope_cache_op.op(q, k, v, positions, kc, vc, b.slots, b.inv_freq,
                              rotary.apply_in_fp32)                # rotated q; k/v now in pages
        out = self._attend_rotated(layer, qr)
        for seg in self.special:
            self._special_rows(seg, layer, out, qr, k, v, positions, rotary)
        return out

    def _attend_rotated(self, layer: int, qr: torch.Tensor) -> torch.Tensor:
        """Paged attention of the rotated queries (their step's K/V already in the pages)."""
        b = self.batch
        kc, vc = b.kv[layer, 0], b.kv[layer, 1]
        track = layer == self.mass_layer
        out = paged_attention_op.op(qr, kc, vc, b.cu_q, b.seq_lens, b.block_table, b.max_q,
                                    return_mass=track, max_seqlen_k=b.max_k or None)
        if track:
            out, self.mass = out
        return out.flatten(1)                                      # [T, H * D]

    def _special_rows(self, seg: Segment, layer: int, out: torch.Tensor, qr: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      rotary: Rotary) -> None:
        if seg.verify is None and layer != self.probe_layer:
            return                        # a probe-only segment needs the probe layer alone
        kv = self.batch.kv
        ps = kv.shape[3]
        n = -(-seg.length // ps)
        idx = seg.pages[:n].long()
        ks = kv[layer, 0, idx].flatten(0, 1)[:seg.length]          # [canvas, Hkv, D] (a copy)
        vs = kv[layer, 1, idx].flatten(0, 1)[:seg.length]
        if seg.verify is not None:
            vr = seg.verify
            d0, d1 = vr.start, vr.start + vr.num_keys
            kd = rotary(k[d0:d1], positions[d0:d1])                # draft views' keys, rotated
            out[vr.start:vr.end] = _masked_attention(qr[vr.start:vr.end], ks, vs, kd, v[d0:d1],
                                                     vr.allow)
        if seg.probe is not None and layer == self.probe_layer:
            seg.probe_weights = _attention_weights(qr[seg.start:seg.end][seg.probe], ks)


class Attention(nn.Module):
    # inference on the paged cache: steps of more rows project q/k/v in chunks of this many
    # (``PagedContext.attend_chunked``), bounding a refresh step's peak memory
    QKV_CHUNK_ROWS = 4096

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary: Rotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.rotary = rotary

        self.qkv_proj: nn.Linear | None = None      # set by fuse(): q, k, v in one GEMM

    @torch.no_grad()
    def fuse(self) -> None:
        """Inference: replace q/k/v_proj by one Linear over their concatenated weights (one GEMM
        that streams the weights once, instead of three launches). The separate weights are
        freed; the math is unchanged."""
        if self.qkv_proj is not None:
            return
        parts = (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight for p in parts])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=self.q_proj.bias is not None,
                          device=w.device, dtype=w.dtype)
        fused.weight.copy_(w)
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
        del w
        self.q_proj = self.k_proj = self.v_proj = None
        self.qkv_proj = fused

    def forward(self, x: torch.Tensor, positions: torch.Tensor, layer: int, ctx) -> torch.Tensor:
        lead = x.shape[:-1]                                   # [B, L] or [T]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and isinstance(ctx, PagedContext):
            if ctx.fuses_projection(x, self.qkv_proj):
                return self.o_proj(ctx.attend_projected(layer, x, self.qkv_proj, H, Hkv,
                                                        positions, self.rotary))
            if (x.dim() == 2 and x.shape[0] > self.QKV_CHUNK_ROWS and not ctx.special
                    and not torch.is_grad_enabled()):
                return self.o_proj(ctx.attend_chunked(layer, x, self.qkv_proj, H, Hkv,
                                                      positions, self.rotary,
                                                      self.QKV_CHUNK_ROWS))
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.view(*lead, H, D), k.view(*lead, Hkv, D), v.view(*lead, Hkv, D)
        else:
            q = self.q_proj(x).view(*lead, H, D)              # [..., H, D]
            k = self.k_proj(x).view(*lead, Hkv, D)            # [..., Hkv, D]
            v = self.v_proj(x).view(*lead, Hkv, D)
        return self.o_proj(ctx.attend(layer, q, k, v, positions, self.rotary))
