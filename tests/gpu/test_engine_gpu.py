"""The engine on the GPU: paged layout with Triton kernels and CUDA graphs, on the shipped demo model.

Run on the GPU box: ``python -m pytest -m gpu tests/gpu -q``.
- CUDA graphs replay exactly what the eager paged forward computes (same kernels): identical tokens.
- The paged Triton path and the plain PyTorch oracle (``tests/dense_oracle.py``) give the same answers
  (float32; the two attention implementations sum in different orders, so a near-tie could flip:
  the bound is a 95 % agreement on 64 held-out problems, and accuracy within 2 points).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from dense_oracle import use_dense_oracle

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.evals.tasks import get_suite

SUITE = get_suite("arith")
PROBLEMS = SUITE.test_problems(64, seed=0)


def _run(dtype, cache, decode, first_capture=None, dense=False, **cfg):
    llm = LLM(device="cuda", dtype=dtype, engine_config=EngineConfig(**cfg))
    if dense:
        use_dense_oracle(llm.engine)
    if first_capture is not None:
        # the demo model finishes a block in ~2 forwards and the batch changes all the time, so
        # a fused shape rarely comes back: capture at the first sighting to exercise the graphs
        llm.engine.runner.fused.first_capture = first_capture
    params = SamplingParams(max_tokens=64, block_length=32, cache=cache, decode=decode)
    outs = llm.generate([p.prompt for p in PROBLEMS], params)
    return llm, [o.text for o in outs]


@pytest.mark.parametrize("cache,decode", [("dual", "vanilla"), ("prefix", "threshold"),
                                          ("dual", "verify"), ("flash", "vanilla")])
def test_cuda_graphs_equal_eager(cache, decode):
    llm_g, graphs = _run("bfloat16", cache, decode, max_num_seqs=8, fused_step=False)
    _, eager = _run("bfloat16", cache, decode, max_num_seqs=8, cuda_graphs=False)
    assert graphs == eager
    st = llm_g.engine.runner.forward_graphs.stats
    if decode == "vanilla":          # 32 steps per block: the block-sized step shape repeats
        assert st["graph_replays"] > 0, st


@pytest.mark.parametrize("cache,decode", [("dual", "vanilla"), ("dual", "threshold"),
                                          ("none", "vanilla")])
def test_paged_triton_matches_dense_path(cache, decode):
    _, paged = _run("float32", cache, decode, max_num_seqs=64)
    _, dense = _run("float32", cache, decode, max_num_seqs=64, dense=True)
    agree = sum(a == b for a, b in zip(paged, dense)) / len(paged)
    acc = [SUITE.accuracy(PROBLEMS, texts) for texts in (paged, dense)]
    assert agree >= 0.95, agree
    assert abs(acc[0] - acc[1]) <= 0.02, acc


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache,decode", [("dual", "threshold"), ("prefix", "threshold"),
                                          ("dual", "vanilla"), ("dual", "verify"),
                                          ("prefix", "verify")])
def test_fused_step_matches_general_path(dtype, cache, decode):
    """The whole-step graph (worker/fused_step.py) against the general path (forward graph +
    eager proposal/commit). Its LM head GEMM has all block rows, the general one the masked rows
    only, so cuBLAS may round differently: near-ties may flip (same bound as paged vs dense)."""
    llm_f, fused = _run(dtype, cache, decode, first_capture=1, max_num_seqs=8, fused_step=True)
    _, general = _run(dtype, cache, decode, max_num_seqs=8, fused_step=False)
    assert llm_f.engine.runner.fused.stats["fused_steps"] > 0
    agree = sum(a == b for a, b in zip(fused, general)) / len(fused)
    acc = [SUITE.accuracy(PROBLEMS, texts) for texts in (fused, general)]
    print(f"fused vs general ({dtype}, {cache}, {decode}): {agree:.3f} identical answers, accuracy {acc}")
    assert agree >= 0.95, agree
    assert abs(acc[0] - acc[1]) <= 0.02, acc


@pytest.mark.parametrize("cache,decode,steps", [("dual", "threshold", None),
                                                ("prefix", "threshold", None),
                                                ("dual", "vanilla", None), ("dual", "vanilla", 2)])
def test_fused_step_graphs_random_model(cache, decode, steps):
    """A random-init model of the demo shape is unsure of everything, so threshold commits one
    token per step: 32 steps per block, so the fused graphs are captured and replayed across
    blocks and batch changes (requests of different lengths finish at different times)."""
    from flash_dllm.bench.shapes import shape_config
    from flash_dllm.engine.engine import Engine
    from flash_dllm.models.loader import build_model
    model = build_model(shape_config("demo"), device=torch.device("cuda"), dtype="float32",
                        seed=0)
    prompts = [[(7 * i + j) % 90 + 5 for j in range(n)] for i, n in enumerate([5, 40, 17, 3])]
    # steps=2: vanilla commits 16 a step (k > 1 per (canvas length, k) group)
    params = [SamplingParams(max_tokens=m, block_length=32, cache=cache, decode=decode,
                             steps=m // 32 * (steps or 32), early_stop=False)
              for m in (64, 96, 32, 64)]
    canvases = []
    for fused in (True, False):
        eng = Engine(model, model.cfg, EngineConfig(max_num_seqs=4, fused_step=fused))
        if fused:
            eng.runner.fused.first_capture = 1   # few shapes repeat here (see test above)
        reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished():
            eng.step()
        canvases.append([r.canvas for r in reqs])
        if fused:
            st = eng.runner.fused.stats
            assert st["fused_steps"] > (2 if steps else 50), st
    for a, b in zip(*canvases):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_fused_verify_graphs_random_model(cache):
    """Fused verify steps (decoding/policies/verify_fused.py) captured and replayed on a random model of the
    demo shape, against the general path's eager verify steps: one token per step passes tau,
    so every step verifies up to 31 drafts (gamma 1e-6: agreement alone decides). The batched verification
    attention sums in another order than the per-request one, so a near-tie may flip: at most
    one of the four requests may differ."""
    from flash_dllm.bench.shapes import shape_config
    from flash_dllm.engine.engine import Engine
    from flash_dllm.models.loader import build_model
    model = build_model(shape_config("demo"), device=torch.device("cuda"), dtype="float32",
                        seed=0)
    prompts = [[(7 * i + j) % 90 + 5 for j in range(n)] for i, n in enumerate([5, 40, 17, 3])]
    params = [SamplingParams(max_tokens=m, block_length=32, cache=cache, decode="verify",
                             gamma=1e-6, max_verify=v, early_stop=False)
              for m, v in ((64, 32), (96, 8), (32, 32), (64, 1))]
    runs = []
    for fused in (True, False):
        eng = Engine(model, model.cfg, EngineConfig(max_num_seqs=4, fused_step=fused))
        if fused:
            eng.runner.fused.first_capture = 1
        reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished():
            eng.step()
        runs.append(reqs)
        if fused:
            st = eng.runner.fused.stats
            assert st["fused_replays"] > 20, st
    assert sum(r.counters["verify_accepted"] for r in runs[0]) > 0
    same = sum(torch.equal(a.canvas, b.canvas) for a, b in zip(*runs))
    assert same >= 3, same


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache,decode", [("none", "vanilla"), ("dual", "threshold")])
def test_padded_graphs_after_the_warm_up(dtype, cache, decode):
    """The warm-up's graph grid (padded buckets captured from dummy rows), then serving-like
    batches of varied prompt lengths and sizes: nothing is captured after ready, most forwards
    replay a padded graph, and the answers are those of the eager engine (padding changes the
    GEMMs' row count, so cuBLAS may round differently: the paged-vs-dense bound)."""
    from flash_dllm.worker.warmup import graph_grid

    llm = LLM(device="cuda", dtype=dtype,
              engine_config=EngineConfig(max_num_seqs=16, fused_step=False))
    eng = llm.engine
    assert eng.runner.warm_graphs(graph_grid(eng, "full")) > 0
    eng.graphs_ready()
    st = eng.runner.forward_graphs.stats
    before = dict(st)
    params = SamplingParams(max_tokens=64, block_length=32, cache=cache, decode=decode)
    graphs = [o.text for o in llm.generate([p.prompt for p in PROBLEMS], params)]
    assert st["graph_captures"] == before["graph_captures"], st
    replays, eager_n = (st[k] - before[k] for k in ("graph_replays", "eager_forwards"))
    assert replays > 4 * eager_n, st
    _, eager = _run(dtype, cache, decode, max_num_seqs=16, cuda_graphs=False)
    agree = sum(a == b for a, b in zip(graphs, eager)) / len(graphs)
    acc = [SUITE.accuracy(PROBLEMS, texts) for texts in (graphs, eager)]
    print(f"padded graphs vs eager ({dtype}, {cache}, {decode}): {agree:.3f} identical, "
          f"accuracy {acc}, {replays} replays, {eager_n} eager")
    assert agree >= 0.95, agree
    assert abs(acc[0] - acc[1]) <= 0.02, acc


@pytest.mark.parametrize("dtype,cache,pages", [("bfloat16", "dual", 8), ("bfloat16", "prefix", 2),
                                               ("float32", "dual", 1)])
def test_overflow_request_on_cuda_equals_the_all_in_pool_run(dtype, cache, pages):
    """A request larger than the pool (``cache/io/kv_overflow.py``) with the copy stream: host ->
    stage loads under the compute, write-backs to the pool and to host memory; token for token
    the all-in-pool run (same kernels, keys in the same order). One resident page: the active
    block spills too (loads and write-backs in the same step)."""
    prompt = list(range(3, 90)) * 4                        # 348 tokens + 64: 26 pages of 16
    params = SamplingParams(max_tokens=64, block_length=32, cache=cache, decode="vanilla",
                            early_stop=False)
    ref = LLM(device="cuda", dtype=dtype, engine_config=EngineConfig(page_size=16))
    want = ref.generate([prompt], params)[0].token_ids
    llm = LLM(device="cuda", dtype=dtype, engine_config=EngineConfig(
        page_size=16, num_kv_pages=pages, kv_overflow_gb=0.05))
    for _ in range(2):                                     # the host buffer is reused
        assert llm.generate([prompt], params)[0].token_ids == want
    st = llm.engine.runner.overflow.stats
    assert st["h2d_bytes"] > 0 and st["d2h_bytes"] > 0
    assert llm.engine.kv_manager.num_used == 0


def test_reuse_from_host_memory_on_cuda_equals_reuse_from_the_pool():
    """Stores (side stream) and loads on CUDA: a history reused from host memory (bf16,
    exact) gives the same tokens as the same history reused from GPU memory."""
    hist = list(range(3, 90)) * 4                          # 348 tokens: 21 full pages
    other = [[(7 * i + k) % 90 + 3 for i in range(300)] for k in range(3)]
    params = SamplingParams(max_tokens=32, block_length=32, cache="dual", decode="threshold")

    def run(**cfg):
        llm = LLM(device="cuda", dtype="bfloat16",
                  engine_config=EngineConfig(page_size=16, prefix_reuse=True, **cfg))
        first = llm.generate([hist], params)[0].token_ids
        llm.generate(other, params)                        # pushes the history out of a small pool
        second = llm.generate([hist + first + [5, 6, 7]], params)[0].token_ids
        return llm, first, second

    _, f_ref, s_ref = run()
    llm, f, s = run(num_kv_pages=64, kv_cpu_gb=0.05)
    hits = llm.engine.kv_manager.stats["hit_tokens"]
    assert hits[1] >= 16 * 9, hits
    assert (f, s) == (f_ref, s_ref)


@pytest.mark.parametrize("seed", range(12))
def test_batched_top_k_equals_per_request_rule_on_cuda(seed):
    """select_top_k's shared buffer (topk on column views of it) picks the same tied slots as
    one topk per request over its own canvas-length row, on CUDA's topk too."""
    from test_paged_engine import _top_k_one_by_one, random_top_k_case

    from flash_dllm.decoding.policies import select_top_k
    conf, positions, bounds, ks, lens = random_top_k_case(seed, "cuda")
    got = select_top_k(conf, positions, bounds, ks, lens)
    want = _top_k_one_by_one(conf.cpu(), positions.cpu(), bounds, ks, lens)
    # the per-request rule on CUDA (the reference sampler's device), row by row
    ref = torch.zeros_like(conf, dtype=torch.bool)
    for (s, e), k, n in zip(bounds, ks, lens):
        row = torch.full((n,), float("-inf"), device="cuda")
        row[positions[s:e]] = conf[s:e]
        local = torch.zeros(n, dtype=torch.bool, device="cuda")
        local[torch.topk(row, min(k, e - s)).indices] = True
        ref[s:e] = local[positions[s:e]]
    assert torch.equal(got, ref)
    assert int(got.sum()) == int(want.sum())


def test_warmed_server_replays_fused_verify_steps():
    """After the full warm-up (which captures nothing afterwards), a default verify request
    (threshold 0.9, dual, block 32) replays fused verify graphs and captures none."""
    from flash_dllm.worker.warmup import warm_up
    llm = LLM(model="proxy-llada", device="cuda", engine_config=EngineConfig(max_num_seqs=4))
    eng = llm.engine
    rep = warm_up(eng, "full", llm.tokenizer.encode("warm up text, 12 + 30 = 42."))
    assert not rep.skipped, rep.skipped
    sg = eng.runner.fused
    before = dict(sg.stats)
    params = SamplingParams(max_tokens=64, block_length=32, cache="dual", decode="verify",
                            threshold=0.9)
    outs = llm.generate(["Tom has 3 apples and buys 5 more. How many apples does he have?"],
                        params)
    assert outs[0].num_forwards > 4
    assert sg.stats["fused_captures"] == before["fused_captures"], sg.stats
    assert sg.stats["fused_replays"] > before["fused_replays"], sg.stats


@pytest.mark.parametrize("decode", ["vanilla", "threshold"])
def test_block_causal_moe_graphs_equal_eager(decode):
    """The LLaDA2 proxy (q/k-normed heads, partial rotary: the attention's PyTorch rotary path)
    through forward graphs and fused steps, captured at first sight, with the allocator's cache
    emptied between runs, against eager steps: no illegal memory access (issue 39: the rotary
    tables' cache lent a capture its warm-up's freed tensors) and the same answers (padded
    shapes pick other MoE tiles, so a near-tie may flip: 90 % identical at least)."""
    prompts = [p.prompt for p in get_suite("chain").test_problems(48, seed=0)]
    texts = {}
    for graphs in (False, True):
        llm = LLM("proxy-llada2", device="cuda", dtype="float32",
                  engine_config=EngineConfig(cuda_graphs=graphs, max_num_seqs=48))
        if graphs:
            llm.engine.runner.fused.first_capture = 1
        params = SamplingParams(max_tokens=128, cache="block", decode=decode)
        texts[graphs] = [o.text for o in llm.generate(prompts, params)]
        if graphs:
            assert llm.engine.runner.forward_graphs.stats["graph_replays"] > 0
        llm.close()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(texts[False], texts[True]))
    assert same >= 0.9 * len(prompts), same


def test_llada2_partial_rotary_kernel_answers_as_the_pytorch_rotary(monkeypatch):
    """The LLaDA2 proxy in bf16 with its q/k norms and half-head rotary inside the RoPE + page
    write kernel (``rope_cache``'s ``rotary_dim``) against the PyTorch rotary path it replaced
    (``takes_rotary`` refusing partial heads): the same answers but for near-ties (the kernel
    rounds each bf16 product as torch does: no FMA contraction, ``rope_cache.EXACT_ROUNDING``;
    30 / 32 identical on an H100, 20 / 32 with contraction)."""
    from flash_dllm.kernels import rope_cache
    prompts = [p.prompt for p in get_suite("chain").test_problems(32, seed=1)]
    params = SamplingParams(max_tokens=96, cache="block")
    texts = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(rope_cache, "takes_rotary", lambda r, d: r == d)
        llm = LLM("proxy-llada2", device="cuda", dtype="bfloat16")
        texts[fused] = [o.text for o in llm.generate(prompts, params)]
        llm.close()
    same = sum(a == b for a, b in zip(texts[True], texts[False]))
    print(f"\nLLaDA2 proxy, bf16: {same} / {len(prompts)} answers identical")
    assert same >= 0.8 * len(prompts), same
