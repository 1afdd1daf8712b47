"""`flash-dllm bench step` on the CPU with the demo shape: the report has every field, and the
timed steps are the ones the report says they are."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
