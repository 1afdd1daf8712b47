"""Issue 41's families through the entry points, on tiny random checkpoints in their real
layouts: the OpenAI server answers completions and chat (streamed and not) as ``LLM`` does, and
the lm-evaluation-harness adapter generates and scores."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from family_checkpoints import one_torch_thread  # noqa: F401 (autouse)
from family_checkpoints import (tiny_llada_moe_config, tiny_sdar_config, tiny_sdar_moe_config,
                                write_family_checkpoint)

from flash_dllm import LLM, SamplingParams
from flash_dllm.config import EngineConfig
from flash_dllm.entrypoints.serve import load_async_engine
from flash_dllm.server.app import build_app

CONFIGS = {"llada_moe": tiny_llada_moe_config, "sdar": tiny_sdar_config,
           "sdar_moe": tiny_sdar_moe_config}
BLOCK = {"llada_moe": 8, "sdar": 4, "sdar_moe": 4}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    name = request.param
    return name, write_family_checkpoint(tmp_path_factory.mktemp(name) / "ckpt",
                                         CONFIGS[name](), seed=21)


async def _post(app, path, body):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 timeout=60) as c:
        return await c.post(path, json=body)


def test_server_answers_as_llm(case):
    name, folder = case
    knobs = {"max_tokens": 16, "block_length": BLOCK[name], "decode": "threshold",
             "threshold": 0.5}
    with LLM(str(folder), dtype="float32") as llm:
        want = llm.generate(["hello"], SamplingParams(**knobs))[0].text
        want_chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(**knobs))[0].text
    aeng, tok, _ = load_async_engine(folder, config=EngineConfig(num_kv_pages=64))
    app = build_app(aeng, tok, "tiny")
    done = asyncio.run(_post(app, "/v1/completions", {"model": "tiny", "prompt": "hello",
                                                      **knobs}))
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == want
    chat = asyncio.run(_post(app, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], **knobs}))
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == \
        want_chat
    stream = asyncio.run(_post(app, "/v1/completions", {"model": "tiny", "prompt": "hello",
                                                        "stream": True, **knobs}))
    events = [json.loads(b[6:]) for b in stream.text.split("\n\n")
              if b.startswith("data: ") and b != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == want


def test_lm_eval_adapter_generates_and_scores(case):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from flash_dllm.integrations.lm_eval import FlashDLLM

    name, folder = case
    lm = FlashDLLM(pretrained=str(folder), dtype="float32", decode="threshold", threshold=0.5,
                   gen_length=16, block_length=BLOCK[name], mc_num=4)
    out = lm.generate_until([Instance("generate_until", {}, ("2+2=", {"until": ["\n"]}), 0)])
    assert len(out) == 1 and isinstance(out[0], str)
    # no block_length: a block-causal model's own block, else the recommended one
    lm2 = FlashDLLM(llm=lm.llm, decode="llada2" if name != "llada_moe" else "vanilla",
                    gen_length=16, steps=8)
    until, n, params = lm2._params_for({"until": ["\n"], "max_gen_toks": 16}, 0)
    assert params.block_length == {"llada_moe": 16, "sdar": 4, "sdar_moe": 4}[name]
    assert params.steps_per_block == {"llada_moe": 8, "sdar": 2, "sdar_moe": 2}[name]
    assert len(lm2.generate_until([Instance("generate_until", {}, ("2+2=", {}), 0)])) == 1
    (logp, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("2+2=", "4"), 0)])
    assert logp < 0 and isinstance(greedy, bool)


def test_requests_without_block_knobs_get_the_models_block(case):
    """A block-causal model accepts only its own block: a request that names none gets it (a
    layer under generation_config.json, above the recommended 32); a bidirectional model keeps
    the recommended one."""
    name, folder = case
    with LLM(str(folder), dtype="float32") as llm:
        p = llm.sampling_params(max_tokens=16)
        assert p.block_length == {"llada_moe": 16, "sdar": 4, "sdar_moe": 4}[name]
        out = llm.generate("hello", p)[0]
        assert out.finish_reason in ("stop", "length")
        src = llm.sampling_defaults.effective()["sources"]["block_length"]
        assert src == ("recommended" if name == "llada_moe"
                       else "the model (block-causal, blocks of 4)")
    aeng, tok, _ = load_async_engine(folder, config=EngineConfig(num_kv_pages=64))
    from flash_dllm.defaults import SamplingDefaults
    block = aeng.engine.cfg.attention.block_size or None
    app = build_app(aeng, tok, "tiny", sampling_defaults=SamplingDefaults.of(
        None, folder, model_block=block))
    done = asyncio.run(_post(app, "/v1/completions", {"model": "tiny", "prompt": "hello",
                                                      "max_tokens": 16}))
    assert done.status_code == 200, done.text
