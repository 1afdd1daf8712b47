"""tools/train_llada2_proxy.py (issue 39): the two-stream block-diffusion objective sees what a
plain block-causal forward sees, the upcycling keeps the dense model's function where it can,
and a tiny run writes a checkpoint the engine loads and generates with."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import llada2_upcycle  # noqa: E402
import train_llada2_proxy as T  # noqa: E402

from flash_dllm.layers.rotary import Rotary  # noqa: E402
from flash_dllm.models.loader import build_model, load_model  # noqa: E402

IDS = {"bos": 0, "eos": 1, "mask": 2, "eot": 3}


def tiny_cfg(**over) -> dict:
    args = T.parse_args(["--out", "x", "--d-model", "64", "--n-layers", "2", "--n-heads", "4",
                         "--n-kv-heads", "2", "--dense-mlp", "48", "--experts", "4",
                         "--top-k", "2", "--expert-mlp", "8"])
    cfg = T.llada2_config(args, IDS, 64)
    cfg.update(over)
    return cfg


def test_two_stream_equals_block_causal_forward():
    torch.manual_seed(0)
    model = build_model(tiny_cfg(), seed=3).eval()
    L, bl = 96, 32
    clean = torch.randint(4, 64, (2, L))
    noisy = torch.where(torch.rand(2, L) < 0.5, torch.full_like(clean, 2), clean)
    key_mask = torch.ones(2, L, dtype=torch.bool)
    with torch.no_grad():
        logits, loads = T.two_stream_logits(model, noisy, clean, key_mask)
        assert loads.shape == (1, 4) and int(loads.sum()) == 2 * 2 * L * 2   # 2L rows x top-2
        for b in range(L // bl):
            seq = torch.cat([clean[:, :b * bl], noisy[:, b * bl:(b + 1) * bl]], 1)
            plain = model(seq)[:, b * bl:]                      # block-causal by its config
            torch.testing.assert_close(logits[:, b * bl:(b + 1) * bl], plain,
                                       rtol=1e-4, atol=1e-4)


def test_two_stream_mask_hides_padding_and_noisy_from_clean():
    km = torch.tensor([[True] * 40 + [False] * 24])
    m = T.two_stream_mask(km)[0, 0]                             # [128, 128]
    L = 64
    assert not m[L:, :L].any()                                  # clean never sees noisy
    assert m[5, L + 3] == 0 and m[40, L + 3] and not m[40, L + 33]
    assert not m[0, 45] and m[45, 45]                           # padding key hidden, self kept


def test_rotary_perm_carries_the_fast_pairs():
    D, R, theta = 64, 32, 1e4
    q = torch.randn(5, 3, D)
    pos = torch.arange(5)
    dense = Rotary(D, theta, True)(q, pos)
    perm = llada2_upcycle.rotary_perm(D, R)
    new = Rotary(D, llada2_upcycle.upcycled_theta(theta, D, R), True, R)(q[..., perm], pos)
    torch.testing.assert_close(new[..., :R], dense[..., perm][..., :R], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new[..., R:], q[..., perm][..., R:])


def test_upcycle_all_experts_equals_dense_mlp():
    dense_cfg = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 64,
                 "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 48,
                 "vocab_size": 64, "embedding_size": 64, "max_sequence_length": 512,
                 "rope": True, "rope_theta": 10000.0, "rope_full_precision": True,
                 "rms_norm_eps": 1e-5, "layer_norm_type": "rms", "activation_type": "silu",
                 "block_type": "llama", "include_bias": False, "include_qkv_bias": False,
                 "weight_tying": False, "mask_token_id": 2, "eos_token_id": 1,
                 "pad_token_id": 1, "bos_token_id": 0}
    dense = build_model(dense_cfg, seed=1).eval()
    # all 5 experts chosen, nothing pruned ((5 + 1) * 8 = 48), router scores equal
    cfg = tiny_cfg(num_key_value_heads=4, num_experts=5, num_experts_per_tok=5,
                   routed_scaling_factor=5.0)
    model = build_model(cfg, seed=2).eval()
    ids = torch.randint(4, 64, (4, 40))
    rep = llada2_upcycle.upcycle(dense, model, ids, torch.ones_like(ids, dtype=torch.bool),
                                 router_scale=0.0)
    assert rep["layers"][1]["kept_rel_err"] < 1e-6
    x = torch.randn(30, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.layers[1].mlp(x), dense.layers[1].mlp(x),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.layers[0].mlp(x), dense.layers[0].mlp(x))
    # experts + shared expert partition the kept neurons
    rows = torch.cat([model.layers[1].mlp.w_gate_up[:, :8].reshape(-1, 64),
                      model.layers[1].mlp.shared.gate_proj.weight])
    assert torch.equal(rows[rows[:, 0].argsort()],
                       dense.layers[1].mlp.gate_proj.weight[
                           dense.layers[1].mlp.gate_proj.weight[:, 0].argsort()])


def test_tiny_run_writes_a_checkpoint_the_engine_runs(tmp_path):
    from flash_dllm import LLM
    from flash_dllm.config import SamplingParams
    from transformers import PreTrainedTokenizerFast

    out = tmp_path / "l2"
    log = T.main(["--out", str(out), "--device", "cpu", "--max-steps", "2", "--pool", "100",
                  "--tokenizer-corpus", "100", "--workers", "1", "--d-model", "64",
                  "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--dense-mlp", "64",
                  "--experts", "4", "--top-k", "2", "--expert-mlp", "16", "--batch-tokens",
                  "2048", "--eval-n", "0", "--log-every", "1"])
    assert log["steps"] == 2 and (out / "train_log.json").exists()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["model_type"] == "llada2_moe"
    tok = PreTrainedTokenizerFast.from_pretrained(str(out))
    assert cfg["mask_token_id"] == tok.convert_tokens_to_ids("<|mdm_mask|>") == tok.mask_token_id
    assert cfg["eos_token_id"] == tok.eos_token_id
    model, mcfg = load_model(out)
    assert mcfg.moe.num_experts == 4 and mcfg.attention.block_causal
    llm = LLM(out, device="cpu", dtype="float32")
    outs = llm.generate(["Tom has 3 apples."], SamplingParams(max_tokens=32, cache="block"))
    assert len(outs[0].token_ids) <= 32
