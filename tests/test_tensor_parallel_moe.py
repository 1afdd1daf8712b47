"""Tensor and expert parallelism for LLaDA2 (mixture of experts) on the CPU: real gloo process
groups, real worker processes (issue 39).

``tensor_parallel_size=2`` splits a tiny LLaDA2 checkpoint (real layout: fused
``query_key_value``, per-expert tensors) by KV head for attention and by expert for the routed
experts (expert parallelism: each rank holds half of them), and must give the same tokens as one
process at fp32, token for token, with the block cache and without it, and the same logits
through ``LLM.logits`` up to the order of the ranks' sums. One worker spawn for all of it.
"""
from __future__ import annotations

import os

import pytest
import torch
from conftest import write_tiny_llada2_checkpoint

from flash_dllm import LLM, SamplingParams
from flash_dllm.config import EngineConfig
from flash_dllm.distributed.tp import TPGroup
from flash_dllm.models.loader import load_model

DEVICE = os.environ.get("FLASH_DLLM_TP_DEVICE", "cpu")      # as tests/test_tensor_parallel.py
BL = 32
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(12, 52)), [40, 41], [60, 61, 62, 63, 64]]
CONFIG = EngineConfig(max_num_seqs=3, num_kv_pages=128)        # 4 requests: one waits


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llada2_checkpoint(tmp_path_factory.mktemp("l2tp") / "ckpt", seed=11)


def _params() -> list[SamplingParams]:
    ps = [SamplingParams(max_tokens=64, block_length=BL, decode=d, cache=c, threshold=0.3,
                         steps=16, early_stop=False)
          for d, c in [("llada2", "block"), ("llada2", "none"), ("threshold", "block"),
                       ("vanilla", "none")]]
    ps.append(SamplingParams(max_tokens=64, block_length=BL, decode="llada2", cache="block",
                             steps=16, temperature=0.8, seed=5, early_stop=False))
    return ps


def _generate(llm: LLM) -> list[list[int]]:
    ps = _params()
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(ps))], ps)
    return [o.token_ids for o in outs]


def test_tp2_ep2_equals_one_process(folder):
    canvases = [list(range(5, 45)), list(range(50, 90))]        # [2, 40]: blocks of 32 and 8
    ref_llm = LLM(str(folder), device=DEVICE, dtype="float32", engine_config=CONFIG)
    ref, ref_logits = _generate(ref_llm), ref_llm.logits(canvases)
    ref_block = ref_llm.logits(canvases, block_length=8)
    with LLM(str(folder), device=DEVICE, dtype="float32", engine_config=CONFIG,
             tensor_parallel_size=2) as llm:
        model = llm.engine.model
        moe = model.layers[1].mlp
        assert tuple(moe.w_gate_up.shape[:1]) == (llm.cfg.moe.num_experts // 2,)
        assert (moe.ep.start, moe.ep.end) == (0, llm.cfg.moe.num_experts // 2)
        assert llm.engine.runner.kv_heads == llm.cfg.num_kv_heads // 2
        got = _generate(llm)
        logits = llm.logits(canvases)
        block = llm.logits(canvases, block_length=8)
        # the ranks' engines still agree after a logits command
        again = llm.generate([PROMPTS[0]], _params()[:1])[0].token_ids
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i} ({_params()[i]}): TP=2/EP=2 {b} != one process {a}"
    assert again == ref[0]
    # NOTE: the ranks' partial sums (attention output, experts, LM head) are added in another
    # order than one process adds them: equal up to float32 rounding, not bit for bit
    for want, have in ((ref_logits, logits), (ref_block, block)):
        assert have.shape == want.shape
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_more_ranks_than_kv_heads_replicate_them(tmp_path):
    """One KV head over two ranks (LLaDA2-flash's 4 over 8 GPUs, scaled down): query heads and
    experts still split in two, both ranks hold the KV head; the same tokens as one process."""
    ckpt = write_tiny_llada2_checkpoint(tmp_path / "ckpt", seed=4, num_key_value_heads=1)
    ps = _params()[:2]                                        # llada2: block and none caches
    prompts = PROMPTS[:2]
    ref = [o.token_ids for o in LLM(str(ckpt), device=DEVICE, dtype="float32",
                                    engine_config=CONFIG).generate(prompts, ps)]
    with LLM(str(ckpt), device=DEVICE, dtype="float32", engine_config=CONFIG,
             tensor_parallel_size=2) as llm:
        attn = llm.engine.model.layers[0].attn
        assert (attn.num_heads, attn.num_kv_heads, llm.engine.runner.kv_heads) == (2, 1, 1)
        got = [o.token_ids for o in llm.generate(prompts, ps)]
    assert got == ref


@torch.no_grad()
def test_four_ranks_partial_sums_equal_one_process(tmp_path):
    """Four ranks emulated in one process (no collectives: each rank's partial output is taken
    before its all-reduce): 8 query heads over 2 KV heads split 4 ways (KV heads on two ranks
    each, by the query heads that read them), 8 experts 2 per rank, the shared expert and the
    dense layer by width. The partials sum to the one-process layer outputs."""
    import torch.nn.functional as F

    from flash_dllm.layers.attention import DenseContext
    ckpt = write_tiny_llada2_checkpoint(tmp_path / "ckpt", seed=2, num_attention_heads=8)
    full, cfg = load_model(ckpt)
    x = torch.randn(2, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(40)
    want = [full.layers[i].attn(x, pos, i, DenseContext()) for i in range(cfg.num_layers)]
    want += [full.layers[i].mlp(x) for i in range(cfg.num_layers)]
    got = [torch.zeros_like(w) for w in want]
    for rank in range(4):
        model, _ = load_model(ckpt, tp=TPGroup(rank, 4))
        assert model.tp.kv_heads == 1
        for i, layer in enumerate(model.layers):
            a, m = layer.attn, layer.mlp
            got[i] += F.linear(DenseContext().attention(a, i, x, pos), a.o_proj.weight)
            if not hasattr(m, "ep"):                           # the dense first layer
                h = F.silu(m.gate_proj(x)) * m.up_proj(x)
                got[cfg.num_layers + i] += F.linear(h, m.down_proj.weight)
            else:
                assert (m.ep.start, m.ep.end) == (2 * rank, 2 * rank + 2)
                m.ep.combine = lambda t: t                      # this rank's partial
                got[cfg.num_layers + i] += m(x)
    for i, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"output {i}")


def test_each_rank_loads_only_its_experts_and_heads(folder, monkeypatch):
    """Rank r's shard equals the slices of the one-process model, and the loader never reads
    the checkpoint tensors of another rank's experts."""
    full = dict(load_model(folder)[0].named_parameters())
    for rank in range(2):
        tp = TPGroup(rank, 2)
        read: list[str] = []
        _spy_reads(monkeypatch, read)
        model, cfg = load_model(folder, tp=tp)
        monkeypatch.undo()
        E, n = cfg.moe.num_experts, cfg.moe.num_experts // 2
        other = {f"experts.{e}." for e in range(E) if not rank * n <= e < (rank + 1) * n}
        assert read and not [r for r in read if any(o in r for o in other)]
        for name, p in model.named_parameters():
            want = full[name]
            for dim in range(p.dim()):
                k = p.shape[dim]
                if k != want.shape[dim]:
                    want = want.narrow(dim, rank * k, k)
            assert torch.equal(p, want), (rank, name)


def _spy_reads(monkeypatch, read: list[str]) -> None:
    """Record the names of the checkpoint tensors whose data the loader reads."""
    from contextlib import contextmanager

    from flash_dllm.models import loader
    real = loader._open_weights

    class Spy:
        def __init__(self, f):
            self.f = f

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            handle = self.f.get_slice(name)

            class Slice:
                def get_shape(self):
                    return handle.get_shape()

                def __getitem__(self, index):
                    read.append(name)
                    return handle[index]
            return Slice()

    @contextmanager
    def spy(path):
        with real(path) as f:
            yield Spy(f)
    monkeypatch.setattr(loader, "_open_weights", spy)


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("overrides, world, what", [
    ({"num_attention_heads": 12, "num_key_value_heads": 4}, 6,
     r"num_kv_heads \(4\) or be a multiple of it"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 6, "n_group": 3,
      "topk_group": 2}, 4, r"num_experts \(6\)"),
    ({"num_key_value_heads": 4, "moe_intermediate_size": 30, "num_experts": 4, "n_group": 1,
      "topk_group": 1}, 4, r"shared expert width .*\(30\)"),
])
def test_sizes_that_do_not_split_are_refused_before_spawning(tmp_path, overrides, world, what):
    ckpt = write_tiny_llada2_checkpoint(tmp_path / "ckpt", **overrides)
    with pytest.raises(ValueError, match=f"tensor_parallel_size {world} must divide the "
                                         f"model's {what}"):
        LLM(str(ckpt), dtype="float32", tensor_parallel_size=world)
