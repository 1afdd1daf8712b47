"""The fused MoE kernels (issue 39) against their PyTorch reference, under the interpreter; the
alignment's properties (Triton and torch, equal); the per-expert loop; ``op`` on the CPU; the
benchmark's CPU smoke run."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flash_dllm.kernels import fused_moe as fm
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and fm.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")
# several column tiles and K steps even at these tiny widths
SMALL = {"BLOCK_M": 16, "GU_N": 16, "GU_K": 16, "DN_N": 16, "DN_K": 16}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _problem(T, E, k, d, I, dtype, seed, ids=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(dtype)
    w_gate_up = (torch.randn(E, 2 * I, d, generator=g) / d ** 0.5).to(dtype)
    w_down = (torch.randn(E, d, I, generator=g) / I ** 0.5).to(dtype)
    if ids is None:                         # uniform top-k: k distinct experts per token
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    weights = torch.rand(ids.shape, generator=g) + 0.1
    return x, w_gate_up, w_down, ids, weights


def _assert_close(got, ref, dtype):
    """Elementwise, relative to each value, with an absolute floor at the tolerance times the
    output's scale (a bf16 output is one rounding of an fp32 sum: 1 ulp is 0.8 %)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def test_reference_is_the_sum_over_pairs():
    """The reference against the contract written out pair by pair (weights gathered per pair)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, wgu, wd, ids, w = _problem(6, 5, 3, 24, 8, dtype, seed=1)
        gu = torch.einsum("td,tjnd->tjn", x.float(), wgu[ids].float())     # [T, k, 2I]
        h = (F.silu(gu[..., :8]) * gu[..., 8:]).to(dtype).float()          # [T, k, I]
        y = torch.einsum("tji,tjdi->tjd", h, wd[ids].float())              # [T, k, d]
        want = (y * w[..., None]).sum(1).to(dtype)
        torch.testing.assert_close(fm.fused_moe_reference(x, wgu, wd, ids, w), want,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_expert_loop_matches_reference(dtype):
    x, wgu, wd, ids, w = _problem(11, 8, 3, 32, 16, dtype, seed=2)
    got = fm.per_expert_loop(x, wgu, wd, ids, w)
    # the loop rounds gate/up and silu to bf16 too (F.linear in x's dtype): twice the tolerance
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ref = fm.fused_moe_reference(x, wgu, wd, ids, w)
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol,
                               atol=tol * ref.float().abs().max().item())


def test_op_on_cpu_is_the_reference():
    args = _problem(5, 4, 2, 16, 8, torch.float32, seed=3)
    assert torch.equal(fm.op(*args), fm.fused_moe_reference(*args))


def _align(impl, ids, E, bm):
    if impl == "triton":
        return fm.moe_align_triton(ids.contiguous().view(-1), E, bm)
    return fm.moe_align_reference(ids, E, bm)


ALIGN_CASES = [(1, 1, 1, 16), (1, 4, 8, 16), (7, 3, 5, 16), (33, 4, 16, 16), (20, 8, 8, 32),
               (50, 2, 3, 64)]


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("T,k,E,bm", ALIGN_CASES)
def test_alignment_properties(impl, T, k, E, bm):
    g = torch.Generator().manual_seed(T * 31 + E)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(torch.int32)
    ids[0, 0] = -1                                          # unplaced: never in a group
    P = T * k
    sorted_ids, block_expert, total = _align(impl, ids, E, bm)
    cap, tot = sorted_ids.shape[0], int(total.item())
    counts = torch.bincount(ids[ids >= 0].long(), minlength=E)
    assert cap == fm.capacity(P, E, bm) and block_expert.shape == (cap // bm,)
    assert tot == int(((counts + bm - 1) // bm * bm).sum()) and tot % bm == 0 and tot <= cap
    s = sorted_ids[:tot].long()
    real = s[s < P]
    assert sorted(real.tolist()) == [p for p in range(P) if ids.view(-1)[p] >= 0]  # each once
    assert (s[s >= P] == P).all()                            # padding is marked P
    experts = block_expert[:tot // bm].long()
    assert (experts[1:] > experts[:-1]).all()               # one run of blocks per expert
    for b, e in enumerate(experts.tolist()):
        block = s[b * bm:(b + 1) * bm]
        pairs = block[block < P]
        assert (ids.view(-1)[pairs] == e).all() and (pairs.diff() > 0).all()
        assert counts[e] > 0


@needs_interpreter
@pytest.mark.parametrize("T,k,E,bm", ALIGN_CASES)
def test_alignment_triton_equals_reference(T, k, E, bm):
    ids = torch.randint(-1, E + 1, (T, k), generator=torch.Generator().manual_seed(T + k))
    a = fm.moe_align_reference(ids, E, bm)
    b = fm.moe_align_triton(ids.contiguous().view(-1), E, bm)
    tot = int(a[2].item())
    assert int(b[2].item()) == tot
    assert torch.equal(a[0][:tot], b[0][:tot]) and torch.equal(a[1][:tot // bm], b[1][:tot // bm])


SHAPES = [  # T, E, k, d, I, config
    (1, 4, 2, 32, 16, SMALL),                  # one token
    (7, 8, 3, 48, 40, SMALL),                  # nothing a multiple of a tile (d % BK, I % BN)
    (13, 5, 5, 32, 16, SMALL),                 # k == E: every token on every expert
    (33, 16, 4, 64, 32, None),                 # the default (batch-1) tiles: BK > d
]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,E,k,d,I,config", SHAPES)
def test_triton_matches_reference(T, E, k, d, I, config, dtype):
    args = _problem(T, E, k, d, I, dtype, seed=T + E + k)
    got = fm.fused_moe_triton(*args, config=config)
    _assert_close(got, fm.fused_moe_reference(*args), dtype)


@needs_interpreter
@pytest.mark.parametrize("bm", [32, 64])
def test_triton_many_rows_per_expert(bm):
    """Groups of several blocks (40 rows on each of 2 experts), the large-batch tiles."""
    args = _problem(40, 2, 2, 32, 16, torch.bfloat16, seed=bm)
    cfg = {**SMALL, "BLOCK_M": bm}
    _assert_close(fm.fused_moe_triton(*args, config=cfg), fm.fused_moe_reference(*args),
                  torch.bfloat16)


@needs_interpreter
def test_experts_without_tokens_and_repeated_experts():
    ids = torch.tensor([[0, 5], [5, 5], [0, 0]])           # experts 1-4, 6, 7 idle; repeats
    args = _problem(3, 8, 2, 32, 16, torch.float32, seed=4, ids=ids)
    ref = fm.fused_moe_reference(*args)
    _assert_close(fm.fused_moe_triton(*args, config=SMALL), ref, torch.float32)
    _assert_close(fm.per_expert_loop(*args), ref, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_atomic_combine_matches(dtype):
    args = _problem(9, 6, 3, 40, 24, dtype, seed=5)
    got = fm.fused_moe_triton(*args, config=SMALL, combine="atomic")
    _assert_close(got, fm.fused_moe_reference(*args), dtype)


@needs_interpreter
def test_ids_outside_the_experts_contribute_nothing():
    """-1 (expert parallelism's "not on this rank") and E are skipped, as a zero weight would."""
    x, wgu, wd, ids, w = _problem(6, 5, 3, 32, 16, torch.float32, seed=6)
    bad = ids.clone()
    bad[0, 1], bad[3, 0], bad[5, 2] = -1, 5, -1
    kept = w.clone()
    kept[bad != ids] = 0.0
    want = fm.fused_moe_reference(x, wgu, wd, ids, kept)
    for got in (fm.fused_moe_reference(x, wgu, wd, bad, w), fm.per_expert_loop(x, wgu, wd, bad, w),
                fm.fused_moe_triton(x, wgu, wd, bad, w, config=SMALL),
                fm.fused_moe_triton(x, wgu, wd, bad, w, config=SMALL, combine="atomic")):
        _assert_close(got, want, torch.float32)


@needs_interpreter
def test_shared_expert_as_one_more_expert():
    """Routed experts + a shared SwiGLU expert (weight 1) in one call = the two summed."""
    x, wgu, wd, ids, w = _problem(5, 4, 2, 32, 16, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    s_gu, s_d = torch.randn(32, 32, generator=g) / 32 ** 0.5, torch.randn(32, 16, generator=g) / 4
    ids2, w2 = fm.with_shared_expert(ids, w, shared_id=4)
    assert ids2.shape == (5, 3) and (ids2[:, 2] == 4).all() and (w2[:, 2] == 1).all()
    wgu2, wd2 = torch.cat([wgu, s_gu[None]]), torch.cat([wd, s_d[None]])
    gate, up = (x @ s_gu.T).chunk(2, dim=-1)
    want = fm.fused_moe_reference(x, wgu, wd, ids, w) + (F.silu(gate) * up) @ s_d.T
    _assert_close(fm.fused_moe_triton(x, wgu2, wd2, ids2, w2, config=SMALL), want, torch.float32)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_refuses_bad_layouts_and_options():
    x, wgu, wd, ids, w = _problem(3, 4, 2, 16, 8, torch.float32, seed=9)
    bad = [((x[None], wgu, wd, ids, w), {}, r"x must be \[T, d\]"),
           ((x, wgu, wd[:, :, :4], ids, w), {}, r"w_down must be \[4, 16, 8\]"),
           ((x, wgu.half(), wd, ids, w), {}, "weight dtypes"),
           ((x, wgu, wd, ids.float(), w), {}, "topk_ids must be one of"),
           ((x, wgu, wd, ids, w.half()), {}, "topk_weights must be one of"),
           ((x, wgu, wd, ids[:2], w[:2]), {}, r"topk_ids must be \[3, k\]"),
           ((x, wgu.transpose(1, 2).contiguous().transpose(1, 2), wd, ids, w), {},
            "must be contiguous"),
           ((x, wgu, wd, ids, w), {"config": {"BLOCK_Q": 16}}, "unknown config keys"),
           ((x, wgu, wd, ids, w), {"config": {"BLOCK_M": 8}}, "power of 2 >= 16"),
           ((x, wgu, wd, ids, w), {"combine": "scatter"}, "combine must be")]
    for args, kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fm.fused_moe_triton(*args, **kwargs)


@needs_interpreter
def test_empty_batch():
    args = _problem(0, 4, 2, 16, 8, torch.bfloat16, seed=10)
    assert fm.fused_moe_triton(*args).shape == (0, 16)
    assert fm.fused_moe_reference(*args).shape == (0, 16)
    sorted_ids, block_expert, total = fm.moe_align_triton(torch.zeros(0, dtype=torch.int32), 4, 16)
    assert sorted_ids.shape == (0,) and block_expert.shape == (0,) and total.item() == 0


def test_default_config_follows_rows_per_expert():
    # LLaDA2-mini (E 256, k 8): batch 1 and 8 x block 32 stream weights; batch 64 uses MMA tiles
    assert fm.default_config(32, 8, 256)["BLOCK_M"] == 16
    assert fm.default_config(256, 8, 256)["BLOCK_M"] == 16
    assert fm.default_config(1024, 8, 256)["BLOCK_M"] == 32
    assert fm.default_config(2048, 8, 256)["BLOCK_M"] == 64
    assert fm.capacity(256, 256, 16) == 4096 and fm.capacity(3, 256, 16) == 48


def test_bench_smoke_on_cpu(tmp_path):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe" / "bench_fused_moe.py"
    spec = importlib.util.spec_from_file_location("bench_fused_moe", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_fused_moe", bench)
    spec.loader.exec_module(bench)
    out = tmp_path / "moe.json"
    argv = ["--device", "cpu", "--tiny", "--tokens", "5", "--iters", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["copy_gbs"] > 0
    assert [(c["T"], c["routing"]) for c in report["cases"]] == [(5, "uniform"), (5, "skewed")]
    for case in report["cases"]:
        assert case["ok"] and case["loop_ms"] > 0 and case["floor_ms"] > 0, case
        assert 1 <= case["experts_touched"] <= report["shape"]["E"]
        if fm.INTERPRET:
            assert case["err"]["triton"] < 2e-2
