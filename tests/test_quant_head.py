"""The LM head quantized too (``EngineConfig.quantize_lm_head``, issue 40): the logits are the
final norm's output times the head's dequantized codes (an own head, or a tied model's
embedding matrix, which stays as it was), the blocks are quantized as without it, and the
front ends take the knob (engine, LLM, bench step's ``MODE+head`` rows)."""
from __future__ import annotations

import pytest
import torch

from conftest import EXACT, tiny_model
from flash_dllm.config import QUANT_MODES, EngineConfig
from flash_dllm.kernels import fp8_gemm, fp8_skinny, quant_gemm
from flash_dllm.layers.attention import DenseContext
from flash_dllm.layers.quant import QuantLinear, quantize_model


def _final_norm(model, h):
    """RMSNorm written out (not the model's kernel): x / rms(x) * weight, in float32."""
    w, eps = model.norm.weight.float(), model.cfg.rms_norm_eps
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def _dequantized_codes(w, mode, group):
    """The head's weight as its codes say, from the layouts' own quantize functions."""
    if mode == "fp8":
        return fp8_gemm.dequantize(*fp8_gemm.quantize_weight(w), torch.float32)
    bits = int(mode[3:])
    return quant_gemm.dequantize(*quant_gemm.quantize(w, bits, group), bits, torch.float32)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", QUANT_MODES)
def test_head_logits_are_the_dequantized_codes(mode, tied):
    family = "dream" if tied else "llada"          # (a Dream config ties by its own key)
    base = tiny_model(family, seed=3, tie_word_embeddings=tied)
    assert (base.lm_head is None) == tied
    head_w = (base.embed.weight if tied else base.lm_head.weight).detach().clone()
    embed_w = base.embed.weight.detach().clone()
    body = tiny_model(family, seed=3, tie_word_embeddings=tied)
    info = quantize_model(base, mode, 32, lm_head=True)
    quantize_model(body, mode, 32)
    assert info["lm_head"] and isinstance(base.lm_head, QuantLinear)
    assert info["layers"] == quantize_model(tiny_model(family), mode, 32)["layers"] + 1
    assert torch.equal(base.embed.weight, embed_w)          # a tied embedding stays as it was
    ids = torch.randint(0, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        h = base.hidden(ids, pos, DenseContext())
        torch.testing.assert_close(h, body.hidden(ids, pos, DenseContext()), rtol=0, atol=0)
        got = base.logits(h)
    hn = _final_norm(base, h)
    if mode == "fp8":       # (40 rows, below fp8_gemm.W8A8_MIN_ROWS: x quantized in blocks)
        hn = fp8_skinny.dequantize_blocks(*fp8_skinny.quantize_blocks(hn.view(-1, hn.shape[-1])))
        hn = hn.view(got.shape[:-1] + (-1,))
    want = hn @ _dequantized_codes(head_w, mode, 32).t()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_head_bytes_shrink_and_the_line_says_so(capsys):
    from flash_dllm.entrypoints.loader import report_weights

    a, b = tiny_model("llada", seed=0), tiny_model("llada", seed=0)
    plain, head = quantize_model(a, "int4", 32), quantize_model(b, "int4", 32, lm_head=True)
    v, d = b.cfg.vocab_size, b.cfg.hidden_size
    # the head's float32 matrix (4 bytes a weight) became int4 codes and fp16 group scales
    assert plain["weight_bytes"] - head["weight_bytes"] == v * d * 4 - (v * d // 2 + v * d // 16)
    report_weights(head)
    err = capsys.readouterr().err
    assert "embeddings and MoE routers kept" in err and "LM head" not in err


def test_engine_and_llm_take_the_knob():
    from flash_dllm import LLM, SamplingParams

    prompt = "Ivy has 23 pens. Vic has 12 fewer than Ivy. How many pens do they have in all?"
    params = SamplingParams(max_tokens=32, **EXACT)
    plain = LLM(quantization="int4")
    llm = LLM(quantization="int4", quantize_lm_head=True)
    assert isinstance(llm.engine.model.lm_head, QuantLinear)
    assert llm.engine.runner.weight_info["lm_head"] is True
    assert llm.engine.stats_snapshot().quantization == "int4+head"     # /metrics' label
    assert llm.engine.stats_snapshot().weight_bytes < plain.engine.stats_snapshot().weight_bytes
    out = llm.generate([prompt], params)[0].text
    assert out == plain.generate([prompt], params)[0].text == "23-12=11. 23+11=34. #### 34"
    with pytest.raises(ValueError, match="quantize_lm_head=True needs a quantization mode"):
        LLM(engine_config=EngineConfig(quantize_lm_head=True))    # (the config's field too)


def test_bench_step_times_the_head_mode_beside_the_others():
    from flash_dllm.bench.step import run_bench

    rep = run_bench("demo", [1], ["dual"], "cpu", "float32", prompt=16, gen=8, block=8,
                    steps=2, warmup=1, progress=lambda _: None,
                    quantization=["int4", "int4+head"])
    assert [r["quantization"] for r in rep["rows"]] == ["int4", "int4+head"]
    w = rep["weights_by_quantization"]
    assert w["int4+head"]["weight_bytes"] < w["int4"]["weight_bytes"]
    assert w["int4+head"]["group_size"] == 128
