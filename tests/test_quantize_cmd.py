"""``flash-dllm quantize`` (``entrypoints/quantize.py``): an int4 copy of a checkpoint in
compressed-tensors' pack-quantized layout that loads back on exactly the codes it was written
with (round to nearest, and GPTQ on a MoE checkpoint), read by compressed-tensors' own unpacking
too, and its refusals in one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import write_tiny_checkpoint, write_tiny_llada2_checkpoint
from flash_dllm import LLM
from flash_dllm.entrypoints.cli import main
from flash_dllm.kernels import quant_decode
from flash_dllm.layers import quant

IDS = [[1, 5, 9, 22, 40, 7, 3, 11]]


def _quantize(*argv) -> int:
    return main(["quantize", *map(str, argv)])


@pytest.mark.parametrize("family,overrides", [("llada", {}), ("llada", {"weight_tying": True}),
                                              ("llada", {"dtype": torch.bfloat16}),
                                              ("dream", {})])
def test_round_to_nearest_copy_loads_on_its_codes(tmp_path, capsys, family, overrides):
    src = write_tiny_checkpoint(tmp_path / "src", family, **overrides)
    out = tmp_path / "int4"
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 16,
                     "--out", out) == 0
    assert "rounded to nearest" in capsys.readouterr().err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"][
        "group_size"] == 16
    assert (out / "tokenizer.json").exists()
    loaded = LLM(model=str(out))                                 # int4 by default for it
    assert loaded.engine.runner.weight_info["quantization"] == "int4"
    at_load = LLM(model=str(src), quantization="int4", quantization_group_size=16)
    assert torch.equal(loaded.logits(IDS), at_load.logits(IDS))


def test_the_written_packs_read_by_compressed_tensors(tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig

    src = write_tiny_checkpoint(tmp_path / "src", "llada")
    out = tmp_path / "int4"
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 16,
                     "--out", out) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    QuantizationConfig.model_validate(qc)                       # its own schema
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        name = next(n for n in f.keys() if n.endswith("q_proj.weight"))
        w = f.get_tensor(name)
    shard = next(out.glob("*.safetensors"))
    assert (out / "model.safetensors.index.json").exists()
    with safe_open(str(shard), "pt") as f:
        base = name[: -len(".weight")]
        words, scale = f.get_tensor(base + ".weight_packed"), f.get_tensor(base + ".weight_scale")
        shape = torch.Size(f.get_tensor(base + ".weight_shape").tolist())
    q = unpack_from_int32(words, 4, shape)                      # compressed-tensors' reading
    want_q, want_s = quant_decode.quantize(w, 4, 16)
    assert torch.equal(q.to(torch.int8), quant_decode.unpack(want_q, 4))
    assert torch.equal(scale, want_s) and ct is not None


def test_gptq_copy_of_a_moe_checkpoint(tmp_path):
    """GPTQ on a text file's samples, experts included: the copy's layers hold exactly what a
    fit of the same checkpoint on the same samples holds in memory."""
    src = write_tiny_llada2_checkpoint(tmp_path / "src")
    cal = tmp_path / "cal.txt"
    cal.write_text("\n".join(f"calibration sample {i}, some text" for i in range(8)))
    out = tmp_path / "int4"
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 16,
                     "--quantization-calibration", cal, "--quantization-calibration-samples", 4,
                     "--out", out) == 0
    copy = LLM(model=str(out))
    fitted = LLM(model=str(src), quantization="int4", quantization_group_size=16,
                 quantization_calibration=str(cal), quantization_calibration_samples=4)
    a = dict(copy.engine.model.named_modules())
    n = 0
    for name, m in fitted.engine.model.named_modules():
        if isinstance(m, quant.QuantLinear):
            assert torch.equal(a[name].dequantized(torch.float32), m.dequantized(torch.float32))
            n += 1
        if isinstance(m, quant.QuantExperts):
            for part in ("gate_up", "down"):
                assert torch.equal(a[name].weights(part, torch.float32),
                                   m.weights(part, torch.float32))
            n += 1
    assert n > 0
    assert torch.equal(copy.logits(IDS), fitted.logits(IDS))


def test_refusals_are_one_line(tmp_path, capsys):
    src = write_tiny_checkpoint(tmp_path / "src", "llada")
    assert _quantize("--model", src, "--quantization", "int8", "--out", tmp_path / "o") == 2
    assert "pass --quantization int4" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert _quantize("--model", src, "--quantization", "int4", "--out", tmp_path / "full") == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 48,
                     "--out", tmp_path / "o") == 2
    assert "does not divide the input width" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 1,
                     "--out", tmp_path / "o") == 2
    assert "group is even and at least 2" in capsys.readouterr().err
    assert _quantize("--model", src, "--quantization", "int4", "--tensor-parallel-size", 2,
                     "--out", tmp_path / "o") == 2
    assert "runs on one device" in capsys.readouterr().err
    odd = write_tiny_checkpoint(tmp_path / "odd", "llada", mlp_hidden_size=100)
    assert _quantize("--model", odd, "--quantization", "int4", "--quantization-group-size", 4,
                     "--out", tmp_path / "o") == 2
    assert "has input width 100, not a multiple of 8" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert _quantize("--model", src, "--quantization", "int4", "--quantization-group-size", 16,
                     "--out", tmp_path / "q") == 0
    capsys.readouterr()
    assert _quantize("--model", tmp_path / "q", "--quantization", "int4",
                     "--out", tmp_path / "again") == 2
    assert "published quantized already" in capsys.readouterr().err
