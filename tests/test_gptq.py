"""GPTQ at load (``layers/gptq.py``, ``entrypoints/calibration.py``): the column loop against an
independent unblocked reference (the explicit inverse Hessian, one column eliminated at a time),
round to nearest where there is nothing to fit, the codes carried into the quantized layers as
they are, and the ``--quantization-calibration`` knob end to end on a tiny LLaDA2 checkpoint."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import tiny_llada2_config, tiny_model, write_tiny_llada2_checkpoint
from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints import calibration
from flash_dllm.kernels import quant_decode
from flash_dllm.layers import gptq, quant
from flash_dllm.layers.moe import MoE

QMAX = {8: 127, 4: 7}


def reference_gptq(w, H, bits, group, damp=gptq.DAMP):
    """GPTQ as the optimal-brain-surgeon update it is: after each column, the columns left move
    by ``-err * Hinv[c, c+1:]``, and ``c`` is eliminated from the inverse (float64)."""
    W = w.double().clone()
    H = H.double().clone()
    H += damp * torch.diag(H).mean() * torch.eye(len(H), dtype=torch.float64)
    Hinv = torch.linalg.inv(H)
    qmax = QMAX[bits]
    codes = torch.empty(W.shape, dtype=torch.int8)
    scales = torch.empty(W.shape[0], W.shape[1] // group, dtype=torch.float16)
    for c in range(W.shape[1]):
        if c % group == 0:
            s16 = (W[:, c:c + group].abs().amax(1) / qmax).clamp_min(1e-7).to(torch.float16)
            scales[:, c // group] = s16
            s = s16.double()
        q = torch.round(W[:, c] / s).clamp(-qmax - (bits == 4), qmax)
        codes[:, c] = q.to(torch.int8)
        err = (W[:, c] - q * s) / Hinv[c, c]
        W[:, c + 1:] -= err[:, None] * Hinv[c, c + 1:][None, :]
        Hinv = Hinv - torch.outer(Hinv[:, c], Hinv[c, :]) / Hinv[c, c]
    return codes, scales


def _inputs(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)   # correlated inputs
    return torch.randn(n, k, generator=g) @ mix


@pytest.mark.parametrize("bits,group", [(4, 8), (4, 32), (8, 16)])
def test_gptq_matches_unblocked_reference(bits, group):
    torch.manual_seed(1)
    w = torch.randn(24, 160)
    X = _inputs(400, 160)
    H = X.t() @ X
    codes, scales = gptq.gptq_quantize(w, H, bits, group, search=False)
    ref_codes, ref_scales = reference_gptq(w, H, bits, group)
    got = quant_decode.unpack(codes, bits)
    assert (got == ref_codes).float().mean() > 0.995           # float32 vs float64 rounding
    torch.testing.assert_close(scales.float(), ref_scales.float(), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("search", [False, True])
def test_gptq_lowers_the_output_error(search):
    torch.manual_seed(2)
    w = torch.randn(64, 128)
    X = _inputs(512, 128, seed=3)
    H = X.t() @ X
    q, s = gptq.gptq_quantize(w, H, 4, 16, search=search)
    rq, rs = quant_decode.quantize(w, 4, 16)

    def err(codes, scales):
        return ((w - quant_decode.dequantize(codes, scales, 4)) @ X.t()).pow(2).sum()

    assert err(q, s) < 0.75 * err(rq, rs)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_without_inputs_is_round_to_nearest(bits):
    """No input reached the layer (an unrouted expert) or H = identity: nothing to fit, and
    without the scale search the codes are round-to-nearest's, bit for bit."""
    torch.manual_seed(3)
    w = torch.randn(16, 64)
    want = quant_decode.quantize(w, bits, 16)
    for H in (torch.zeros(64, 64), torch.eye(64) * 3.0):
        q, s = gptq.gptq_quantize(w, H, bits, 16, search=False)
        assert torch.equal(q, want[0]) and torch.equal(s, want[1])


def test_batched_fit_equals_one_at_a_time():
    """Experts are fitted ``EXPERT_CHUNK`` at a time in one loop: the same codes as alone."""
    torch.manual_seed(5)
    w = torch.randn(3, 16, 64)
    H = torch.stack([(lambda X: X.t() @ X)(_inputs(200, 64, seed=s)) for s in range(3)])
    H[1] = 0                                                # an expert no token reached
    q, s = gptq.gptq_quantize(w, H, 4, 16)
    for e in range(3):
        qe, se = gptq.gptq_quantize(w[e], H[e], 4, 16)
        assert (q[e] == qe).float().mean() > 0.995 and torch.equal(s[e][:, :1], se[:, :1])


def test_scale_search_never_worse_than_amax():
    torch.manual_seed(4)
    g = torch.randn(200, 8)
    for bits in (4, 8):
        out = []
        for search in (False, True):
            s = gptq._group_scale(g, bits, search).float()[:, None]
            qmax = QMAX[bits]
            out.append(((torch.round(g / s).clamp(-qmax - (bits == 4), qmax) * s - g) ** 2).sum(1))
        assert (out[1] <= out[0] + 1e-7).all() and (out[1] < out[0]).any()


def _calibration_ids(n=6, length=40, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


@pytest.mark.parametrize("bits", [4, 8])
def test_calibrated_model_quantizes_to_its_fitted_weights(bits):
    """Every projection and MoE expert is fitted, the parameters hold the fitted weights, and
    ``quantize_model`` stores exactly those codes (the carried codes, not a second rounding)."""
    model = tiny_model(config=tiny_llada2_config())
    plain = copy.deepcopy(model)
    report = gptq.calibrate(model, _calibration_ids(), bits, 16)
    mlps = [m for m in model.modules() if isinstance(m, MoE)]
    assert report["experts_fitted"] > 0
    assert mlps and report["layers"] == sum(
        len(gptq._targets(b)) for b in model.layers) + 2 * len(mlps)
    assert report["relative_error_gptq"] < report["relative_error_rtn"]
    fitted = dict(model.named_parameters())
    q = copy.deepcopy(model)
    quant.quantize_model(q, f"int{bits}", 16)
    changed = 0
    for name, m in q.named_modules():
        if isinstance(m, quant.QuantLinear):
            assert torch.equal(m.dequantized(torch.float32), fitted[f"{name}.weight"])
            rtn = quant_decode.dequantize(*quant_decode.quantize(
                dict(plain.named_parameters())[f"{name}.weight"], bits, 16), bits)
            changed += not torch.equal(rtn, fitted[f"{name}.weight"])
        if isinstance(m, quant.QuantExperts):
            owner = name.rsplit(".", 1)[0]
            for part in ("gate_up", "down"):
                assert torch.equal(m.weights(part, torch.float32), fitted[f"{owner}.w_{part}"])
    assert changed > 0
    # and the fitted model is closer to the float one than round-to-nearest on other inputs
    ids = _calibration_ids(n=4, seed=9)
    rtn = copy.deepcopy(plain)
    quant.quantize_model(rtn, f"int{bits}", 16)
    with torch.no_grad():
        ref = [plain(x[None]) for x in ids]
        d_gptq = sum((q(x[None]) - r).pow(2).sum() for x, r in zip(ids, ref))
        d_rtn = sum((rtn(x[None]) - r).pow(2).sum() for x, r in zip(ids, ref))
    assert d_gptq < d_rtn


def test_experts_with_few_tokens_are_rounded():
    """An expert routed fewer tokens than its inputs is rounded to nearest (on the searched
    scale): one short sample reaches each expert with a handful of tokens at most."""
    model = tiny_model(config=tiny_llada2_config())
    plain = copy.deepcopy(model)
    report = gptq.calibrate(model, _calibration_ids(n=1, length=6), 4, 16)
    moes = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    assert report["experts_fitted"] == 0 and report["experts_rounded"] == 8 * len(moes)
    want = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if name.endswith(("w_gate_up", "w_down")):
            q, s = gptq.gptq_quantize(want[name], torch.zeros(len(p), p.shape[-1], p.shape[-1]),
                                      4, 16)
            assert torch.equal(p, quant_decode.dequantize(q, s, 4))


def test_fitted_settings_must_match_the_quantization():
    model = tiny_model(config=tiny_llada2_config())
    gptq.calibrate(model, _calibration_ids(n=2), 4, 16)
    cfg = EngineConfig(quantization="int8", quantization_group_size=16,
                       quantization_calibration="chain")
    with pytest.raises(quant.QuantError, match="fitted for int4, group 16"):
        quant.quantize_as_configured(model, cfg)


def test_random_init_model_refuses_calibration():
    from flash_dllm.entrypoints.loader import load_random_engine
    with pytest.raises(ValueError, match="a random-init model .* has nothing to fit"):
        load_random_engine("demo", quantization="int4", quantization_calibration="chain")


def test_fused_projections_stack_the_fitted_codes():
    model = tiny_model(config=tiny_llada2_config())
    gptq.calibrate(model, _calibration_ids(), 4, 16)
    want = copy.deepcopy(model)
    quant.quantize_model(want, "int4", 16)
    model.fuse_projections()
    quant.quantize_model(model, "int4", 16)
    a = model.layers[1].attn.qkv_proj.dequantized(torch.float32)
    b = torch.cat([getattr(want.layers[1].attn, f"{p}_proj").dequantized(torch.float32)
                   for p in "qkv"])
    assert torch.equal(a, b)


def test_calibration_sources(tmp_path):
    folder = write_tiny_llada2_checkpoint(tmp_path / "m")
    from flash_dllm.models.tokenizer import Tokenizer
    tok = Tokenizer(folder)
    (tmp_path / "a.txt").write_text("first line\n\nsecond line\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "p?\n", "answer": "yes"}) + "\n"
                                      + json.dumps({"text": "plain"}) + "\n")
    seqs = calibration.samples(f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'}+chain", tok, 3, 7)
    assert len(seqs) == 7 and all(s.dtype == torch.long and len(s) > 1 for s in seqs)
    again = calibration.samples(f"{tmp_path / 'a.txt'},{tmp_path / 'b.jsonl'},chain", tok, 3, 7)
    assert all(torch.equal(a, b) for a, b in zip(seqs, again))              # seeded
    assert any((s == 3).any() for s in seqs)                                 # masked answers
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 has neither a string 'text'"):
        calibration.samples(str(tmp_path / "bad.jsonl"), tok, 3, 2)
    (tmp_path / "broken.jsonl").write_text('{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:1 is not JSON"):
        calibration.samples(str(tmp_path / "broken.jsonl"), tok, 3, 2)
    with pytest.raises(ValueError, match="neither a built-in suite"):
        calibration.samples("no-such-suite", tok, 3, 2)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="holds no sample"):
        calibration.samples(str(tmp_path / "empty.txt"), tok, 3, 2)
    with pytest.raises(ValueError, match="names no source"):
        calibration.samples(" , + ", tok, 3, 2)
    assert len(calibration.samples("chain", tok, 3, 2, max_tokens=5)[0]) == 5


def test_calibration_knob_checks():
    with pytest.raises(ValueError, match="set quantization to 'int8' or 'int4'"):
        EngineConfig(quantization_calibration="chain")
    with pytest.raises(ValueError, match="set quantization to 'int8' or 'int4'"):
        EngineConfig(quantization="fp8", quantization_calibration="chain")
    with pytest.raises(ValueError, match="names no source"):
        EngineConfig(quantization="int4", quantization_calibration=" ,+")
    with pytest.raises(ValueError, match="quantization_calibration_samples"):
        EngineConfig(quantization="int4", quantization_calibration="chain",
                     quantization_calibration_samples=0)
    model = tiny_model(config=tiny_llada2_config())
    with pytest.raises(quant.QuantError, match="the model was not fitted"):
        quant.quantize_as_configured(model, EngineConfig(quantization="int4",
                                                         quantization_calibration="chain"))


def test_llm_with_calibration(tmp_path, capsys):
    """``LLM(..., quantization_calibration=...)``: fitted at load, reported, and it generates;
    a group that does not divide a layer fails before any forward, naming it."""
    from flash_dllm import LLM, SamplingParams
    folder = write_tiny_llada2_checkpoint(tmp_path / "m")
    (tmp_path / "cal.txt").write_text("\n".join(f"sample {i} of the text" for i in range(8)))
    llm = LLM(model=str(folder), quantization="int4", quantization_group_size=16,
              quantization_calibration=str(tmp_path / "cal.txt"),
              quantization_calibration_samples=4)
    err = capsys.readouterr().err
    assert "GPTQ fitted" in err and "layer 3/3" in err
    out = llm.generate(["abc"], SamplingParams(max_tokens=32, block_length=32))
    assert len(out) == 1
    with pytest.raises(quant.QuantError, match="does not divide the input width"):
        LLM(model=str(folder), quantization="int4", quantization_group_size=48,
            quantization_calibration=str(tmp_path / "cal.txt"))


def test_eval_report_records_the_calibration(tmp_path):
    """``flash-dllm eval``'s report says the codes were fitted, on what, and how well."""
    from flash_dllm import LLM
    from flash_dllm.evals.runner import run_eval
    folder = write_tiny_llada2_checkpoint(tmp_path / "m")
    (tmp_path / "cal.txt").write_text("one sample\nanother sample\n")
    llm = LLM(model=str(folder), quantization="int4", quantization_group_size=16,
              quantization_calibration=str(tmp_path / "cal.txt"),
              quantization_calibration_samples=2)
    info = llm.engine.runner.weight_info["calibration"]
    assert info["sources"] == str(tmp_path / "cal.txt") and info["bits"] == 4
    assert info["relative_error_gptq"] < info["relative_error_rtn"]
    from flash_dllm import SamplingParams
    report = run_eval(llm, "arith", 1, SamplingParams(max_tokens=32, block_length=32))
    assert report["quantization"]["calibration"] == info
