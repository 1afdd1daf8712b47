"""The engine on the paged KV cache against the plain PyTorch oracle (``tests/dense_oracle.py``:
a canvas-sized cache per request, one SDPA call per request).

On the CPU the paged path runs the kernels' PyTorch references (``kernels.rope_cache``,
``kernels.paged_attention``), so this checks the layout, the block tables, the slot mapping and the
per-step index tensors; tests/test_kernels.py checks each kernel against its reference and
tests/gpu checks the kernels (and CUDA graphs) on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from dense_oracle import use_dense_oracle
from test_sampler import PROMPTS, run_engine, tiny
from conftest import EXACT

LONG = [[(7 * i + 3) % 90 + 5 for i in range(n)] for n in (3, 21, 40, 9)]


def run_dense(model, prompts, params, **config):
    eng = use_dense_oracle(Engine(model, model.cfg, EngineConfig(**config)))
    reqs = [eng.add_request(p, params if isinstance(params, SamplingParams) else params[i])
            for i, p in enumerate(prompts)]
    while eng.has_unfinished():
        eng.step()
    return reqs, [eng.output(r) for r in reqs]


def _same(model, prompts, params, **paged_kw):
    dense, od = run_dense(model, prompts, params)
    paged, op = run_engine(model, prompts, params, config=EngineConfig(**paged_kw))
    for a, b, x, y in zip(dense, paged, od, op):
        assert torch.equal(a.canvas, b.canvas)
        assert x.num_forwards == y.num_forwards
    return op


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("decode", ["vanilla", "threshold", "verify"])
def test_paged_equals_dense(family, cache, decode):
    model = tiny(family, seed=1)
    params = SamplingParams(max_tokens=24, block_length=8, steps=12, cache=cache, decode=decode,
                            threshold=0.3, gamma=0.4, early_stop=False)
    _same(model, PROMPTS, params)


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_page_sizes_and_mixed_lengths(page_size):
    """Page boundaries inside and across blocks; requests of different lengths in one forward."""
    model = tiny("dream", seed=2)
    params = [SamplingParams(max_tokens=16, block_length=8, cache=c, decode=d, threshold=0.2)
              for c, d in [("dual", "threshold"), ("prefix", "vanilla"), ("none", "threshold"),
                           ("dual", "verify")]]
    _same(model, LONG, params, page_size=page_size)


def test_sentinels_on_paged():
    model = tiny("llada", seed=3)
    params = SamplingParams(max_tokens=16, block_length=8, decode="verify", threshold=0.6,
                            gamma=0.3, cache="dual", kv_jaccard_min=0.9, kv_top_k=3,
                            entropy_max=2.0, early_stop=False)
    _same(model, PROMPTS, params)


def test_pages_hold_the_canvas_kv():
    """After a step, the request's pages hold exactly the K/V the dense path keeps for it."""
    model = tiny("llada", seed=4)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="vanilla")
    engines = {lay: Engine(model, model.cfg, EngineConfig(page_size=4))
               for lay in ("dense", "paged")}
    use_dense_oracle(engines["dense"])
    reqs = {lay: e.add_request(PROMPTS[1], params) for lay, e in engines.items()}
    for e in engines.values():
        e.step()
        e.step()
    r = reqs["paged"]
    kv = engines["paged"].runner.kv                           # [layers, 2, pages, ps, Hkv, D]
    rows = torch.tensor(engines["paged"].kv_manager.pages(r.request_id))
    paged = kv[:, :, rows].flatten(2, 3)[:, :, :r.canvas_len]  # [layers, 2, canvas, Hkv, D]
    dense = engines["dense"].runner.backend.caches[reqs["dense"].request_id]
    assert torch.equal(paged[0], dense[0])       # layer 0: the same projections and RoPE, bit-exact
    # deeper layers: the attention sums run in another order (einsum vs SDPA), float32 noise
    torch.testing.assert_close(paged, dense, rtol=1e-4, atol=1e-5)


def test_pool_is_the_storage_and_frees():
    model = tiny("llada")
    eng = Engine(model, model.cfg, EngineConfig(num_kv_pages=8, page_size=4))
    assert eng.runner.kv.shape == (2, 2, 8, 4, model.cfg.num_kv_heads, model.cfg.head_dim)
    r = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, block_length=8, **EXACT))
    eng.step()
    assert eng.pool.num_used == 3
    assert eng.runner._states[r.request_id].page_row.dtype == torch.int32
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_used == 0


def test_fused_projections_same_tokens():
    model = tiny("dream", seed=5)
    params = SamplingParams(max_tokens=16, block_length=8, cache="dual", decode="threshold",
                            threshold=0.3)
    ref, _ = run_engine(model, PROMPTS, params)
    fused, _ = run_engine(model, PROMPTS, params, config=EngineConfig(fuse_projections=True))
    assert model.layers[0].attn.qkv_proj is not None and model.layers[0].mlp.gate_up_proj is not None
    assert all(torch.equal(a.canvas, b.canvas) for a, b in zip(ref, fused))


def test_engine_config_validation():
    for kw, match in [(dict(cuda_graphs=1), "cuda_graphs"),
                      (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
                      (dict(max_cuda_graphs=0), "max_cuda_graphs")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kw)
    model = tiny("llada")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine(model, model.cfg, EngineConfig(gpu_memory_utilization=0.5))


def test_mlp_row_chunks_match_whole(monkeypatch):
    model = tiny("llada", seed=6)
    x = torch.randn(50, model.cfg.hidden_size)
    mlp = model.layers[0].mlp
    with torch.no_grad():
        whole = mlp(x)
        monkeypatch.setattr(type(mlp), "CHUNK_ROWS", 16)
        chunked = mlp(x)
    # the same rows and weights; a GEMM with fewer rows may block its sums differently
    torch.testing.assert_close(whole, chunked, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cache", ["dual", "prefix", "flash"])
def test_qkv_row_chunks_match_whole(monkeypatch, cache):
    """Steps of more than QKV_CHUNK_ROWS rows project q/k/v + RoPE + page write in row chunks
    (PagedAttentionMetadata.attend_chunked): same tokens as the whole-step projection."""
    from flash_dllm.layers.attention_backend import PagedAttentionMetadata as PagedContext
    model = tiny("llada", seed=8)
    params = SamplingParams(max_tokens=16, block_length=8, cache=cache, decode="threshold",
                            threshold=0.3, early_stop=False)
    whole, _ = run_engine(model, PROMPTS, params, config=EngineConfig(fuse_projections=True))
    calls = []
    real = PagedContext.attend_chunked

    def spy(self, *args):
        calls.append(args[1].shape[0])
        return real(self, *args)
    monkeypatch.setattr(PagedContext, "QKV_CHUNK_ROWS", 5)
    monkeypatch.setattr(PagedContext, "attend_chunked", spy)
    chunked, _ = run_engine(model, PROMPTS, params, config=EngineConfig(fuse_projections=True))
    assert calls and max(calls) > 5                           # refresh steps were chunked
    assert all(torch.equal(a.canvas, b.canvas) for a, b in zip(whole, chunked))


# ------------------------------------------------------------------------------ cache="flash"
def test_flash_with_unbounded_budget_recomputes_everything():
    """A budget that covers the whole canvas makes every flash step recompute every position,
    i.e. the exact mode (``none``) in another row order."""
    model = tiny("llada", seed=7)
    for decode in ("vanilla", "threshold"):
        kw = dict(max_tokens=16, block_length=8, decode=decode, threshold=0.3, early_stop=False)
        exact, _ = run_engine(model, PROMPTS, SamplingParams(cache="none", **kw))
        flash, _ = run_engine(model, PROMPTS, SamplingParams(cache="flash", flash_budget=10**6,
                                                             **kw))
        assert all(torch.equal(a.canvas, b.canvas) for a, b in zip(exact, flash))


def test_flash_query_is_window_plus_top_mass(monkeypatch):
    model = tiny("dream", seed=8)
    params = SamplingParams(max_tokens=16, block_length=8, cache="flash", flash_budget=3,
                            decode="vanilla", early_stop=False)
    eng = Engine(model, model.cfg)
    req = eng.add_request(LONG[1], params)
    seen = []
    orig = eng.runner.forward

    def spy(ids, positions, ctx):
        seen.append(positions.clone())
        return orig(ids, positions, ctx)
    monkeypatch.setattr(eng.runner, "forward", spy)
    masses = []
    while eng.has_unfinished():
        st = eng.runner._states.get(req.request_id)
        masses.append(None if st is None or st.attn_mass is None else st.attn_mass.clone())
        info = (req.block, req.first_step, req.block_start, req.block_end)
        eng.step()
        pos, mass = seen[-1], masses[-1]
        block, first, b0, b1 = info
        if block == 0 and first:
            assert torch.equal(pos, torch.arange(req.canvas_len))          # the prefill
            continue
        w0 = (b0 - 8 if first else b0) - 1                                # Dream: shift 1
        window = torch.arange(w0, b1)
        assert torch.equal(pos[:window.numel()], window)
        extra = pos[window.numel():]
        assert extra.numel() == 3
        outside = mass.clone()
        outside[w0:b1] = -1
        assert set(extra.tolist()) == set(outside.topk(3).indices.tolist())
    assert not (req.canvas == model.cfg.mask_token_id).any()


def test_flash_batched_equals_solo_and_dense():
    """cache="flash" batched equals solo, and the paged kernel's attention mass (which picks
    the top-k) the dense oracle's exact softmax mass: the same tokens."""
    model = tiny("llada", seed=9)
    params = SamplingParams(max_tokens=16, block_length=8, cache="flash", flash_budget=4,
                            decode="threshold", threshold=0.4)
    together, _ = run_engine(model, LONG, params)
    for p, r in zip(LONG, together):
        solo, _ = run_engine(model, [p], params)
        assert torch.equal(solo[0].canvas, r.canvas)
    _same(model, LONG, params)


def _top_k_one_by_one(conf, positions, bounds, ks, lens):
    """The per-request rule (LLaDA's loop): one topk over a canvas-length row per request."""
    keep = torch.zeros_like(conf, dtype=torch.bool)
    for (s, e), k, n in zip(bounds, ks, lens):
        row = torch.full((n,), float("-inf"))
        row[positions[s:e]] = conf[s:e]
        chosen = torch.topk(row, min(k, e - s)).indices
        local = torch.zeros(n, dtype=torch.bool)
        local[chosen] = True
        keep[s:e] = local[positions[s:e]]
    return keep


@pytest.mark.parametrize("ks", [[1, 6], [3, 3], [8, 2], [5, 7]])
def test_batched_top_k_keeps_the_reference_tie_order(ks):
    """Saturated (tied) confidences: the batched rule commits exactly the per-request rule's slots,
    also when requests of the same canvas length commit different counts."""
    from flash_dllm.decoding.policies import select_top_k
    conf = torch.ones(16)
    positions = torch.cat([torch.arange(4, 12), torch.arange(4, 12)])
    bounds, lens = [(0, 8), (8, 16)], [16, 16]
    assert torch.equal(select_top_k(conf, positions, bounds, ks, lens),
                       _top_k_one_by_one(conf, positions, bounds, ks, lens))


def random_top_k_case(seed: int, device: str = "cpu"):
    """Many requests of mixed canvas lengths and k, confidences from a few values (ties
    everywhere), candidate slots anywhere in each canvas: (conf, positions, bounds, ks, lens)."""
    g = torch.Generator().manual_seed(seed)
    conf, positions, bounds, ks, lens = [], [], [], [], []
    start = 0
    for _ in range(int(torch.randint(1, 24, (1,), generator=g))):
        # a few canvas lengths, so several groups share a (length, k) topk batch
        n = (8, 17, 40, 79)[int(torch.randint(0, 4, (1,), generator=g))]
        m = int(torch.randint(0, min(n, 32) + 1, (1,), generator=g))
        pos = torch.randperm(n, generator=g)[:m].sort().values
        levels = torch.tensor([1.0, 1.0, 0.5, 0.25, 1e-3])
        conf.append(levels[torch.randint(0, 5, (m,), generator=g)])
        positions.append(pos)
        bounds.append((start, start + m))
        ks.append(int(torch.randint(0, 5, (1,), generator=g)))
        lens.append(n)
        start += m
    return (torch.cat(conf).to(device), torch.cat(positions).to(device), bounds, ks, lens)


@pytest.mark.parametrize("seed", range(12))
def test_batched_top_k_equals_per_request_rule_on_random_ties(seed):
    """Mixed lengths (many topk batches sharing one buffer), k of 0..4, ties everywhere."""
    from flash_dllm.decoding.policies import select_top_k
    case = random_top_k_case(seed)
    assert torch.equal(select_top_k(*case), _top_k_one_by_one(*case))


def test_flash_mixed_budgets_batched_equals_solo():
    model = tiny("dream", seed=10)
    params = [SamplingParams(max_tokens=16, block_length=8, cache="flash", flash_budget=b,
                             decode="vanilla") for b in (1, 5, 0, 9)]
    together, _ = run_engine(model, LONG, params)
    for p, prm, r in zip(LONG, params, together):
        solo, _ = run_engine(model, [p], prm)
        assert torch.equal(solo[0].canvas, r.canvas)


def test_backend_built_for_another_rotary_width_is_an_error_not_a_silent_rotation():
    """The paged backend's RoPE frequencies cover the rotary dims it was built for
    (``PagedAttentionBackend(rotary_dim=)``); a module rotating another width is a ValueError
    naming both, raised before anything is written to the pool."""
    from flash_dllm.layers.attention_backend import PagedAttentionBackend, PagedAttentionMetadata
    from flash_dllm.layers.rotary import Rotary
    D, Hkv, H, T = 16, 2, 4, 3
    kv = torch.zeros(1, 2, 4, 16, Hkv, D)
    backend = PagedAttentionBackend(kv, D, 10000.0)                 # whole heads: 16 dims
    meta = PagedAttentionMetadata(kv, torch.arange(T), torch.tensor([0, T], dtype=torch.int32),
                                  torch.tensor([T], dtype=torch.int32),
                                  torch.zeros(1, 4, dtype=torch.int32), T, backend.inv_freq)
    q, k, v = torch.randn(T, H, D), torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    with pytest.raises(ValueError, match="cover 16 rotary dims, the model's rotary 8"):
        meta.attend(0, q, k, v, torch.arange(T), Rotary(D, 10000.0, True, rotary_dim=8))
    assert not kv.any()
    half = PagedAttentionBackend(kv, D, 10000.0, rotary_dim=8)     # built for it: 4 frequencies
    assert half.inv_freq.shape == (4,)
