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
from flash_dllm.config import EngineConfig
from flash_dllm.kernels import fp8_gemm
from flash_dllm.layers.quant import QuantLinear, quantize_model
from flash_dllm.models.loader import load_model
from flash_dllm.models.ckpt_quant import UnreadQuantization, checkpoint_quantization

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")


def _tiny_dream_in_transformers(tmp_path):
    """The tiny Dream checkpoint (its folder, config.json) and transformers' Qwen2 holding it."""
    src = write_tiny_checkpoint(tmp_path / "bf16", "dream")
    raw = json.loads((src / "config.json").read_text())
    cfg = transformers.Qwen2Config(**{k: raw[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings")})
    hf = transformers.Qwen2ForCausalLM(cfg)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        hf.load_state_dict({k: f.get_tensor(k) for k in f.keys()})
    return src, raw, hf


def _computes_as(llm, ref) -> None:
    """The same logits (1e-5) and the same greedy text as ``ref``."""
    ids = [[1, 5, 9, 17, 33, 2, 2, 2]]
    torch.testing.assert_close(llm.logits(ids), ref.logits(ids), rtol=1e-5, atol=1e-5)
    p = SamplingParams(max_tokens=16, decode="vanilla", cache="none")
    assert llm.generate(["ab"], p)[0].text == ref.generate(["ab"], p)[0].text


def _write_fp8_checkpoint(tmp_path, scheme: str = "FP8_DYNAMIC"):
    """The tiny Dream checkpoint, quantized and saved by compressed-tensors (weights' scales
    from their per-channel extremes, as its min-max observer computes them)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    src, raw, hf = _tiny_dream_in_transformers(tmp_path)
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
    _computes_as(llm, ref)
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
      "config_groups": {}}, "without config_groups"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int",
                                                "strategy": "group", "group_size": 32}}}},
     "pack-quantized group 'group_0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                "strategy": "group", "group_size": 32}}}},
     "pack-quantized group 'group_0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "actorder": "group",
                                                "strategy": "group", "group_size": 32}}}},
     "pack-quantized group 'group_0'"),
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


def _write_int4_checkpoint(tmp_path, group: int = 16):
    """The tiny Dream checkpoint quantized to symmetric int4 with group scales and saved by
    compressed-tensors in its ``pack-quantized`` format (llm-compressor's W4A16 layout), and the
    same weights dequantized (codes x float16 scales, by compressed-tensors' own unpacking) as a
    plain float32 checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    src, raw, hf = _tiny_dream_in_transformers(tmp_path)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group))
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=["lm_head"]))
    for mod in hf.modules():
        if hasattr(mod, "weight_scale"):
            w = mod.weight.detach().reshape(mod.weight.shape[0], -1, group)
            s, zp = calculate_qparams(w.amin(-1), w.amax(-1), mod.quantization_scheme.weights)
            mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
            mod.weight_zero_point.data.copy_(zp.reshape(mod.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(hf, quantization_format="pack-quantized")
    comp.compress_model(hf)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    out, plain = tmp_path / "int4", tmp_path / "dequantized"
    for folder in (out, plain):
        folder.mkdir()
        for p in src.iterdir():
            if p.name not in ("model.safetensors", "config.json"):
                (folder / p.name).write_bytes(p.read_bytes())
    save_file(sd, str(out / "model.safetensors"))
    qc = comp.quantization_config.model_dump(exclude_none=True, mode="json")
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    codes, deq = {}, {}
    for k, v in sd.items():
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            shape = tuple(int(n) for n in sd[base + "_shape"])
            q = unpack_from_int32(v, 4, torch.Size(shape))               # int8 in [-8, 7]
            s = sd[base + "_scale"].to(torch.float16)
            codes[base] = (q, s)
            deq[base] = (q.float().unflatten(-1, (-1, group)) * s.float()[..., None]).flatten(-2)
        elif not k.endswith(("_scale", "_shape", "_zero_point")):
            deq[k] = v
    save_file(deq, str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps(raw))
    return out, plain, codes


def test_published_int4_checkpoint_loads_with_its_codes(tmp_path):
    """compressed-tensors ``pack-quantized`` int4 (W4A16): int4 by default with the checkpoint's
    group, each layer's codes and scales exactly as stored (q/k/v and gate/up fused, the codes
    stacked), computing as the same codes x scales in float do; another mode quantizes the
    dequantized weights."""
    from flash_dllm.kernels import quant_gemm
    folder, plain, codes = _write_int4_checkpoint(tmp_path)
    assert checkpoint_quantization(json.loads((folder / "config.json").read_text()),
                                   folder).group_size == 16
    llm = LLM(folder)
    info = llm.engine.runner.weight_info
    assert info["quantization"] == "int4" and info["group_size"] == 16
    # as loaded by the engine (unfused on the CPU), and fused as the GPU runner does
    fused, _ = load_model(folder)
    fused.fuse_projections()
    quantize_model(fused, "int4", 16)
    pre = "model.layers.0."
    for layer in (llm.engine.model.layers[0], fused.layers[0]):
        a, m = layer.attn, layer.mlp
        qkv = (((a.qkv_proj, ("q_proj", "k_proj", "v_proj")),) if a.qkv_proj is not None else
               ((a.q_proj, ("q_proj",)), (a.k_proj, ("k_proj",)), (a.v_proj, ("v_proj",))))
        gu = (((m.gate_up_proj, ("gate_proj", "up_proj")),) if m.gate_up_proj is not None else
              ((m.gate_proj, ("gate_proj",)), (m.up_proj, ("up_proj",))))
        mods = [(mod, [f"self_attn.{n}" for n in names]) for mod, names in qkv]
        mods += [(mod, [f"mlp.{n}" for n in names]) for mod, names in gu]
        mods += [(a.o_proj, ["self_attn.o_proj"]), (m.down_proj, ["mlp.down_proj"])]
        for mod, parts in mods:
            assert isinstance(mod, QuantLinear)
            q = torch.cat([codes[f"{pre}{p}.weight"][0] for p in parts])
            s = torch.cat([codes[f"{pre}{p}.weight"][1] for p in parts])
            assert torch.equal(quant_gemm.unpack(mod.qweight, 4), q)
            assert torch.equal(mod.scales, s)
    assert fused.layers[0].attn.qkv_proj is not None
    ref = LLM(plain)                        # the same values in float32, unquantized
    assert ref.engine.runner.weight_info["quantization"] is None
    _computes_as(llm, ref)
    # --quantize-lm-head without --quantization: the checkpoint's mode quantizes the head too
    head = LLM(folder, engine_config=EngineConfig(quantize_lm_head=True)).engine.runner
    assert (head.weight_info["quantization"], head.weight_info["lm_head"]) == ("int4", True)
    # a group size the user gives wins, 128 (the default's value) included
    regrouped = LLM(folder, quantization_group_size=32).engine.runner.weight_info
    assert (regrouped["quantization"], regrouped["group_size"]) == ("int4", 32)
    with pytest.raises(ValueError, match="quantization_group_size=128 does not divide"):
        LLM(folder, quantization_group_size=128)
    as_int8 = LLM(folder, quantization="int8", quantization_group_size=32)
    assert as_int8.engine.runner.weight_info["quantization"] == "int8"
    torch.testing.assert_close(as_int8.engine.model.layers[0].attn.o_proj
                               .dequantized(torch.float32),
                               ref.engine.model.layers[0].attn.o_proj.weight.float(),
                               rtol=0.02, atol=0.02)


def test_published_int4_moe_checkpoint_keeps_its_expert_codes(tmp_path):
    """A LLaDA-MoE checkpoint packed by compressed-tensors' own ``pack_to_int32`` (every
    projection, experts included; the router, embeddings and LM head kept): the fused MoE's
    packed experts hold each expert's codes and scales as stored, and the model computes as the
    same codes x scales in float do."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from family_checkpoints import qwen_style_tensors, tiny_llada_moe_config, \
        write_family_checkpoint
    from flash_dllm.kernels import quant_gemm
    group, cfg = 16, tiny_llada_moe_config()
    plain_t, packed_t, codes = {}, {}, {}
    for name, w in qwen_style_tensors(cfg, 4).items():
        if w.dim() == 2 and name.endswith("_proj.weight"):
            wg = w.float().unflatten(-1, (-1, group))
            s = (wg.abs().amax(-1) / 7.5).to(torch.float16)            # as compressed-tensors
            q = (wg / s.float()[..., None]).round().clamp(-8, 7).flatten(-2).to(torch.int8)
            base = name[: -len(".weight")]
            packed_t[f"{base}.weight_packed"] = pack_to_int32(q, 4)
            packed_t[f"{base}.weight_scale"] = s
            packed_t[f"{base}.weight_shape"] = torch.tensor(list(w.shape))
            plain_t[name] = (q.float().unflatten(-1, (-1, group)) * s.float()[..., None]
                             ).flatten(-2)
            codes[name] = (q, s)
        else:
            plain_t[name] = packed_t[name] = w
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                        "weights": {"num_bits": 4, "type": "int",
                                                    "symmetric": True, "strategy": "group",
                                                    "group_size": group}}},
          "ignore": ["lm_head"]}
    folder = write_family_checkpoint(tmp_path / "int4", {**cfg, "quantization_config": qc},
                                     tensors=packed_t, shards=2)
    plain = write_family_checkpoint(tmp_path / "plain", cfg, tensors=plain_t, shards=2)
    net, _ = load_model(folder)
    net.fuse_projections()
    quantize_model(net, "int4", group)
    experts = net.layers[0].mlp.quant_experts
    pre = "model.layers.0.mlp.experts"
    for e in (0, 5):
        gu = torch.cat([codes[f"{pre}.{e}.{p}_proj.weight"][0] for p in ("gate", "up")])
        assert torch.equal(quant_gemm.unpack(experts.gate_up_qweight[e], 4), gu)
        assert torch.equal(experts.down_scales[e], codes[f"{pre}.{e}.down_proj.weight"][1])
    llm, ref = LLM(folder, dtype="float32"), LLM(plain, dtype="float32")
    assert llm.engine.runner.weight_info["group_size"] == group
    ids = [[1, 5, 9, 17, 33, 2, 2, 2]]
    torch.testing.assert_close(llm.logits(ids), ref.logits(ids), rtol=1e-5, atol=1e-5)


def test_activation_reordered_int4_is_refused_in_one_line(tmp_path):
    """GPTQ's activation order (``weight_g_idx``) permutes a layer's groups: not read."""
    from safetensors.torch import load_file, save_file
    folder, _, _ = _write_int4_checkpoint(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    sd["model.layers.0.self_attn.q_proj.weight_g_idx"] = torch.zeros(64, dtype=torch.int32)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"weight_g_idx: activation-reordered \(g_idx\) int4 "
                                         r"is not read") as e:
        LLM(folder)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,why", [
    (lambda sd: sd.pop("model.layers.0.mlp.up_proj.weight_shape"),
     r"model.layers.0.mlp.up_proj.weight_packed: no model.layers.0.mlp.up_proj.weight_shape"),
    (lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight_packed":
                           sd["model.layers.0.mlp.up_proj.weight_packed"][:, :4].clone()}),
     r"up_proj.weight_packed: torch.int32 \(96, 4\) is not an int4 pack of \[96, 64\]"),
])
def test_a_malformed_int4_pack_is_a_one_line_error(tmp_path, edit, why):
    from safetensors.torch import load_file, save_file
    folder, _, _ = _write_int4_checkpoint(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=why) as e:
        LLM(folder)
    assert "\n" not in str(e.value)
