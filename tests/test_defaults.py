"""Fast by default (issue 42): the recommended sampling defaults (threshold 0.99 with the model
family's fast cache), the layers above them (the request, the command's flags, the checkpoint's
generation_config.json), the family's default cache, and where a server shows the result."""
from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from conftest import EXACT, write_tiny_checkpoint

from flash_dllm.config import SamplingParams
from flash_dllm.defaults import SamplingDefaults, fit_block_length, read_generation_config
from flash_dllm.engine.core import resolve_params, runs_on
from flash_dllm.entrypoints.args import sampling_flags, sampling_from_args
from flash_dllm.entrypoints.cli import build_parser
from flash_dllm.models import registry
from flash_dllm.models.family import Family
from flash_dllm.models.llada import FAMILY as LLADA


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("defaults") / "tiny")


def _gen_config(folder, **keys):
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [0, 3], **keys}),
                    encoding="utf-8")
    return folder


# ----------------------------------------------------------------------------- the recommended
def test_recommended_defaults_and_the_exact_reference():
    p = SamplingParams()
    assert (p.decode, p.threshold, p.cache) == ("threshold", 0.99, None)
    exact = SamplingParams(**EXACT)
    assert (exact.decode, exact.cache, exact.steps) == ("vanilla", "none", exact.max_tokens)


def test_family_declares_its_default_cache():
    assert {f.name: f.default_cache for f in registry.FAMILIES} == {
        "llada": "dual", "dream": "dual", "llada2": "block", "llada_moe": "dual",
        "sdar": "block", "sdar_moe": "block"}
    for fam in registry.FAMILIES:      # the default request runs on every family's models
        cfg = fam.parse_config(fam.to_hf_config(_any_config(fam)))
        assert registry.default_cache(cfg) == fam.default_cache
        assert runs_on(cfg, fam.default_cache, SamplingParams().decode)
        assert resolve_params(SamplingParams(), cfg).cache == fam.default_cache
    with pytest.raises(ValueError, match="default_cache must name a cache mode"):
        Family(**{**LLADA.__dict__, "name": "bad", "default_cache": ""})


def _any_config(fam):
    from conftest import tiny_config, tiny_llada2_config
    from family_checkpoints import tiny_llada_moe_config, tiny_sdar_config, tiny_sdar_moe_config
    raw = {"llada2": tiny_llada2_config, "llada_moe": tiny_llada_moe_config,
           "sdar": tiny_sdar_config, "sdar_moe": tiny_sdar_moe_config}.get(
        fam.name, lambda: tiny_config(fam.name))()
    return fam.parse_config(raw)


def test_resolve_keeps_a_named_cache_and_the_engine_resolves_none(ckpt):
    from flash_dllm.entrypoints.llm import LLM

    llm = LLM(ckpt)
    named = SamplingParams(max_tokens=8, cache="prefix")
    assert resolve_params(named, llm.cfg) is named
    req = llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=8))
    assert req.params.cache == "dual" and req.params.decode == "threshold"
    llm.engine.abort(req.request_id)


# ----------------------------------------------------------------------------- the layers
def test_precedence_request_flags_generation_config_recommended(tmp_path):
    folder = _gen_config(tmp_path, max_new_tokens=48, temperature=0.5, top_k=4, cache="prefix",
                         threshold=0.8)
    d = SamplingDefaults.of({"threshold": 0.95, "top_k": None, "decode": "vanilla"}, folder)
    # the flags over the file over the recommended
    p = d.params()
    assert (p.threshold, p.decode, p.max_tokens, p.temperature, p.top_k, p.cache) == \
        (0.95, "vanilla", 48, 0.5, 4, "prefix")
    assert p.early_stop is True and p.gamma == 0.8                  # recommended (own default)
    # the request over everything
    q = d.params({"threshold": 0.5, "cache": "dual", "max_tokens": 16, "decode": None})
    assert (q.threshold, q.cache, q.max_tokens, q.decode) == (0.5, "dual", 16, "vanilla")
    src = d.sources()
    assert src["threshold"] == "flags" and src["max_tokens"].endswith("generation_config.json")
    eff = d.effective(lambda p: p)
    assert eff["values"]["threshold"] == 0.95 and eff["sources"]["gamma"] == "recommended"


def test_per_canvas_knobs_follow_the_request():
    d = SamplingDefaults((("flags", {"max_tokens": 64, "steps": 64, "block_length": 16,
                                     "max_verify": 8}),))
    assert (d.params().steps, d.params().block_length, d.params().max_verify) == (64, 16, 8)
    # a request's own canvas: the flags' steps were for another one, the block is fitted
    p = d.params({"max_tokens": 24})
    assert (p.steps, p.block_length) == (24, 12) and p.max_verify == 8
    q = d.params({"max_tokens": 24, "block_length": 4})
    assert q.max_verify == 4                          # chosen for another block: derived
    assert fit_block_length(40) == 20 and fit_block_length(7) == 7 and fit_block_length(64) == 32
    assert SamplingDefaults().params({"max_tokens": 40}).block_length == 20


def test_unknown_layer_knob_is_an_error():
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['nope'\] in flags"):
        SamplingDefaults((("flags", {"nope": 1}),))


# ------------------------------------------------------------------- generation_config.json
def test_generation_config_keys(tmp_path, caplog):
    assert read_generation_config(tmp_path) == {}                  # no file: no defaults
    _gen_config(tmp_path, max_new_tokens=128, top_p=0.95, top_k=20, decode="vanilla",
                block_length=16, do_sample=False, temperature=0.7, alg="entropy",
                transformers_version="4.46")
    with caplog.at_level(logging.DEBUG, logger="flash_dllm"):
        got = read_generation_config(tmp_path)
    # do_sample false is greedy whatever temperature says (as Hugging Face reads it)
    assert got == {"max_tokens": 128, "top_p": 0.95, "top_k": 20, "decode": "vanilla",
                   "block_length": 16, "temperature": 0.0}
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "'alg'" in ignored and "'bos_token_id'" in ignored and "ignored" in ignored
    _gen_config(tmp_path, do_sample=True)
    assert read_generation_config(tmp_path) == {"temperature": 1.0}
    _gen_config(tmp_path, do_sample=True, temperature=0.2)
    assert read_generation_config(tmp_path) == {"temperature": 0.2}


@pytest.mark.parametrize("keys,match", [
    ({"temperature": -1}, r"key 'temperature': temperature must be"),
    ({"max_new_tokens": 0}, r"key 'max_new_tokens': max_tokens must be an integer >= 1"),
    ({"decode": "fastest"}, r"key 'decode': decode must be one of"),
    ({"threshold": "high"}, r"key 'threshold'"),
    ({"do_sample": "yes"}, r"key 'do_sample' must be true or false"),
    ({"max_new_tokens": 8, "max_tokens": 16}, r"'max_tokens' both set max_tokens"),
])
def test_generation_config_bad_values_name_file_and_key(tmp_path, keys, match):
    _gen_config(tmp_path, **keys)
    with pytest.raises(ValueError, match=match) as e:
        read_generation_config(tmp_path)
    assert str(tmp_path / "generation_config.json") in str(e.value)


def test_generation_config_not_json(tmp_path):
    (tmp_path / "generation_config.json").write_text("{nope", encoding="utf-8")
    with pytest.raises(ValueError, match="generation_config.json: not a readable JSON file"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_generation_config(tmp_path)


# ----------------------------------------------------------------------------- entry points
def test_cli_flags_are_none_unless_given():
    a = build_parser().parse_args(["serve", "--decode", "vanilla", "--cache", "none"])
    assert sampling_flags(a) == {"decode": "vanilla", "cache": "none"}
    g = build_parser().parse_args(["generate", "hi", "--threshold", "0.7"])
    assert sampling_flags(g) == {"threshold": 0.7}
    over = SamplingDefaults((("gen", {"threshold": 0.5, "max_tokens": 32}),))
    p = sampling_from_args(g, defaults=over)
    assert (p.threshold, p.max_tokens) == (0.7, 32)          # the flag over the file


def test_help_names_the_default_mode_and_the_exact_flag(capsys):
    for cmd in ("serve", "generate"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "threshold decoding at 0.99" in out and "--decode vanilla --cache none" in out
        assert "generation_config.json" in out


def test_llm_layers_its_defaults(tmp_path):
    from flash_dllm.entrypoints.llm import LLM

    folder = _gen_config(write_tiny_checkpoint(tmp_path / "tiny"), max_new_tokens=16,
                         threshold=0.7)
    llm = LLM(folder, sampling_defaults={"threshold": 0.6})
    p = llm.sampling_params(block_length=8)
    assert (p.threshold, p.max_tokens, p.block_length, p.cache) == (0.6, 16, 8, None)
    out = llm.generate([5, 6, 7])[0]                # no params: the layers, then the engine
    assert len(out.token_ids) <= 16
    with pytest.raises(ValueError, match="key 'threshold'"):
        LLM(_gen_config(folder, threshold=2.0))


def test_v1_models_shows_the_effective_defaults(ckpt, tmp_path):
    from flash_dllm.entrypoints.serve import build_server_app

    folder = _gen_config(write_tiny_checkpoint(tmp_path / "tiny"), max_new_tokens=16)
    a = build_parser().parse_args(["serve", "--model", str(folder), "--threshold", "0.95",
                                   "--kv-cache-gb", "0.01"])
    app, aeng, _ = build_server_app(a)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            aeng.start()
            try:
                models = (await c.get("/v1/models")).json()
                gen = (await c.post("/generate", json={"prompt": [5, 6, 7]})).json()
                exact = (await c.post("/generate", json={"prompt": [5, 6, 7], "decode": "vanilla",
                                                         "cache": "none"})).json()
            finally:
                await aeng.shutdown(timeout=5)
            return models, gen, exact

    models, gen, exact = asyncio.run(go())
    m = models["data"][0]
    vals, src = m["sampling_defaults"], m["sampling_defaults_source"]
    assert (vals["decode"], vals["cache"], vals["threshold"], vals["max_tokens"]) == \
        ("threshold", "dual", 0.95, 16)
    assert src["threshold"] == "serve flags"
    assert src["max_tokens"].endswith("generation_config.json")
    assert src["decode"] == "recommended" and src["cache"].startswith("recommended")
    # a request without knobs gets those defaults: 16 slots; the exact one a forward per slot
    assert len(gen["token_ids"]) <= 16 and exact["num_forwards"] >= gen["num_forwards"]


def test_serve_refuses_a_default_request_that_cannot_run(ckpt):
    from flash_dllm.entrypoints.serve import build_server_app

    bad = build_parser().parse_args(["serve", "--model", str(ckpt), "--threshold", "2"])
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
        build_server_app(bad)                  # before the model loads
    block = build_parser().parse_args(["serve", "--model", str(ckpt), "--cache", "block",
                                       "--kv-cache-gb", "0.01"])
    with pytest.raises(ValueError, match="the default request .* cannot run on this model: "
                                         "cache='block' needs a block-causal model"):
        build_server_app(block)
