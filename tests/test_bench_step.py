"""`flash-dllm bench step` on the CPU with the demo shape: the report has every field, and the
timed steps are the ones the report says they are."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flash_dllm.bench.shapes import SHAPES, shape_config
from flash_dllm.bench.step import run_bench, step_flops


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
        assert cfg.num_params() > 4e9, name          # real sizes (the smallest: SDAR-4B)
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


# ---------------------------------------------------------------- issue 41's shapes, tiny scale
def _tiny(raw: dict) -> dict:
    """``raw`` (a real shape) at tiny widths: every key and switch of the real config kept."""
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 256, "mask_token_id": 250, "eos_token_id": 251,
             "max_position_embeddings": 512}
    for key, value in (("num_key_value_heads", 2), ("head_dim", 16), ("intermediate_size", 96),
                       ("dense_intermediate_size", 96), ("moe_intermediate_size", 32),
                       ("expert_intermediate_size", 32), ("num_experts", 8),
                       ("num_experts_per_tok", 2), ("moe_layer_freq", [1, 1])):
        if key in raw:
            small[key] = value
    return {**raw, **small}


@pytest.mark.parametrize("shape,cache,block,batches", [
    ("sdar-4b", "block", 4, [1, 128]),          # JetEngine's figure: batch 128 at block 4
    ("sdar-30b-a3b", "block", 4, [1, 128]),
    ("llada-moe-7b", "dual", 8, [1, 4]),
])
def test_issue_41_shapes_run_on_the_cpu_at_tiny_scale(monkeypatch, shape, cache, block, batches):
    from flash_dllm.models.registry import resolve

    raw = SHAPES[shape]
    real = resolve(raw).parse_config(raw)
    assert real.arch == {"sdar-4b": "sdar", "sdar-30b-a3b": "sdar_moe",
                         "llada-moe-7b": "llada_moe"}[shape]
    monkeypatch.setitem(SHAPES, shape, _tiny(raw))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rep = run_bench(shape, batches, [cache], "cpu", "float32", prompt=8, gen=8, block=block,
                        steps=2, warmup=1, progress=lambda _: None)
    finally:
        torch.set_num_threads(n)
    assert [r["batch"] for r in rep["rows"]] == batches
    assert all(r["ms"] > 0 and r["cache"] == cache for r in rep["rows"])
    if real.mlp_kind == "moe":
        assert all(r["experts_touched"] is not None for r in rep["rows"])


def test_issue_41_published_sizes():
    """SDAR-4B 4.0 B (Qwen3-4B), SDAR-30B-A3B 30.5 B / 3.3 B active (Qwen3-30B-A3B), LLaDA-MoE
    7.4 B; its 1.4 B active (the model card's) leaves out the input embedding, which our count
    (embedding and head whole, as for LLaDA2) includes."""
    from flash_dllm.models.registry import resolve

    cfgs = {n: resolve(SHAPES[n]).parse_config(SHAPES[n])
            for n in ("sdar-4b", "sdar-30b-a3b", "llada-moe-7b")}
    assert 4.0e9 < cfgs["sdar-4b"].num_params() < 4.05e9
    assert 30.4e9 < cfgs["sdar-30b-a3b"].num_params() < 30.6e9
    assert 3.3e9 < cfgs["sdar-30b-a3b"].active_params() < 3.4e9
    lm = cfgs["llada-moe-7b"]
    assert 7.3e9 < lm.num_params() < 7.4e9
    assert 1.38e9 < lm.active_params() - lm.vocab_size * lm.hidden_size < 1.42e9
