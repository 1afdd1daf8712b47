"""SDAR / SDAR-MoE in the paged engine (issue 41): SDAR's published sampler
(``block_diffusion_generate``: per block, ``low_confidence_static`` commits the k_s most confident
masked slots, ``low_confidence_dynamic`` every one above the threshold when there are k_s of
them, else the k_s most confident; k_s = the block length spread over the denoising steps) token
for token against a plain reference loop under SDAR's block-causal
mask, over ``transformers``' Qwen3 / Qwen3-MoE forward (``test_sdar.hf_logits``); on the exact
block cache, threshold decoding equals recomputing every block; general and
fused steps equal.

The engine's names for SDAR's two rules: ``decode="vanilla"`` is ``low_confidence_static`` and
``decode="llada2"`` is ``low_confidence_dynamic`` (LLaDA2's published ``generate`` took SDAR's
rule as it is)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import one_torch_thread  # noqa: F401 (autouse)
from family_checkpoints import tiny_sdar_config, tiny_sdar_moe_config, write_family_checkpoint

from test_sdar import hf_logits, hf_reference

from flash_dllm import LLM
from flash_dllm.config import EngineConfig, SamplingParams

BL = 4                                              # SDAR's block (config.json block_size)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 24)), [40, 41]]
CONFIGS = {"sdar": tiny_sdar_config, "sdar_moe": tiny_sdar_moe_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folder(request, tmp_path_factory):
    return write_family_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt",
                                   CONFIGS[request.param](), seed=12)


@pytest.fixture(scope="module")
def hf(folder):
    return hf_reference(folder)


@torch.no_grad()
def sdar_generate(hf, prompt, gen, steps, tau, mask_id):
    """SDAR's ``block_diffusion_generate`` at temperature 0 (argmax; confidence = the softmax
    probability of the argmax) over transformers' model ``hf``: blocks of 4 from position 0,
    each step a forward over every position up to the active block's end. ``tau`` None:
    ``low_confidence_static``; else ``low_confidence_dynamic`` at ``tau``.

    Two deviations, both the engine's: MASK is never a proposal (a tiny random model may rank
    it first), and k is capped at the block's masks left (the reference's topk would otherwise
    pick unmasked slots of a block the prompt shares and overwrite them)."""
    P = len(prompt)
    L = -(-(P + gen) // BL) * BL
    x = torch.full((1, L), mask_id, dtype=torch.long)
    x[0, :P] = torch.tensor(prompt)
    base, rem = divmod(BL, steps)
    schedule = [base + (1 if i < rem else 0) for i in range(steps)]
    for start in range(P - P % BL, L, BL):
        for step in range(steps + 1):
            masked = x[0, start:start + BL] == mask_id
            if not masked.any():
                break
            logits = hf_logits(hf, x[:, :start + BL], BL)[0, start:start + BL]
            logits[:, mask_id] = -float("inf")
            p = F.softmax(logits.float(), -1)
            conf, tok = p.max(-1)
            conf = torch.where(masked, conf, float("-inf"))
            k = min(schedule[step], int(masked.sum()))
            keep = torch.zeros_like(masked)
            high = conf > tau if tau is not None else keep
            if int(high.sum()) >= k:
                keep = high
            else:
                keep[torch.topk(conf, k).indices] = True
            x[0, start:start + BL] = torch.where(keep, tok, x[0, start:start + BL])
    return x[0]


def _run(folder, cache, decode, steps=None, threshold=0.3, fused=False):
    llm = LLM(str(folder), dtype="float32", engine_config=EngineConfig(fused_step=fused))
    params = SamplingParams(max_tokens=16, block_length=BL, decode=decode, cache=cache,
                            steps=steps, threshold=threshold, early_stop=False)
    eng = llm.engine
    reqs = [eng.add_request(p, params) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    return llm, reqs, eng


@pytest.mark.parametrize("decode,tau,steps", [("vanilla", None, 16), ("vanilla", None, 8),
                                              ("llada2", 0.3, 16), ("llada2", 0.6, 8)])
def test_published_sampler_equals_the_reference_loop(folder, hf, decode, tau, steps):
    """steps 16 over 4 blocks of 4: SDAR's default of 4 denoising steps a block (k = 1); 8: two
    steps a block (k = 2)."""
    for cache in ("none", "block"):
        llm, reqs, _ = _run(folder, cache, decode, steps=steps, threshold=tau or 0.9)
        for prompt, req in zip(PROMPTS, reqs):
            ref = sdar_generate(hf, prompt, 16, steps // 4, tau, llm.cfg.mask_token_id)
            assert req.canvas.tolist() == ref.tolist(), (cache, prompt)


@pytest.mark.parametrize("decode", ["threshold", "llada2"])
def test_block_cache_equals_recomputing_everything(folder, decode):
    _, ref, _ = _run(folder, "none", decode)
    _, got, eng = _run(folder, "block", decode)
    _, fused, feng = _run(folder, "block", decode, fused=True)
    assert feng.runner.fused.stats["fused_steps"] > 0
    for a, b, c in zip(ref, got, fused):
        assert a.canvas.tolist() == b.canvas.tolist() == c.canvas.tolist()
        assert a.num_forwards == b.num_forwards == c.num_forwards
        assert b.counters["positions_computed"] < a.counters["positions_computed"]


def test_generate_and_chat_through_llm(folder):
    with LLM(str(folder), dtype="float32") as llm:
        params = SamplingParams(max_tokens=16, block_length=BL, decode="threshold",
                                threshold=0.5)
        out = llm.generate(["hello"], params)[0]
        assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 16
        assert llm.chat([{"role": "user", "content": "hi"}], params)[0].finished


def test_normed_whole_heads_take_the_rope_page_write_kernel(folder, monkeypatch):
    """SDAR's q/k-normed heads rotate whole: after ``project`` norms them they go through the
    RoPE + page-write op (``attend``, one kernel on CUDA) as LLaDA's do, not through the PyTorch
    rotary of ``attend_normed`` (LLaDA2's partial rotary and fp8 pools keep that path)."""
    from flash_dllm.layers.attention_backend import PagedAttentionMetadata
    seen = []
    for name in ("attend", "attend_normed"):
        real = getattr(PagedAttentionMetadata, name)
        monkeypatch.setattr(PagedAttentionMetadata, name,
                            lambda self, *a, _n=name, _r=real, **k: seen.append(_n)
                            or _r(self, *a, **k))
    with LLM(str(folder), dtype="float32") as llm:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, block_length=BL))
    assert seen and set(seen) == {"attend"}
