"""`flash-dllm bench step` on the CPU with the demo shape: the report has every field, and the
timed steps are the ones the report says they are."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flash_dllm.bench.step import SHAPES, run_bench, shape_config, step_flops


def test_report_fields_and_refresh_split():
    rep = run_bench("demo", [1, 2], ["none", "dual"], "cpu", "float32", prompt=24, gen=16,
                    block=8, steps=8, warmup=1, progress=lambda _: None)
    assert rep["floor_ms"] > 0 and rep["copy_bandwidth_GBps"] > 0 and rep["matmul_TFLOPs"] > 0
    assert [(r["batch"], r["cache"]) for r in rep["rows"]] == [(1, "none"), (2, "none"),
                                                             (1, "dual"), (2, "dual")]
    for r in rep["rows"]:
        for key in ("batch", "cache", "ms", "ratio_to_floor", "mfu", "peak_gib"):
            assert key in r
        assert r["ms"] > 0 and 0 < r["mfu"] < 2
        if r["cache"] == "none":
            assert r["ms_refresh"] is None and r["timed_steps"] == 8
        else:   # blocks of 8: step 8 (the last timed) refreshes block 1 and is reported apart
            assert r["ms_refresh"] is not None and r["timed_steps"] == 7


def test_flops_count_dual_step_is_block_only():
    from flash_dllm.config import SamplingParams
    from flash_dllm.engine.engine import Engine
    from flash_dllm.models.loader import build_model

    model = build_model(shape_config("demo"), seed=0)
    cfg = model.cfg
    eng = Engine(model, cfg)
    r = eng.add_request([5] * 24, SamplingParams(max_tokens=16, block_length=8, cache="dual"))
    full = step_flops(cfg, [r])
    eng.step()
    cached = step_flops(cfg, [r])
    assert 0 < cached < full / 3           # 8 of 40 positions recomputed


def test_known_shapes_parse():
    from flash_dllm.models.registry import resolve
    for name, raw in SHAPES.items():
        cfg = resolve(raw).parse_config(raw)
        assert cfg.num_params() > 6e9, name
    with pytest.raises(ValueError, match="model-shape"):
        shape_config("gpt-5")


def test_cli_writes_json(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run([sys.executable, "-m", "flash_dllm.cli", "bench", "step", "--model-shape",
                           "demo", "--device", "cpu", "--dtype", "float32", "--batch", "1",
                           "--cache", "dual", "--prompt-len", "16", "--gen-len", "8",
                           "--block-length", "8", "--steps", "3", "--warmup", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(out.read_text())
    assert rep["rows"][0]["cache"] == "dual" and "floor" in proc.stdout


def test_moe_floor_counts_the_experts_the_step_reaches(tmp_path):
    """On a MoE model the floor reads the routed experts the step's rows reach, counted from the
    router's own choices: independently recounted here by routing the active blocks' rows."""
    from conftest import write_tiny_llada2_checkpoint

    from flash_dllm import LLM
    from flash_dllm.bench.moe_floor import touched_experts, weight_read_bytes
    from flash_dllm.bench.step import bench_case
    from flash_dllm.config import EngineConfig
    from flash_dllm.layers.moe import MoE

    # 128 experts, 2 per token: 32 rows of a block reach some of them, not all
    llm = LLM(str(write_tiny_llada2_checkpoint(tmp_path / "m", num_experts=128)),
              dtype="float32",
              engine_config=EngineConfig(fused_step=False))
    model, cfg = llm._model, llm.cfg
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    r = bench_case(model, cfg, 2, "block", 8, 32, 32, 3, 1, torch.device("cpu"),
                   cuda_graphs=False)
    touched = r["experts_touched"]
    assert len(touched) == len(moes) and all(k <= t <= E for t in touched)
    assert not any("route" in vars(m) for m in moes)        # the recorder is gone
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_read_bytes(model, cfg, 16, [E] * len(moes)) == full
    per_expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size * 4
    assert weight_read_bytes(model, cfg, 16, touched) == full - sum(
        E - t for t in touched) * per_expert

    class Req:                  # one active block: rows [32, 64) of a 96-slot canvas
        block_start, block_end = 32, 64
        canvas = torch.randint(0, 50, (96,))

    hidden = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, i=i: hidden.__setitem__(i, a[0]))
             for i, m in enumerate(moes)]
    counts = touched_experts(model, [Req], "block")
    for h in hooks:
        h.remove()
    for i, m in enumerate(moes):        # MoE.route on the layer's input rows of the block
        ids, _ = MoE.route(m, hidden[i].reshape(-1, cfg.hidden_size)[32:64])
        assert counts[i] == len(set(ids.reshape(-1).tolist())) < E


def test_uniform_routing_spreads_rows_and_counts_the_table(tmp_path):
    """``--routing uniform``: each row's experts are distinct and drawn from the whole range, the
    step runs with them, the floor counts the table's experts for the step's rows, and the
    recorder leaves the table in place."""
    from conftest import write_tiny_llada2_checkpoint

    from flash_dllm import LLM
    from flash_dllm.bench.moe_floor import (UNIFORM_TABLE_ROWS, install_uniform_routing,
                                            uniform_touched)
    from flash_dllm.bench.step import bench_case
    from flash_dllm.config import EngineConfig
    from flash_dllm.layers.moe import MoE

    llm = LLM(str(write_tiny_llada2_checkpoint(tmp_path / "m", num_experts=128)),
              dtype="float32", engine_config=EngineConfig(fused_step=False))
    model, cfg = llm._model, llm.cfg
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    assert install_uniform_routing(model) == len(moes)
    x = torch.randn(UNIFORM_TABLE_ROWS + 5, cfg.hidden_size)
    for m in moes:
        ids, w = m.route(x)
        assert ids.shape == (x.shape[0], k) and w.shape == (x.shape[0], k)
        assert all(len(set(row)) == k for row in ids[:64].tolist())       # distinct per row
        assert torch.equal(ids[UNIFORM_TABLE_ROWS:], ids[:5])              # the table wraps
        assert len(set(ids.reshape(-1).tolist())) == E                     # every expert used
        assert torch.allclose(w.sum(-1), torch.full((x.shape[0],), cfg.moe.routed_scaling_factor))
    # 2 requests x 32 rows: the floor's count is the table's distinct experts over 64 rows
    want = uniform_touched(model, 64)
    assert want == [len(set(m.route.table[:64].reshape(-1).tolist())) for m in moes]
    r = bench_case(model, cfg, 2, "block", 8, 32, 32, 3, 1, torch.device("cpu"),
                   cuda_graphs=False)
    assert r["ms"] > 0 and all(k <= t <= E for t in r["experts_touched"])
    assert all("route" in vars(m) for m in moes)         # the table stays installed
