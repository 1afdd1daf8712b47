"""Padded forward shapes (``worker/graphs.py``): a CUDA graph captured for a bucket serves every
step that rounds up to it. On the CPU the padding itself is checked against the unpadded step
(same reference kernels, no graph): the real rows' hidden states and every real page's K/V are
what the unpadded step computes; padding rows only touch the scratch page. The graphs themselves
are checked on the GPU (``tests/gpu/test_engine_gpu.py``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_sampler import tiny

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.worker.graphs import (ForwardGraphs, GraphCache, PaddedShape, _ForwardGraph,
                                      pad_step, padded_shape)
from flash_dllm.worker.warmup import graph_grid


def test_padded_shape_buckets():
    assert padded_shape(89, 1, 89, 256) == PaddedShape(128, 1, 128, 256)
    assert padded_shape(3, 3, 1, 256) == PaddedShape(16, 4, 16, 256)
    assert padded_shape(2250, 25, 104, 256) == PaddedShape(4096, 32, 128, 256)
    # GEMM-bound (or past max_tokens): rows stay exact, requests and max_q still round up
    assert padded_shape(800, 25, 32, 256, heavy_tokens=62) == PaddedShape(800, 32, 32, 256)
    assert padded_shape(5000, 40, 128, 256, max_tokens=6000) == PaddedShape(5000, 64, 128, 256)
    # a step never rounds down
    for T, B, q in [(1, 1, 1), (16, 16, 1), (17, 9, 17), (700, 64, 30)]:
        s = padded_shape(T, B, q, 0)
        assert s.T >= T and s.B >= B and s.max_q >= q


def _steps(n_steps=3, **cfg):
    """(engine, [(ids, positions, meta)]): the forward inputs of a few real steps of a batch of
    requests with different prompt lengths and cache modes."""
    model = tiny()
    eng = Engine(model, model.cfg, EngineConfig(page_size=4, max_num_seqs=8, **cfg))
    seen = []
    real = eng.runner._forward

    def spy(ids, positions, meta):
        out = real(ids, positions, meta)
        seen.append((ids.clone(), positions.clone(), replace(meta)))
        return out
    eng.runner._forward = spy
    for i, (n, cache) in enumerate([(5, "none"), (9, "dual"), (3, "dual"), (12, "none")]):
        eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=16, block_length=8,
                                                              cache=cache), str(i))
    for _ in range(n_steps):
        eng.step()
    return eng, seen


def _with_scratch(eng, meta):
    """The step's metadata over a copy of the pool with one more (scratch) page."""
    kv = eng.runner.kv
    pool = torch.cat([kv, torch.full_like(kv[:, :, :1], float("nan"))], dim=2).clone()
    return replace(meta, kv=pool), pool.shape[2] - 1


@torch.inference_mode()
def test_padding_rows_leave_real_rows_and_pages_alone():
    eng, steps = _steps()
    model = eng.model
    for ids, pos, meta in steps:
        ref_meta, scratch = _with_scratch(eng, meta)
        want = model.hidden(ids, pos, ref_meta)
        want_kv = ref_meta.kv.clone()
        pad_meta, _ = _with_scratch(eng, meta)
        shape = padded_shape(ids.shape[0], meta.seq_lens.shape[0], meta.max_q, meta.max_k)
        assert shape.T > ids.shape[0] and shape.B >= meta.seq_lens.shape[0]
        p_ids, p_pos, p_meta = pad_step(ids, pos, pad_meta, shape, scratch)
        got = model.hidden(p_ids, p_pos, p_meta)
        T = ids.shape[0]
        torch.testing.assert_close(got[:T], want, rtol=1e-5, atol=1e-5)
        # every page but the scratch one holds what the unpadded step wrote
        torch.testing.assert_close(pad_meta.kv[:, :, :scratch], want_kv[:, :, :scratch],
                                   rtol=1e-5, atol=1e-5, equal_nan=True)
        assert not torch.equal(pad_meta.kv[:, :, scratch].nan_to_num(7.0),
                               want_kv[:, :, scratch].nan_to_num(7.0))


@torch.inference_mode()
def test_a_graph_buffer_reloaded_with_a_smaller_step():
    """``ForwardGraphs._load`` into buffers padded for a bigger step (stale rows, stale request
    slots): the smaller step's rows come out as computed unpadded, and the stale rows' slots no
    longer point at real pages."""
    eng, steps = _steps(n_steps=4)
    model = eng.model
    big = max(steps, key=lambda s: s[0].shape[0])
    small = min(steps, key=lambda s: (s[2].seq_lens.shape[0], s[0].shape[0]))
    meta_big, scratch = _with_scratch(eng, big[2])
    shape = padded_shape(big[0].shape[0], big[2].seq_lens.shape[0], big[2].max_q, big[2].max_k)
    s_ids, s_pos, s_meta = pad_step(big[0], big[1], meta_big, shape, scratch)
    g = _ForwardGraph(None, s_ids, s_pos, s_meta, None, pads=True)
    fg = ForwardGraphs(model, GraphCache(4), scratch_page=scratch)
    ids, pos, meta = small
    assert ids.shape[0] < big[0].shape[0]
    ref_meta = replace(meta, kv=s_meta.kv.clone())
    want = model.hidden(ids, pos, ref_meta)
    fg._load(g, ids, pos, meta)
    assert g.meta.max_q >= meta.max_q
    got = model.hidden(g.ids, g.positions, g.meta)
    torch.testing.assert_close(got[:ids.shape[0]], want, rtol=1e-5, atol=1e-5)
    ps = eng.runner.page_size
    assert (g.meta.slots[ids.shape[0]:] == scratch * ps).all()
    torch.testing.assert_close(g.meta.kv[:, :, :scratch], ref_meta.kv[:, :, :scratch],
                               rtol=1e-5, atol=1e-5, equal_nan=True)


def test_pad_step_refuses_a_step_bigger_than_its_bucket():
    eng, steps = _steps(n_steps=1)
    ids, pos, meta = steps[0]
    with pytest.raises(ValueError, match="does not fit the bucket"):
        pad_step(ids, pos, meta, PaddedShape(1, 1, 16, 0), 0)


def test_graph_grid_is_empty_without_graphs_and_covers_the_buckets():
    model = tiny()
    eng = Engine(model, model.cfg, EngineConfig(max_num_seqs=64))
    assert graph_grid(eng, "full") == []            # the CPU: no forward graphs

    class FG:                                        # the grid only reads these
        scratch_page, max_tokens = 0, 8192
    eng.runner.forward_graphs = FG()
    grid = graph_grid(eng, "full")
    assert len(grid) == len(set(grid))
    # every step of <= 64 requests, <= 128 rows each, rounds up to a bucket of the grid
    for T, B, q in [(89, 1, 89), (2250, 25, 104), (800, 25, 32), (40, 2, 32), (8000, 64, 128)]:
        assert padded_shape(T, B, q, 256) in grid, (T, B, q)
    assert graph_grid(eng, "none") == []
    eng.runner.graph_cache.heavy_tokens = 62         # a GEMM-bound model: small buckets only
    assert {s.T for s in graph_grid(eng, "full")} <= {16, 32, 64, 128}
