#!/usr/bin/env python
"""Train a LLaDA2-format proxy (block-causal MoE, ~14 M parameters) on the long-answer suites.

The model is the engine's own LLaDA2 family (``LLaDA2MoeModelLM`` config keys, fused
``query_key_value`` and per-expert tensors on disk): block-causal attention over blocks of 32
counted from position 0, GQA, per-head q/k RMSNorm, partial rotary 0.5, a dense SwiGLU in layer
0 and MoE MLPs elsewhere (sigmoid router with ``expert_bias``, one group, a shared expert). The
tokenizer, data pool and optimizer are ``train_proxy.py``'s / ``train_demo.py``'s (imported).

Objective (block diffusion, two-stream as BD3-LM / LLaDA2 train it): each row is
``[x_t ; x_0]``, 2L tokens, positions ``0..L-1`` twice. Noisy block b attends to noisy block b
(bidirectional) and to clean blocks < b; the clean stream is block-causal over itself and never
sees the noisy one. So one forward gives every block's denoising loss against its exact clean
prefix, as the exact block cache decodes it. Each 32-block draws its own mask ratio
``t ~ U(eps, 1)``; answer tokens (and the EOS padding of the canvas) are masked with it, the
prompt never; loss = sum over masked tokens of CE / t, divided by the canvas G, averaged over
rows (``train_demo``'s objective, per block).

``--init-from`` a dense LLaDA proxy (``checkpoints/proxy-llada``) upcycles it
(``llada2_upcycle.py``) and keeps its tokenizer; without it the model starts from random
weights and a freshly learnt tokenizer. Experts stay used by loss-free balancing: after every
step each layer's ``expert_bias`` moves by ``--bias-rate`` towards the mean load.

The final evaluation runs the saved checkpoint through the engine (``LLM``, float32 weights):
exact (``decode="vanilla"``, one token per step) and threshold 0.9, both with the exact block
cache, canvas 256 (``--eval-n`` held-out problems per suite).

    python tools/train_llada2_proxy.py --init-from checkpoints/proxy-llada --out $OUT/proxy-llada2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/train_llada2_proxy.py` from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import llada2_upcycle
import proxy_tokenizer
import torch
import torch.nn.functional as F
from train_demo import lr_at, make_batch, make_optimizer, make_readable, setup_run
from train_proxy import batch_size_for, load_data

from flash_dllm.evals.tasks import LONG_SUITES
from flash_dllm.models.llada2 import BLOCK_LENGTH
from flash_dllm.models.loader import build_model, load_model, save_checkpoint

GEN_LENGTHS = (64, 128, 192, 256, 320)
GEN_WEIGHTS = (1, 2, 2, 4, 1)
EVAL_GEN_LENGTH = 256
MAX_POSITION = 4096
SUITES = LONG_SUITES


def llada2_config(args, ids: dict, vocab: int) -> dict:
    """config.json in LLaDA2.0's keys (../shared/MODELS.md; ``models/llada2.parse_config``)."""
    return {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "hidden_size": args.d_model, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.d_model // args.n_heads, "intermediate_size": args.dense_mlp,
        "first_k_dense_replace": args.dense_layers, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "num_shared_experts": 1,
        "moe_intermediate_size": args.expert_mlp,
        "moe_shared_expert_intermediate_size": args.expert_mlp,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": float(args.top_k),
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True, "router_dtype": "fp32",
        "use_qk_norm": True, "use_rmsnorm": True, "partial_rotary_factor": 0.5,
        "rope_theta": args.rope_theta, "rope_scaling": None, "use_qkv_bias": False,
        "use_bias": False, "norm_head": False, "num_nextn_predict_layers": 0,
        "use_sliding_window": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "max_position_embeddings": MAX_POSITION, "tie_word_embeddings": False,
        "vocab_size": vocab, "mask_token_id": ids["mask"], "eos_token_id": ids["eos"],
        "pad_token_id": ids["eos"], "bos_token_id": ids["bos"], "torch_dtype": "bfloat16",
    }


# ------------------------------------------------------------------------------ two-stream forward

def two_stream_mask(key_mask: torch.Tensor, block: int = BLOCK_LENGTH) -> torch.Tensor:
    """key_mask [B, L] (True: real token) -> SDPA mask [B, 1, 2L, 2L] of ``[x_t ; x_0]``:
    noisy->noisy same block, noisy->clean earlier blocks, clean->clean same or earlier blocks,
    clean->noisy never; padding keys hidden (a row always sees itself)."""
    B, L = key_mask.shape
    blk = torch.arange(L, device=key_mask.device) // block
    q, k = blk[:, None], blk[None, :]                                   # [L, 1], [1, L]
    top = torch.cat([q == k, k < q], 1)                                  # noisy queries [L, 2L]
    bottom = torch.cat([torch.zeros_like(top[:, :L]), k <= q], 1)        # clean queries
    allow = torch.cat([top, bottom], 0)                                  # [2L, 2L]
    keys = torch.cat([key_mask, key_mask], 1)[:, None, None, :]          # [B, 1, 1, 2L]
    eye = torch.eye(2 * L, dtype=torch.bool, device=key_mask.device)
    return (allow & keys) | eye


class MaskContext:
    """``DenseContext`` with an explicit boolean mask (the two streams are not a function of
    positions). K/V heads are repeated for GQA: SDPA's memory-efficient kernel takes a mask,
    its ``enable_gqa`` path may not."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def attention(self, attn, layer: int, x: torch.Tensor, positions: torch.Tensor):
        q, k, v = attn.project(x)                      # q [B, S, H, D], k/v [B, S, Hkv, D]
        q, k = attn.rotary(q, positions), attn.rotary(k, positions)
        if k.shape[2] != q.shape[2]:
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=self.mask)
        return out.transpose(1, 2).flatten(2)          # [B, S, H*D]


def moe_train(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoE.forward`` for training: the same routing (``moe.route``) and math, every expert
    computed as one dense GEMM and weighted by its (zero when unchosen) routing weight: at
    these sizes cheaper than sorting tokens, differentiable, static shapes. -> (out, tokens
    routed to each expert [E])."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)                                               # [T, d]
    E, I = moe.cfg.num_experts, moe.cfg.intermediate_size
    ids, w = moe.route(flat)                                              # [T, k] each
    dense_w = torch.zeros(flat.shape[0], E, device=x.device, dtype=w.dtype).scatter(1, ids, w)
    gu = F.linear(flat, moe.w_gate_up.reshape(E * 2 * I, d)).view(-1, E, 2, I)
    h = F.silu(gu[:, :, 0]) * gu[:, :, 1] * dense_w[:, :, None].to(gu.dtype)   # [T, E, I]
    out = F.linear(h.reshape(-1, E * I), moe.w_down.permute(1, 0, 2).reshape(d, E * I))
    out = out + moe.shared(flat)
    load = torch.zeros(E, device=x.device).index_add_(
        0, ids.flatten(), torch.ones(ids.numel(), device=x.device))
    return out.view(*lead, d), load


def two_stream_logits(model, noisy: torch.Tensor, clean: torch.Tensor, key_mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the noisy stream [B, L, V] and the MoE loads [moe layers, E]."""
    L = noisy.shape[1]
    ids = torch.cat([noisy, clean], 1)                                    # [B, 2L]
    positions = torch.arange(L, device=ids.device).repeat(2)              # [2L]
    ctx = MaskContext(two_stream_mask(key_mask))
    h = model.embed(ids)
    loads = []
    for i, layer in enumerate(model.layers):
        h = h + layer.attn(layer.attn_norm(h), positions, i, ctx)
        m = layer.mlp_norm(h)
        if model.cfg.layer_mlp_kind(i) == "moe":
            m, load = moe_train(layer.mlp, m)
            loads.append(load)
        else:
            m = layer.mlp(m)
        h = h + m
    logits = model.lm_head(model.norm(h[:, :L]))
    return logits, (torch.stack(loads) if loads else h.new_zeros(0, 1))


def block_noise(target: torch.Tensor, region: torch.Tensor, mask_id: int, eps: float,
                glen: int, gen: torch.Generator, block: int = BLOCK_LENGTH):
    """Per-(row, block) mask ratio: -> (noisy, weight = masked / (t_block * glen))."""
    B, L = target.shape
    blk = torch.arange(L, device=target.device) // block
    t = eps + (1 - eps) * torch.rand(B, -(-L // block), device=target.device, generator=gen)
    t = t[:, blk]                                                          # [B, L]
    masked = region & (torch.rand(B, L, device=target.device, generator=gen) < t)
    noisy = torch.where(masked, torch.full_like(target, mask_id), target)
    return noisy, masked.float() / (t * glen)


def clean_batch(pool, bsz: int, glen: int, args, ids: dict, gen: torch.Generator):
    """(target, key_mask, region) of a batch whose length is a multiple of the block:
    ``make_batch`` with t = 1 masks exactly the generated region."""
    noisy, key_mask, target, _ = make_batch(pool, bsz, glen, args.chat_frac, ids["eos"],
                                            ids["mask"], 1.0, gen, pool.ans.device,
                                            round_to=BLOCK_LENGTH)
    return target, key_mask, noisy == ids["mask"]


# ------------------------------------------------------------------------------------ evaluation

def engine_eval(folder: Path, n: int, device: str, modes=("exact", "threshold")) -> dict:
    """Accuracy of the saved checkpoint through the engine (float32 weights, exact block
    cache, canvas 256): exact = vanilla one token per step; threshold = 0.9."""
    from flash_dllm import LLM
    from flash_dllm.config import SamplingParams
    from flash_dllm.evals.runner import run_eval

    out: dict = {}
    llm = LLM(folder, device=device, dtype="float32", max_num_seqs=min(256, max(n, 1)))
    for mode in modes:
        params = SamplingParams(max_tokens=EVAL_GEN_LENGTH, cache="block",
                                decode="vanilla" if mode == "exact" else "threshold",
                                threshold=0.9)
        out[mode] = {}
        for suite in SUITES:
            t0 = time.time()
            rep = run_eval(llm, suite, n, params, progress=False, keep_samples=False)
            out[mode][suite] = {"accuracy": rep["accuracy"],
                                "forwards_per_block": rep["forwards_per_block"]["mean"],
                                "seconds": time.time() - t0}
            print(f"final eval {mode:9s} {suite:9s} n={n}: {100 * rep['accuracy']:.1f} % "
                  f"({rep['forwards_per_block']['mean']:.1f} fwd/block, "
                  f"{time.time() - t0:.0f}s)", flush=True)
    llm.close()
    return out


# ------------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--init-from", default="",
                    help="a dense LLaDA-format proxy to upcycle, or a LLaDA2 proxy of the same "
                         "dims to continue (its tokenizer is kept either way)")
    ap.add_argument("--minutes", type=float, default=7.0,
                    help="wall-clock budget from start to the end of training (the LR schedule "
                         "follows it); saving and the engine eval come on top")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too")
    ap.add_argument("--batch-tokens", type=int, default=65536,
                    help="tokens of one stream per batch (the forward runs twice as many)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1) per block")
    ap.add_argument("--chat-frac", type=float, default=0.5)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layers", type=int, default=10)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-kv-heads", type=int, default=3)
    ap.add_argument("--dense-layers", type=int, default=1, help="first_k_dense_replace")
    ap.add_argument("--dense-mlp", type=int, default=1184, help="the dense layers' SwiGLU width")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-mlp", type=int, default=84,
                    help="each expert's (and the shared expert's) SwiGLU width")
    ap.add_argument("--rope-theta", type=float, default=100.0,
                    help="100 = 1e4 ** 0.5: the upcycled rotary's frequencies (llada2_upcycle)")
    ap.add_argument("--router-scale", type=float, default=0.5)
    ap.add_argument("--bias-rate", type=float, default=1e-3,
                    help="loss-free balancing: expert_bias step per training step")
    ap.add_argument("--vocab", type=int, default=proxy_tokenizer.VOCAB_SIZE)
    ap.add_argument("--tokenizer-corpus", type=int, default=10000)
    ap.add_argument("--pool", type=int, default=200_000, help="training problems per suite")
    ap.add_argument("--pool-cache", default="")
    ap.add_argument("--workers", type=int, default=0, help="data processes (0 = auto)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out problems per suite")
    ap.add_argument("--eval-modes", nargs="+", choices=("exact", "threshold"),
                    default=["exact", "threshold"])
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the loss; falls back to eager if compiling fails")
    ap.add_argument("--threads", type=int, default=0)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    t0 = time.time()
    args = parse_args(argv)
    device, cuda, out = setup_run(args)
    if args.init_from:
        # NOTE: the ids must stay those the dense weights were trained with: keep its tokenizer
        for name in proxy_tokenizer.TOKENIZER_FILES:
            if Path(args.init_from).resolve() != out.resolve():
                shutil.copy(Path(args.init_from) / name, out / name)
    else:
        proxy_tokenizer.build_tokenizer(out, "llada", proxy_tokenizer.default_corpus(
            n=args.tokenizer_corpus), vocab_size=args.vocab)
    ids, pool, tok, vocab = load_data(args, out, "llada", device, t0)
    t_data = time.time() - t0
    pw = max(pool.plain.shape[1], pool.chat.shape[1])         # the widest prompt

    cfg = llada2_config(args, ids, vocab)
    model = build_model(cfg, device=device, dtype=torch.float32, seed=args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    upcycle_report = None
    if args.init_from:
        dense, start_cfg = load_model(args.init_from, device=device, dtype=torch.float32)
    if args.init_from and start_cfg.arch == "llada2":
        # NOTE: a second command continues a LLaDA2 proxy (same dims; fresh optimizer and
        # schedule), as train_proxy's --init-from does
        model.load_state_dict(dense.state_dict())
        del dense
        print(f"continuing {args.init_from}", flush=True)
    elif args.init_from:
        target, key_mask, _ = clean_batch(pool, 32, EVAL_GEN_LENGTH, args, ids, gen)
        upcycle_report = llada2_upcycle.upcycle(dense, model, target, key_mask,
                                                router_scale=args.router_scale, seed=args.seed)
        del dense
        print("upcycled " + args.init_from + ": " + ", ".join(
            f"L{r['layer']} err {r['kept_rel_err']:.2f} r2 {r['router_r2']:.2f}"
            for r in upcycle_report["layers"] if r["mlp"] == "moe"), flush=True)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model (llada2): {n_params / 1e6:.2f}M params ({n_params * 2 / 1e6:.1f} MB bf16)",
          flush=True)
    opt = make_optimizer(model, args, cuda)
    biases = [layer.mlp.gate.expert_bias for i, layer in enumerate(model.layers)
              if model.cfg.layer_mlp_kind(i) == "moe"]
    glen_rng = random.Random(args.seed + 2)

    # NOTE: noise is drawn outside the compiled region (a generator inside it breaks graphs)
    def core(noisy, target, key_mask, weight):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits, loads = two_stream_logits(model, noisy, target, key_mask)
        ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
        return (ce * weight.flatten()).sum() / target.shape[0], loads

    step_fn = torch.compile(core) if args.compile else core
    t_train = time.time()
    budget = max(1.0, args.minutes * 60.0 - (t_train - t0))
    step, seqs, tokens, history, first_loss = 0, 0, 0, [], None
    loss_acc, n_acc = torch.zeros((), device=device), 0
    load_acc = torch.zeros(len(biases), args.experts, device=device)
    last_t, last_step, last_tokens = time.time(), 0, 0
    while True:
        elapsed = time.time() - t_train
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        progress = step / args.max_steps if args.max_steps else elapsed / budget
        lr = lr_at(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        glen = glen_rng.choices(GEN_LENGTHS, GEN_WEIGHTS)[0]
        bsz = batch_size_for(glen, pw, args.batch_tokens)
        target, key_mask, region = clean_batch(pool, bsz, glen, args, ids, gen)
        noisy, weight = block_noise(target, region, ids["mask"], args.eps, glen, gen)
        try:
            loss, loads = step_fn(noisy, target, key_mask, weight)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not cost the run
            if step_fn is core:
                raise
            print(f"torch.compile failed ({e!r}); training eagerly", flush=True)
            step_fn = core
            loss, loads = step_fn(noisy, target, key_mask, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        with torch.no_grad():       # loss-free balancing (DeepSeek-V3): towards the mean load
            loads = loads.detach().float()
            for j, bias in enumerate(biases):
                bias.add_(args.bias_rate * torch.sign(loads[j].mean() - loads[j]))
            load_acc += loads
        step += 1
        seqs += bsz
        tokens += int(key_mask.numel())
        loss_acc += loss.detach()
        n_acc += 1
        if step % args.log_every == 0 or step == 1:
            avg = float(loss_acc) / n_acc
            first_loss = avg if first_loss is None else first_loss
            now = time.time()
            dt = max(now - last_t, 1e-9)
            sps, tps = (step - last_step) / dt, (tokens - last_tokens) / dt
            share = load_acc / load_acc.sum(1, keepdim=True).clamp(min=1)
            spread = float(share.max() * args.experts) if len(biases) else 0.0
            last_t, last_step, last_tokens = now, step, tokens
            history.append({"step": step, "loss": avg, "lr": lr, "elapsed_s": now - t0,
                            "tokens_per_s": tps, "max_expert_load_x_mean": spread})
            print(f"step {step:6d}  loss {avg:.4f}  lr {lr:.2e}  {sps:5.1f} steps/s  "
                  f"{tps / 1e6:.2f}M tok/s (one stream)  max load {spread:.2f}x mean  "
                  f"{seqs / 1e6:.2f}M seqs  {(now - t0) / 60:.2f} min", flush=True)
            loss_acc.zero_()
            load_acc.zero_()
            n_acc = 0
    train_minutes = (time.time() - t_train) / 60
    final_loss = float(loss_acc) / n_acc if n_acc else (history[-1]["loss"] if history
                                                        else math.nan)
    print(f"trained {step} steps in {train_minutes:.2f} min; loss {first_loss} -> "
          f"{final_loss:.4f}", flush=True)

    model.eval()
    save_checkpoint(model, out, cfg, dtype=torch.bfloat16, max_shard_bytes=15_000_000)
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["eot"]],
                   "pad_token_id": ids["eos"], "mask_token_id": ids["mask"]}, f, indent=2)
    make_readable(out)
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    print(f"saved {out}: {size_mb:.1f} MB of weights", flush=True)

    final_eval: dict = {}
    log = {"args": vars(args), "config": cfg, "params": n_params, "steps": step,
           "sequences_seen": seqs, "tokens_seen_padded": tokens, "first_loss": first_loss,
           "final_loss": final_loss, "train_minutes": train_minutes, "data_seconds": t_data,
           "weights_mb": size_mb, "upcycle": upcycle_report,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "torch": torch.__version__, "history": history, "final_eval": final_eval,
           "final_eval_settings": {"n_per_suite": args.eval_n, "max_tokens": EVAL_GEN_LENGTH,
                                   "block": BLOCK_LENGTH, "cache": "block",
                                   "exact": "vanilla, one token per step",
                                   "threshold": 0.9, "weights": "bf16 loaded in float32"}}

    def write_log() -> None:
        log["total_minutes"] = (time.time() - t0) / 60
        tmp = out / "train_log.json.tmp"
        tmp.write_text(json.dumps(log, indent=2), encoding="utf-8")
        os.replace(tmp, out / "train_log.json")

    write_log()
    if args.eval_n > 0:
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            final_eval.update(engine_eval(out, args.eval_n, str(device), args.eval_modes))
        except Exception as e:  # noqa: BLE001 - still write train_log.json
            final_eval["error"] = repr(e)
            print(f"final eval failed: {e!r}", flush=True)
    write_log()
    print(f"done in {(time.time() - t0) / 60:.2f} min", flush=True)
    return log


if __name__ == "__main__":
    main()
