"""The engine's attention backend: projection + RoPE + page write + paged attention for one step.

K/V live in ONE page pool ``[layers, 2, pages, page_size, kv_heads, head_dim]`` (``cache/paged.py``)
that the backend owns. Once per step the runner asks ``PagedAttentionBackend.build`` for the
step's ``PagedAttentionMetadata`` (index tensors built on the host, one host->device copy); the
model then calls ``metadata.attention(module, layer, x, positions)`` in every layer, which runs, for
all requests at once and with no per-request loop or host sync (so the forward can be captured in
a CUDA graph):

1. the q/k/v projection, RoPE, and the write of k/v into their page slots: one kernel for steps of
   at most 64 rows (``kernels/qkv_rope_cache``), row chunks of ``QKV_CHUNK_ROWS`` for very large
   steps (a full-canvas refresh of a big batch), else one GEMM + ``kernels/rope_cache``;
2. one paged attention launch over the block tables (``kernels/paged_attention``), which can also
   return the attention mass each key received (``mass_layer``: the ``flash`` cache mode's top-k).

The metadata's ``segments`` say which packed rows belong to which request. Two kinds of rows are
special and documented here because the runner puts them into the metadata:

- **verification rows** (``decode="verify"``, ``Segment.verify``): extra query rows after a
  request's canvas rows that verify last forward's drafts. Their slot is -1 (their K/V are never
  written to the pool) and their attention is exact and masked (``VerifyRows.allow``), computed
  from a dense copy of the request's canvas K/V;
- **probe rows** (the KV-consistency sentinel, ``Segment.probe``): canvas rows whose attention
  weights over the canvas are recorded at ``probe_layer`` (``Segment.probe_weights``).

An fp8 pool (``kv_cache_dtype="fp8"``: ``kv_scales``) takes the unfused projection, then one
op rotates q / k and quantises K / V into their pages (``kernels/rope_cache_fp8``; with special
rows PyTorch's RoPE and ``write_kv``'s quantised write, ``kernels/kv_quant``); every read of its
pages dequantises.

NOTE (size): just over 400 lines: the step's metadata and every way its attention reaches the
pages (fused, chunked, fp8, partial rotary, special rows), read together.

A step without special rows never takes those paths. On the CPU every kernel call runs the
kernel's PyTorch reference.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flash_dllm.kernels import kv_quant
from flash_dllm.kernels._triton import batch_invariant_active
from flash_dllm.kernels import paged_attention as paged_attention_op
from flash_dllm.kernels import qkv_rope_cache as qkv_rope_cache_op
from flash_dllm.kernels import rope_cache as rope_cache_op
from flash_dllm.kernels import rope_cache_fp8 as rope_cache_fp8_op
from flash_dllm.kernels.paged_attention import seqlen_bound
from flash_dllm.kernels.rope_cache import inv_freq as rope_inv_freq
from flash_dllm.layers.attention import (attention_weights, masked_attention,
                                         masked_attention_batched)
from flash_dllm.layers.paged_index import _align4, page_slots, split_blocks
from flash_dllm.layers.rotary import Rotary
from flash_dllm.transfer import h2d


@dataclass
class VerifyRows:
    """A segment's verification block (``flash_dllm.decoding.verify``): packed rows
    ``start:end``, of which the first ``num_keys`` (the draft views) also serve as extra keys.
    ``allow`` [rows, canvas + num_keys] says which keys each row sees. The rows attend to the
    request's canvas keys and to those extra keys; their K/V are never written to the cache and
    no canvas row ever sees them."""

    start: int
    end: int
    num_keys: int
    allow: torch.Tensor


@dataclass
class Segment:
    """One request's rows of a packed step: ``start:end`` are its canvas rows, ``slots`` their
    canvas positions; ``pages``/``length`` its page ids (int32, device) and canvas length."""

    start: int
    end: int
    slots: torch.Tensor | None = None
    request_id: str = ""
    verify: VerifyRows | None = None       # decode="verify": extra rows after ``end``
    probe: torch.Tensor | None = None      # rows (from ``start``) whose attention is recorded
    probe_weights: torch.Tensor | None = None   # out: [probe rows, canvas], mean over heads
    pages: torch.Tensor | None = None
    length: int = 0


@dataclass
class PagedAttentionMetadata:
    """Everything one step's attention reads (built once per step by ``PagedAttentionBackend``).

    ``slots`` [T]: the page slot (``page * page_size + offset``) each packed row's K/V goes to, -1
    for rows that are never cached (verification rows). Request b owns packed rows
    ``cu_q[b]:cu_q[b+1]`` and attends to its ``seq_lens[b]`` canvas keys through
    ``block_table[b]``; ``max_q`` is a host bound on every request's row count (kernel grid) and
    ``max_k`` one on the key counts (``paged_attention.seqlen_bound``: lets small batches split
    each request's keys over more programs; 0 = unknown, never split)."""

    # inference on the paged cache: steps of more rows project q/k/v in chunks of this many
    # (``attend_chunked``), bounding a refresh step's peak memory
    QKV_CHUNK_ROWS = 4096

    kv: torch.Tensor               # [layers, 2, pages, page_size, kv_heads, head_dim]
    slots: torch.Tensor            # [T] int32 (host-built) or int64
    cu_q: torch.Tensor             # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32
    block_table: torch.Tensor      # [B, max_pages] int32
    max_q: int
    inv_freq: torch.Tensor         # [rotary_dim / 2] float32
    max_k: int = 0
    segments: list[Segment] = field(default_factory=list)
    probe_layer: int | None = None
    mass_layer: int | None = None  # the layer whose per-key mass is kept in ``mass``
    mass: torch.Tensor | None = None   # out: [B, max_pages * page_size]
    # tensor parallelism (``distributed/tp.TPState``: ``reduce_heads``, ``world``): per-head
    # statistics are summed over the ranks (each holds some heads), so every rank ranks keys by
    # the whole model's attention; None on one device
    tp: object = None
    # fp8 pools: [layers, 2, pages, kv_heads] fp32 scales (``kernels/kv_quant.py``); None: the
    # pool holds the model's dtype
    kv_scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.special = [s for s in self.segments if s.verify is not None or s.probe is not None]

    # ------------------------------------------------------------------------------ the layer
    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pages ``[pages, page_size, kv_heads, head_dim]`` that layer ``layer``
        writes and reads (the pool's; a request larger than the pool streams its own:
        ``cache/io/kv_overflow.py``)."""
        return self.kv[layer, 0], self.kv[layer, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp8 pools: layer ``layer``'s K and V scales ``[pages, kv_heads]``; else (None, None)."""
        if self.kv_scales is None:
            return None, None
        return self.kv_scales[layer, 0], self.kv_scales[layer, 1]

    def read_kv(self, layer: int, pages: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V of ``pages [..., n]`` as ``dtype`` values ``[..., n,
        page_size, kv_heads, head_dim]`` (copies; dequantised from an fp8 pool)."""
        (kc, vc), (ks, vs) = self.layer_kv(layer), self.layer_scales(layer)
        return (kv_quant.read_pages(kc, ks, pages, dtype),
                kv_quant.read_pages(vc, vs, pages, dtype))

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
        """``attn``'s attention for packed rows ``x`` [T, d] -> [T, H * D]."""
        qkv = attn.qkv_proj
        H, Hkv = attn.num_heads, attn.num_kv_heads
        # NOTE: an fp8 pool rotates and writes with the quantising kernel
        # (``kernels/rope_cache_fp8``) after the projection; with verification or probe rows
        # (eager steps) it takes the unfused path, as does a module that rotates part of each
        # head (LLaDA2) on an fp8 pool or more than half of it. q/k-normed heads (SDAR,
        # LLaDA-MoE, LLaDA2) are normed, rotated (whole, or LLaDA2's first half) and written by
        # the RoPE + page write kernel (its ``qk_norm``; normed in ``project`` when special
        # rows read k); only the kernels that project too skip them.
        partial = attn.rotary.rotary_dim < attn.head_dim
        if (partial and (self.kv_scales is not None or not rope_cache_op.takes_rotary(
                attn.rotary.rotary_dim, attn.head_dim))) or (self.kv_scales is not None
                                                             and self.special):
            return self.attend_normed(layer, attn, x, positions)
        if self.kv_scales is not None:
            return self.attend_fp8(layer, attn, x, positions)
        if qkv is not None and x.dim() == 2 and not self.special and attn.q_norm is None \
                and not partial:
            # (the fused kernel reads a plain weight: a quantized projection runs its own GEMM)
            # (deterministic: not for a few rows only, so a row's projection follows no batch)
            if qkv_rope_cache_op.ENABLED and hasattr(qkv, "weight") \
                    and not batch_invariant_active() \
                    and qkv_rope_cache_op.takes_triton(x, qkv.weight, self.kv):
                return self.attend_projected(layer, x, qkv, H, Hkv, positions, attn.rotary)
            if x.shape[0] > self.QKV_CHUNK_ROWS and not torch.is_grad_enabled():
                return self.attend_chunked(layer, x, qkv, H, Hkv, positions, attn.rotary,
                                           self.QKV_CHUNK_ROWS)
        if attn.q_norm is not None and not self.special and attn.q_norm.weight.dtype == x.dtype \
                and not torch.is_grad_enabled():
            # q/k norms inside the RoPE + page write kernel: no normed copies of q and k
            q, k, v = attn.project(x, norm=False)
            return self.attend(layer, q, k, v, positions, attn.rotary,
                               (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps))
        q, k, v = attn.project(x)
        return self.attend(layer, q, k, v, positions, attn.rotary)

    def attend_projected(self, layer: int, x: torch.Tensor, proj, num_heads: int,
                         num_kv_heads: int, positions: torch.Tensor, rotary: Rotary
                         ) -> torch.Tensor:
        """From the layer's normed input ``x`` [T, d]: one kernel projects q/k/v, rotates q/k and
        writes k/v into their page slots (``kernels.qkv_rope_cache``)."""
        kc, vc = self.layer_kv(layer)
        qr = qkv_rope_cache_op.op(x, proj.weight, proj.bias, positions, kc, vc, self.slots,
                                  self.inv_freq, num_heads, num_kv_heads, rotary.apply_in_fp32)
        return self._attend_rotated(layer, qr)

    def attend_chunked(self, layer: int, x: torch.Tensor, proj, num_heads: int,
                       num_kv_heads: int, positions: torch.Tensor, rotary: Rotary,
                       chunk: int) -> torch.Tensor:
        """From ``x`` [T, d] for a step of many rows (a full-canvas refresh): the projection +
        RoPE + page write run in row chunks, so the [T, (H + 2 Hkv) D] projection never exists
        whole (805 MB for batch 32 x 1024 rows of LLaDA-8B); only the rotated queries are kept
        for the attention, which runs once every key is in the pages."""
        kc, vc = self.layer_kv(layer)
        T, D = x.shape[0], kc.shape[-1]
        qr = torch.empty(T, num_heads, D, dtype=x.dtype, device=x.device)
        for i in range(0, T, chunk):
            j = min(T, i + chunk)
            q, k, v = rope_cache_op.split_qkv(proj(x[i:j]), num_heads, num_kv_heads, D)
            qr[i:j] = rope_cache_op.op(q, k, v, positions[i:j], kc, vc, self.slots[i:j],
                                       self.inv_freq, rotary.apply_in_fp32)
        return self._attend_rotated(layer, qr)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, rotary: Rotary, qk_norm=None) -> torch.Tensor:
        """From projected q [T, H, D], k/v [T, Hkv, D] (un-rotated; ``qk_norm``: not normed
        yet, the kernel norms them; never with special rows, which read k as given)."""
        kc, vc = self.layer_kv(layer)             # [pages, page_size, Hkv, D]
        R = rotary.rotary_dim
        if self.inv_freq.shape[0] * 2 != R:
            raise ValueError(f"the paged backend's RoPE frequencies cover "
                             f"{2 * self.inv_freq.shape[0]} rotary dims, the model's rotary "
                             f"{R}: build PagedAttentionBackend with rotary_dim={R}")
        qr = rope_cache_op.op(q, k, v, positions, kc, vc, self.slots, self.inv_freq,
                              rotary.apply_in_fp32, qk_norm,
                              None if R == kc.shape[-1] else R)   # rotated q; k/v in pages
        out = self._attend_rotated(layer, qr)
        for seg in self.special:
            self._special_rows(seg, layer, out, qr, k, v, positions, rotary)
        return out

    def attend_fp8(self, layer: int, attn, x: torch.Tensor, positions: torch.Tensor
                   ) -> torch.Tensor:
        """An fp8 pool: the projection (q/k normed when the module has the norms), then one
        op rotates q and k and quantises k / v into their pages (``kernels/rope_cache_fp8``:
        four launches, as ``write_kv``'s quantised write)."""
        q, k, v = attn.project(x)
        (kc, vc), (ks, vs) = self.layer_kv(layer), self.layer_scales(layer)
        qr = rope_cache_fp8_op.op(q, k, v, positions, kc, vc, ks, vs, self.slots,
                                  self.inv_freq, attn.rotary.apply_in_fp32)
        return self._attend_rotated(layer, qr)

    def attend_normed(self, layer: int, attn, x: torch.Tensor, positions: torch.Tensor
                      ) -> torch.Tensor:
        """For modules that rotate part of each head (LLaDA2), and for fp8 pools: the
        projection (q/k normed when the module has the norms) and the module's own rotary in
        PyTorch, then the page write (``write_kv``: quantising for fp8) and the paged attention;
        the fused RoPE kernels rotate whole heads and write the model's dtype."""
        q, k, v = attn.project(x)                      # q/k normed: [T, H, D], [T, Hkv, D]
        qr, kr = attn.rotary(q, positions), attn.rotary(k, positions)
        self.write_kv(layer, kr, v)
        out = self._attend_rotated(layer, qr)
        for seg in self.special:
            self._special_rows(seg, layer, out, qr, k, v, positions, attn.rotary)
        return out

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rotated ``k`` and ``v`` [T, Hkv, D] into their page slots (rows whose slot is
        negative, e.g. verification rows, are not written)."""
        kc, vc = self.layer_kv(layer)
        Hkv, D = kc.shape[-2], kc.shape[-1]
        slots = self.slots.long()
        if self.special:                   # (eager: only these steps have unwritten rows)
            keep = slots >= 0
            slots, k, v = slots[keep], k[keep], v[keep]
        if self.kv_scales is not None:     # fp8 codes; the pages' scales grow as needed
            # NOTE: K and V in ONE write: the layer's [2, pages] halves viewed as 2 x pages
            # pages (V's page p is page pages + p), so each step's write costs one set of
            # launches, not two
            P = kc.shape[0]
            kv_quant.write(self.kv[layer].view(2 * P, *kc.shape[1:]),
                           self.kv_scales[layer].view(2 * P, Hkv),
                           torch.cat([slots, slots + P * kc.shape[1]]), torch.cat([k, v]))
            return
        kc.view(-1, Hkv, D).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, Hkv, D).index_copy_(0, slots, v.to(vc.dtype))

    def _attend_rotated(self, layer: int, qr: torch.Tensor) -> torch.Tensor:
        """Paged attention of the rotated queries (their step's K/V already in the pages)."""
        kc, vc = self.layer_kv(layer)
        ks, vs = self.layer_scales(layer)
        track = layer == self.mass_layer
        out = paged_attention_op.op(qr, kc, vc, self.cu_q, self.seq_lens, self.block_table,
                                    self.max_q, return_mass=track, max_seqlen_k=self.max_k or None,
                                    k_scale=ks, v_scale=vs)
        if track:
            out, self.mass = out
            if self.tp is not None:
                self.tp.reduce_heads(self.mass)
        return out.flatten(1)                                      # [T, H * D]

    def _special_rows(self, seg: Segment, layer: int, out: torch.Tensor, qr: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      rotary: Rotary) -> None:
        if seg.verify is None and layer != self.probe_layer:
            return                        # a probe-only segment needs the probe layer alone
        ps = self.kv.shape[3]
        n = -(-seg.length // ps)
        idx = seg.pages[:n].long()
        kp, vp = self.read_kv(layer, idx, qr.dtype)                # [n, ps, Hkv, D] (copies)
        ks = kp.flatten(0, 1)[:seg.length]                         # [canvas, Hkv, D]
        vs = vp.flatten(0, 1)[:seg.length]
        if seg.verify is not None:
            vr = seg.verify
            d0, d1 = vr.start, vr.start + vr.num_keys
            kd = rotary(k[d0:d1], positions[d0:d1])                # draft views' keys, rotated
            out[vr.start:vr.end] = masked_attention(qr[vr.start:vr.end], ks, vs, kd, v[d0:d1],
                                                    vr.allow)
        if seg.probe is not None and layer == self.probe_layer:
            w = attention_weights(qr[seg.start:seg.end][seg.probe], ks)   # mean, local heads
            if self.tp is not None:
                w = self.tp.reduce_heads(w) / self.tp.world              # mean over all heads
            seg.probe_weights = w


@dataclass
class VerifyBatchMetadata(PagedAttentionMetadata):
    """A fused verify step's metadata (``decoding/policies/verify_fused.py``): every request has the same
    number of verification rows, ``2 (M - 1)`` for ``M`` (padded) drafts, packed after ALL the
    canvas rows: rows ``[canvas_rows, canvas_rows + B * 2 (M - 1))``, request b's block at
    ``canvas_rows + b * 2 (M - 1)``, draft views first, then mask views (as
    ``decoding.verify.VerifyBlock`` orders them). ``slots``, ``cu_q`` and the paged attention
    cover the canvas rows only; the verification rows attend, with static shapes, to each
    request's first ``dense_keys`` canvas keys read from its pages and to its draft views' keys,
    as ``verify_allow`` [B, 2 (M - 1), dense_keys + M - 1] allows (the verification block's
    ``allow``, padded). Their K/V are never written."""

    canvas_rows: int = 0
    num_verify: int = 0                      # M
    dense_keys: int = 0                      # a multiple of the page size
    verify_allow: torch.Tensor | None = None
    no_slots: torch.Tensor | None = None     # [B * 2 (M - 1)] all -1: RoPE without a page write
    key_pos: torch.Tensor | None = None      # [dense_keys] arange

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor
                  ) -> torch.Tensor:
        Tc, M = self.canvas_rows, self.num_verify
        out = super().attention(attn, layer, x[:Tc], positions[:Tc])   # writes the canvas K/V
        if M < 2:
            return out
        B, R = self.seq_lens.shape[0], 2 * (M - 1)
        q, k, v = attn.project(x[Tc:])                    # [B*R, H, D], [B*R, Hkv, D]
        kc, vc = self.layer_kv(layer)
        pos = positions[Tc:]
        rot = attn.rotary
        if self.kv_scales is None and rot.rotary_dim == attn.head_dim:
            qr = rope_cache_op.op(q, k, v, pos, kc, vc, self.no_slots, self.inv_freq,
                                  rot.apply_in_fp32)                    # rotated q, no write
        else:        # (the RoPE kernels take caches of q's dtype only; partial: the module's)
            qr = rot(q, pos)
        Hkv, D = k.shape[1], k.shape[2]
        k, v, pos = k.view(B, R, Hkv, D), v.view(B, R, Hkv, D), pos.view(B, R)
        kd = attn.rotary(k[:, :M - 1].reshape(-1, Hkv, D), pos[:, :M - 1].reshape(-1))
        idx = self.block_table[:, :self.dense_keys // kc.shape[1]].long()   # [B, pages]
        kp, vp = self.read_kv(layer, idx, qr.dtype)       # [B, pages, ps, Hkv, D] (copies)
        ks = kp.flatten(1, 2)                             # [B, dense_keys, Hkv, D]
        # NOTE: keys past a request's canvas are slots nobody wrote (the pool is torch.empty:
        # any bits, NaN too). Their scores are masked, but 0 x NaN in p @ v is NaN: zero them
        past = self.key_pos[None, :] >= self.seq_lens[:, None]          # [B, dense_keys]
        vs = vp.flatten(1, 2).masked_fill(past[:, :, None, None], 0)
        o = masked_attention_batched(qr.view(B, R, -1, D), ks, vs, kd.view(B, M - 1, Hkv, D),
                                     v[:, :M - 1], self.verify_allow)
        return torch.cat([out, o.view(B * R, -1)])


class PagedAttentionBackend:
    """Owns the KV page pool of one model and builds each step's ``PagedAttentionMetadata``."""

    def __init__(self, kv: torch.Tensor, head_dim: int, rope_theta: float, tp=None,
                 scales: torch.Tensor | None = None, rotary_dim: int | None = None) -> None:
        self.kv = kv                        # [layers, 2, pages, page_size, kv_heads, head_dim]
        self.scales = scales                # fp8 pools: [layers, 2, pages, kv_heads] fp32
        self.page_size = kv.shape[3]
        # the model's frequencies: over its rotary dims (LLaDA2: half of each head), the same
        # expression as ``layers.rotary.Rotary``'s
        self.inv_freq = rope_inv_freq(rotary_dim or head_dim, rope_theta, kv.device)
        self.tp = tp                        # tensor parallelism (see PagedAttentionMetadata)

    def release(self, request_id: str) -> None:
        """A request left (its pages are the KV manager's to reuse): nothing to drop here."""

    def build(self, table: np.ndarray, canvas_lens: list[int], positions: torch.Tensor,
              pos_host: np.ndarray | None, cu: list[int], uncached: list[tuple[int, int]],
              segments: list[Segment] | None = None, probe_layer: int | None = None,
              mass_layer: int | None = None, block_size: int = 0) -> PagedAttentionMetadata:
        """The step's metadata. ``table`` [B, width] int32: page ids per request (the runner's
        cached block table); ``cu``: per-request packed row boundaries; ``uncached``: row ranges
        never written to the pool (verification rows). When every packed position is a host range
        (``pos_host``: no flash top-k, sentinel refresh or verification rows), slots, block
        table, ``cu_q`` and ``seq_lens`` are computed on the host and cross in ONE int32 copy.

        NOTE: the table is always as wide as the longest possible canvas (the kernels read only
        each request's own columns), so a step's shape, hence its CUDA graph, does not depend on
        how long the requests' canvases happen to be."""
        ps, dev = self.page_size, self.kv.device
        if block_size:
            if pos_host is None or segments and any(s.verify is not None or s.probe is not None
                                                    for s in segments) or mass_layer is not None:
                raise ValueError("a block-causal step takes contiguous windows only (no extra "
                                 "positions, verification rows, probes or attention mass)")
            table, canvas_lens, cu = split_blocks(table, canvas_lens, pos_host, cu, block_size)
        B, width = table.shape
        T = positions.shape[0]
        # NOTE: each part starts on a 16-byte boundary. Triton compiles a kernel variant per
        # alignment of its pointer arguments: parts packed back to back started wherever T and
        # B put them, and a serving mix of batch shapes compiled ~8 more variants of the paged
        # attention kernel (2.5-3.5 s each) after the warm-up, while requests waited (issue 21)
        o_cu = _align4(T)
        o_lens = _align4(o_cu + B + 1)
        o_table = _align4(o_lens + B)
        host = np.zeros(o_table + B * width, dtype=np.int32)
        host[o_table:].reshape(B, width)[:] = table
        host[o_cu:o_cu + B + 1] = cu
        host[o_lens:o_lens + B] = canvas_lens
        if pos_host is not None:           # one request per range, in batch order
            host[:T] = page_slots(table, np.repeat(np.arange(B), np.diff(cu)), pos_host, ps)
        dev_all = h2d(host, torch.int32, dev)
        cu_t, lens_t = dev_all[o_cu:o_cu + B + 1], dev_all[o_lens:o_lens + B]
        table_t = dev_all[o_table:].view(B, width)
        counts = [b - a for a, b in zip(cu, cu[1:])]
        if pos_host is not None:
            slots = dev_all[:T]
        else:
            req_idx = torch.repeat_interleave(torch.arange(B, device=dev),
                                              h2d(counts, torch.long, dev), output_size=T)
            slots = table_t[req_idx, positions // ps].long() * ps + positions % ps
            for a, b in uncached:           # verification rows: never written to the cache
                slots[a:b] = -1
        return PagedAttentionMetadata(self.kv, slots, cu_t, lens_t, table_t, max(counts),
                                      self.inv_freq, seqlen_bound(max(canvas_lens)),
                                      segments or [], probe_layer, mass_layer,
                                      tp=self.tp, kv_scales=self.scales)
