"""Checkpoints published already quantized (issue 40): a Dream-layout (Qwen2) checkpoint written
in compressed-tensors' FP8 layout by the compressed-tensors package itself (as llm-compressor's
FP8_DYNAMIC scheme writes it) loads, keeps its e4m3 codes under ``--quantization fp8`` (the
default for it), computes as the fp8 model it is, and generates; layouts that are not read are
refused in one line naming them."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import write_tiny_checkpoint
from flash_dllm import LLM, SamplingParams
from flash_dllm.kernels import fp8_gemm
from flash_dllm.layers.quant import QuantLinear
from flash_dllm.models.ckpt_quant import UnreadQuantization, checkpoint_quantization

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")


def _write_fp8_checkpoint(tmp_path, scheme: str = "FP8_DYNAMIC"):
    """The tiny Dream checkpoint, quantized and saved by compressed-tensors (weights' scales
    from their per-channel extremes, as its min-max observer computes them)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    src = write_tiny_checkpoint(tmp_path / "bf16", "dream")
    raw = json.loads((src / "config.json").read_text())
    cfg = transformers.Qwen2Config(**{k: raw[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings")})
    hf = transformers.Qwen2ForCausalLM(cfg)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        hf.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]))
    for mod in hf.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.detach()
            s, zp = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                      mod.quantization_scheme.weights)
            mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
            mod.weight_zero_point.data.copy_(zp.reshape(mod.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(hf, quantization_format="float-quantized")
    comp.compress_model(hf)
    out = tmp_path / "fp8"
    out.mkdir()
    for p in src.iterdir():
        if p.name not in ("model.safetensors", "config.json"):
            (out / p.name).write_bytes(p.read_bytes())
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"))
    qc = comp.quantization_config.model_dump(exclude_none=True, mode="json")
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    return src, out, sd


def test_published_fp8_checkpoint_loads_with_its_codes(tmp_path):
    src, folder, sd = _write_fp8_checkpoint(tmp_path)
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    llm = LLM(folder)                        # fp8 by default: the checkpoint's own mode
    assert llm.engine.runner.weight_info["quantization"] == "fp8"
    q = llm.engine.model.layers[0].attn.q_proj
    assert isinstance(q, QuantLinear)
    # the same e4m3 codes as the checkpoint stored; the scales within float32 rounding
    assert torch.equal(q.qweight.view(torch.uint8),
                       sd["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))
    torch.testing.assert_close(q.wscale, sd["model.layers.0.self_attn.q_proj.weight_scale"]
                               .squeeze(1), rtol=1e-6, atol=0)
    # it computes as fp8 quantization of the original weights does (same codes, same scales)
    ref = LLM(src, quantization="fp8")
    ids = [[1, 5, 9, 17, 33, 2, 2, 2]]
    torch.testing.assert_close(llm.logits(ids), ref.logits(ids), rtol=1e-5, atol=1e-5)
    p = SamplingParams(max_tokens=16, decode="vanilla", cache="none")
    assert llm.generate(["ab"], p)[0].text == ref.generate(["ab"], p)[0].text
    # another mode asked for: the dequantized weights (codes x scales) are quantized to it
    as_int8 = LLM(folder, quantization="int8", quantization_group_size=32)
    assert as_int8.engine.runner.weight_info["quantization"] == "int8"
    deq = fp8_gemm.dequantize(sd["model.layers.0.self_attn.q_proj.weight"],
                              sd["model.layers.0.self_attn.q_proj.weight_scale"].squeeze(1),
                              torch.float32)
    torch.testing.assert_close(as_int8.engine.model.layers[0].attn.q_proj
                               .dequantized(torch.float32), deq, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("qc,why", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {}}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                "strategy": "block"}}}}, "weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "float",
                                                          "strategy": "tensor",
                                                          "dynamic": False}}}},
     "input activations"),
])
def test_layouts_not_read_are_one_line_errors(qc, why):
    with pytest.raises(UnreadQuantization) as e:
        checkpoint_quantization({"quantization_config": qc}, "ckpt")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("ckpt: ") and why in msg
    assert "compressed-tensors 'float-quantized' FP8" in msg and "--quantization" in msg
    assert checkpoint_quantization({}, "ckpt") is None


def test_an_unread_layout_refuses_at_load(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "gptq", "dream")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quant_method 'gptq', which flash-dllm does not read"):
        LLM(folder)
