"""The shipped demo checkpoint: loads offline, answers held-out problems, drives the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flash_dllm import LLM, SamplingParams
from flash_dllm.models.loader import DEMO_MODEL
from flash_dllm.evals.runner import run_eval


@pytest.fixture(scope="module")
def llm():
    return LLM()          # no path: the shipped checkpoint


def test_demo_checkpoint_is_small_llada_bf16():
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDAModelLM"]
    size = (DEMO_MODEL / "model.safetensors").stat().st_size
    assert size < 25 * 2**20
    from safetensors import safe_open
    with safe_open(str(DEMO_MODEL / "model.safetensors"), framework="pt") as f:
        name = next(iter(f.keys()))
        assert str(f.get_slice(name).get_dtype()).lower() in ("bf16", "bfloat16")


@pytest.mark.slow
def test_demo_scores_on_held_out_arith(llm):
    report = run_eval(llm, "arith", 50, SamplingParams(), progress=False, keep_samples=False)
    assert report["n"] == 50
    assert report["accuracy"] >= 0.80, report


def test_demo_chat_template_works(llm):
    out = llm.chat([{"role": "user", "content":
                     "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"}],
                   SamplingParams(decode="threshold", cache="dual"))[0]
    assert out.text.strip().endswith("#### 34")


def test_cli_generate_default_model_answers():
    proc = subprocess.run(
        [sys.executable, "-m", "flash_dllm.cli", "generate", "--decode", "threshold",
         "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("#### 34")
    assert "forwards" in proc.stderr and "tokens/s" in proc.stderr


def test_cli_bad_flag_value_is_clean_error():
    proc = subprocess.run([sys.executable, "-m", "flash_dllm.cli", "generate", "hi",
                           "--max-tokens", "48", "--block-length", "32"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "multiple of block_length" in proc.stderr and "Traceback" not in proc.stderr
