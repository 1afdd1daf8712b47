#!/usr/bin/env python
"""Train a proxy dLLM (LLaDA- or Dream-format, ~20 M parameters) on the long-answer suites.

The proxies stand in for LLaDA-8B and Dream-7B where the demo model cannot: their answers are
~80-260 tokens of a real byte-level BPE tokenizer, in varied phrasing, so a 32-token block takes
several threshold forwards, as on the real models. Same objective and data path as
``train_demo.py`` (its Pool / make_batch / reference sampler are reused), with:

- ``--format llada``: MHA, no biases, LLaDA config keys and tensor names, LLaDA specials and chat
  template; ``--format dream``: GQA, q/k/v biases, Qwen2 names, **shifted logits** (the target at
  position i is trained from output i-1, as Dream reads it), Qwen2.5 chat template.
- a BPE tokenizer learnt from the suites' training text (``proxy_tokenizer.py``);
- random canvases: each batch draws a generation length G from ``GEN_LENGTHS`` (32..512); an
  answer longer than G is cut to it, a shorter one is EOS-padded, so any canvas from 32 to 512
  gives a sensible (possibly truncated) answer; the batch size follows G so every batch holds
  about ``--batch-tokens`` tokens.

Reproduce the committed checkpoints (one H200 each, one 10-minute command; checkpoints/README.md):
    python tools/train_proxy.py --format llada --out $OUT/proxy-llada --minutes 7.6 --pool 300000
    python tools/train_proxy.py --format dream --out $OUT/proxy-dream --minutes 7.6
Continue one (same dims, its tokenizer kept, fresh optimizer and schedule):
    python tools/train_proxy.py --format dream --out $OUT/part2 --init-from $OUT/part1
Split one run over several commands (optimizer, step, data order and LR schedule carried on):
    python tools/train_proxy.py --format dream --out /tmp/p --minutes 9 --schedule-minutes 16 \
        --eval-n 0 --save-state /tmp/p.state
    python tools/train_proxy.py --format dream --out /tmp/p --minutes 9 --schedule-minutes 16 \
        --resume /tmp/p.state
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/train_proxy.py` from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import proxy_tokenizer
import torch
import torch.nn.functional as F
import train_demo
from train_demo import (Pool, _load_tok, evaluate, lr_at, make_batch, make_optimizer,
                        make_readable, setup_run)

from flash_dllm.evals.tasks import LONG_SUITES
from flash_dllm.models.loader import build_model, load_model, save_checkpoint

GEN_LENGTHS = (32, 64, 128, 192, 256, 320, 384, 512)
GEN_WEIGHTS = (1, 1, 2, 2, 3, 2, 1, 1)
EVAL_GEN_LENGTH = 256
TOKEN_DTYPE = np.int16        # the pool's token arrays (BPE ids < 1024)
MAX_POSITION = 4096
SUITES = LONG_SUITES


def hf_config(args, ids: dict, vocab: int) -> dict:
    """config.json in the real family's keys (../shared/MODELS.md)."""
    if args.format == "llada":
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
            "n_kv_heads": args.n_heads, "mlp_hidden_size": args.mlp,
            "mlp_ratio": args.mlp / args.d_model, "vocab_size": vocab, "embedding_size": vocab,
            "max_sequence_length": MAX_POSITION, "rope": True, "rope_theta": 10000.0,
            "rope_full_precision": True, "rms_norm_eps": 1e-5, "layer_norm_type": "rms",
            "activation_type": "silu", "block_type": "llama", "include_bias": False,
            "include_qkv_bias": False, "weight_tying": False,
            "mask_token_id": ids["mask"], "eos_token_id": ids["eos"], "pad_token_id": ids["eos"],
            "bos_token_id": ids["bos"],
        }
    return {
        "architectures": ["DreamModel"], "model_type": "Dream",
        "hidden_size": args.d_model, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
        "intermediate_size": args.mlp, "vocab_size": vocab, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": MAX_POSITION,
        "tie_word_embeddings": False, "mask_token_id": ids["mask"], "eos_token_id": ids["eos"],
        "pad_token_id": ids["eos"], "bos_token_id": ids["bos"], "rope_scaling": None,
        "torch_dtype": "bfloat16",
    }


def batch_size_for(glen: int, prompt_width: int, batch_tokens: int) -> int:
    """Sequences per batch so that B * (prompt + G) ~ batch_tokens (a multiple of 8, >= 8)."""
    return max(8, (batch_tokens // (prompt_width + glen)) // 8 * 8)


_POOL_FIELDS = ("plain", "plain_len", "chat", "chat_len", "ans", "ans_len", "counts", "n",
                "max_answer")


def load_or_build_pool(args, out: Path, eos: int, device, workers: int) -> Pool:
    """The training pool, from ``--pool-cache`` when that file holds this very pool (same suites,
    size, seed and tokenizer), else built and, with ``--pool-cache``, saved there: the parts of a
    split run skip the ~1-2 minutes of problem generation and tokenizing."""
    # NOTE: every tokenizer file counts (the chat template and BOS setting shape the rows), and
    # the token dtype
    tok_hash = hashlib.sha256(b"".join((out / f).read_bytes()
                                       for f in proxy_tokenizer.TOKENIZER_FILES)).hexdigest()
    key = {"suites": list(SUITES), "pool": args.pool, "seed": args.seed, "tokenizer": tok_hash,
           "dtype": np.dtype(TOKEN_DTYPE).name}
    cache = Path(args.pool_cache) if args.pool_cache else None
    if cache is not None and cache.exists():
        saved = torch.load(cache, map_location="cpu", weights_only=False)
        if saved["key"] == key:
            pool = Pool.__new__(Pool)
            for name, value in saved["fields"].items():
                setattr(pool, name, value.to(device) if torch.is_tensor(value) else value)
            print(f"pool loaded from {cache}", flush=True)
            return pool
        print(f"{cache} holds another pool (suites, size, seed or tokenizer differ): rebuilding",
              flush=True)
    pool = Pool(list(SUITES), args.pool, args.seed, str(out), eos, device, workers,
                min_gen_length=None, token_dtype=TOKEN_DTYPE)
    if cache is not None:
        fields = {name: getattr(pool, name) for name in _POOL_FIELDS}
        tmp = cache.with_name(cache.name + ".tmp")
        torch.save({"key": key, "fields": {k: v.cpu() if torch.is_tensor(v) else v
                                           for k, v in fields.items()}}, tmp)
        os.replace(tmp, cache)
    return pool


def load_data(args, out: Path, fmt: str, device, t0: float):
    """(special ids, problem pool, tokenizer, padded vocabulary) once ``out`` holds the
    tokenizer of format ``fmt``; prints what was loaded (``t0``: the run's start)."""
    ids = proxy_tokenizer.token_ids(fmt)
    workers = args.workers or max(1, min(16, os.cpu_count() or 1))
    pool = load_or_build_pool(args, out, ids["eos"], device, workers)
    tok = _load_tok(str(out))
    vocab = -(-len(tok) // 64) * 64
    pw = max(pool.plain.shape[1], pool.chat.shape[1])
    print(f"data: {pool.n} problems, prompt width {pw}, answers up to {pool.max_answer} tokens, "
          f"vocab {len(tok)} (padded {vocab}); {time.time() - t0:.1f}s", flush=True)
    return ids, pool, tok, vocab


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--format", choices=proxy_tokenizer.FORMATS, required=True)
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--minutes", type=float, default=7.6,
                    help="wall-clock budget from start to the end of training (the LR schedule "
                         "follows it); saving and the final eval (2 x 200 problems per suite, "
                         "float32) add ~2 min on an H200: 7.6 fits a 10-minute command")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0 = time)")
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1)")
    ap.add_argument("--chat-frac", type=float, default=0.5)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layers", type=int, default=10)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-kv-heads", type=int, default=2, help="dream only (GQA)")
    ap.add_argument("--mlp", type=int, default=0,
                    help="0 = the format's default (1184 / 1344: ~20.2 M parameters)")
    ap.add_argument("--vocab", type=int, default=proxy_tokenizer.VOCAB_SIZE)
    ap.add_argument("--tokenizer-corpus", type=int, default=10000,
                    help="training problems per suite the BPE merges are learnt from")
    ap.add_argument("--pool", type=int, default=200_000, help="training problems per suite")
    ap.add_argument("--workers", type=int, default=0, help="data processes (0 = auto)")
    ap.add_argument("--pool-cache", default="",
                    help="keep the tokenized pool in this file and reuse it when it matches")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--eval-n", type=int, default=200,
                    help="held-out problems per suite at the end")
    ap.add_argument("--eval-modes", nargs="+", choices=("plain", "chat"),
                    default=["plain", "chat"],
                    help="prompt forms of the final eval (each ~1 min on an H200 alone)")
    ap.add_argument("--eval-every", type=float, default=2.5, help="minutes between interim evals")
    ap.add_argument("--eval-interim-n", type=int, default=64)
    ap.add_argument("--eval-gen-length", type=int, default=EVAL_GEN_LENGTH)
    ap.add_argument("--init-from", default="", help="continue from this checkpoint (same dims)")
    ap.add_argument("--schedule-minutes", type=float, default=0,
                    help="training minutes the LR schedule spans, over every part of a split run "
                         "(0 = this run's own training time)")
    ap.add_argument("--schedule-steps", type=int, default=0,
                    help="steps the LR schedule spans over every part of a split run in --steps "
                         "mode (0 = --steps: this run's own)")
    ap.add_argument("--save-state", default="",
                    help="write the whole training state (float32 weights, optimizer, counters, "
                         "random states, tokenizer) here at the end, for --resume")
    ap.add_argument("--resume", default="",
                    help="continue the run whose --save-state file this is (same arguments)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the loss (model + cross-entropy); falls back to eager if "
                         "compiling fails")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.init_from and args.resume:
        ap.error("--init-from and --resume exclude each other (--resume restores the weights)")
    if args.schedule_minutes < 0:
        ap.error(f"--schedule-minutes must be >= 0, got {args.schedule_minutes}")
    if args.schedule_steps < 0 or (args.schedule_steps and not args.steps):
        ap.error(f"--schedule-steps must be >= 0 and needs --steps, got {args.schedule_steps}")
    if not args.mlp:
        args.mlp = 1184 if args.format == "llada" else 1344
    return args


def _schedule_args(args) -> dict:
    """What one LR schedule over the parts of a split run depends on (saved with the state)."""
    return {k: getattr(args, k) for k in ("schedule_minutes", "schedule_steps", "lr",
                                          "min_lr_ratio", "warmup")}


def main(argv=None) -> dict:
    t0 = time.time()
    args = parse_args(argv)
    device, cuda, out = setup_run(args)
    shift = 1 if args.format == "dream" else 0

    state = torch.load(args.resume, map_location="cpu", weights_only=False) if args.resume else None
    if state is not None:
        # NOTE: the parts of a split run share one LR schedule only if they agree on it: a part
        # that spans another schedule (or none) would restart the decay without a word
        saved = state.get("schedule", {})
        now = _schedule_args(args)
        bad = {k: (saved[k], now[k]) for k in saved if saved[k] != now[k]}
        if bad:
            raise SystemExit(f"--resume {args.resume}: the saved run's schedule differs "
                             + ", ".join(f"--{k.replace('_', '-')} {a} (saved) vs {b}"
                                         for k, (a, b) in bad.items())
                             + ": resume with the saved run's values")
        # NOTE: the ids must stay those the weights were trained with: the state carries them
        for name, data in state["tokenizer"].items():
            (out / name).write_bytes(data)
    elif args.init_from:
        # NOTE: the ids must stay those the weights were trained with: keep the tokenizer
        for name in proxy_tokenizer.TOKENIZER_FILES:
            if Path(args.init_from).resolve() != out.resolve():
                shutil.copy(Path(args.init_from) / name, out / name)
    else:
        corpus = proxy_tokenizer.default_corpus(n=args.tokenizer_corpus)
        proxy_tokenizer.build_tokenizer(out, args.format, corpus, vocab_size=args.vocab)
    ids, pool, tok, vocab = load_data(args, out, args.format, device, t0)
    t_data = time.time() - t0
    pw = max(pool.plain.shape[1], pool.chat.shape[1])         # the widest prompt

    cfg = hf_config(args, ids, vocab)
    model = build_model(cfg, device=device, dtype=torch.float32, seed=args.seed)
    if state is not None:
        if state["config"] != cfg:
            raise SystemExit(f"--resume {args.resume}: its model config differs from these "
                             f"arguments' (resume with the arguments of the saved run)")
        model.load_state_dict(state["model"])
    elif args.init_from:
        start, _ = load_model(args.init_from, device=device, dtype=torch.float32)
        model.load_state_dict(start.state_dict())
        del start
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model ({args.format}): {n_params / 1e6:.2f}M params ({n_params * 2 / 1e6:.1f} MB bf16)",
          flush=True)
    opt = make_optimizer(model, args, cuda)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    glen_rng = random.Random(args.seed + 2)
    step, seqs, tokens, prior_train_s, parts = 0, 0, 0, 0.0, 0
    history, evals, first_loss = [], [], None
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["gen"])
        glen_rng.setstate(state["glen_rng"])
        step, seqs, tokens = state["step"], state["seqs"], state["tokens"]
        prior_train_s, parts = state["train_seconds"], state["parts"]
        history, evals, first_loss = state["history"], state["evals"], state["first_loss"]
        print(f"resumed {args.resume}: step {step}, {prior_train_s / 60:.2f} min trained in "
              f"{parts} part(s)", flush=True)
        del state

    def loss_of(noisy, key_mask, target, weight):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(noisy, key_mask)
        if shift:  # Dream: the token at position i is predicted by output i-1
            logits, target, weight = logits[:, :-1], target[:, 1:], weight[:, 1:]
        ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
        return (ce * weight.flatten()).sum() / noisy.shape[0]

    def train_step(fn, batch):
        loss = fn(*batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss

    # NOTE: the model is small (d 384), so eager training spends most of its time in unfused
    # elementwise kernels; compiling the loss fuses them. Shapes vary with the canvas: the first
    # recompile makes them dynamic.
    step_fn = torch.compile(loss_of) if args.compile else loss_of
    # NOTE: interim evals run in float32 (TF32 matmuls): the model's fused inference norms refuse
    # autocast's mixed dtypes
    ev = dict(gen_length=args.eval_gen_length, shift=shift)

    t_train = time.time()
    train_budget = max(1.0, args.minutes * 60.0 - (t_train - t0))
    schedule_s = (args.schedule_minutes * 60.0 if args.schedule_minutes
                  else prior_train_s + train_budget)
    n_acc = 0
    loss_acc = torch.zeros((), device=device)
    next_eval = args.eval_every * 60 if args.eval_every > 0 else math.inf
    last_t, last_step = time.time(), step
    while True:
        elapsed = time.time() - t_train
        if (args.steps and step >= args.steps) or (not args.steps and elapsed >= train_budget):
            break
        progress = (step / (args.schedule_steps or args.steps) if args.steps
                    else (prior_train_s + elapsed) / schedule_s)
        lr = lr_at(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        glen = glen_rng.choices(GEN_LENGTHS, GEN_WEIGHTS)[0]
        bsz = batch_size_for(glen, pw, args.batch_tokens)
        noisy, key_mask, target, weight = make_batch(pool, bsz, glen, args.chat_frac, ids["eos"],
                                                     ids["mask"], args.eps, gen, device)
        batch = (noisy, key_mask, target, weight)
        try:
            loss = train_step(step_fn, batch)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not cost the run
            if step_fn is loss_of:
                raise
            print(f"torch.compile failed ({e!r}); training eagerly", flush=True)
            step_fn = loss_of
            loss = train_step(step_fn, batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        seqs += bsz
        tokens += int(key_mask.numel())
        loss_acc += loss.detach()
        n_acc += 1
        if step % args.log_every == 0 or step == 1:
            avg = float(loss_acc) / n_acc
            first_loss = avg if first_loss is None else first_loss
            now = time.time()
            sps = (step - last_step) / max(now - last_t, 1e-9)
            last_t, last_step = now, step
            history.append({"step": step, "loss": avg, "lr": lr, "elapsed_s": now - t0})
            print(f"step {step:6d}  loss {avg:.4f}  lr {lr:.2e}  {sps:5.1f} steps/s  "
                  f"{seqs / 1e6:.2f}M seqs  {(now - t0) / 60:.2f} min", flush=True)
            loss_acc.zero_()
            n_acc = 0
        if time.time() - t_train >= next_eval:
            try:
                acc = evaluate(model, tok, list(SUITES), args.eval_interim_n, ids, device, **ev)
                evals.append({"step": step, "n": args.eval_interim_n, **acc})
                print(f"eval @ step {step}: {acc}", flush=True)
            except Exception as e:  # noqa: BLE001 - an eval hiccup must not cost the run
                evals.append({"step": step, "error": repr(e)})
                print(f"interim eval failed: {e!r}", flush=True)
            model.train()
            next_eval += args.eval_every * 60
    train_minutes = (prior_train_s + time.time() - t_train) / 60
    parts += 1
    if args.save_state:
        # NOTE: written beside its final name, then renamed: a cut-off write never looks complete
        tmp = Path(args.save_state + ".tmp")
        torch.save({"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict(), "gen": gen.get_state(),
                    "glen_rng": glen_rng.getstate(), "step": step, "seqs": seqs,
                    "tokens": tokens, "train_seconds": train_minutes * 60, "parts": parts,
                    "history": history, "evals": evals, "first_loss": first_loss, "config": cfg,
                    "schedule": _schedule_args(args),
                    "tokenizer": {n: (out / n).read_bytes()
                                  for n in proxy_tokenizer.TOKENIZER_FILES}}, tmp)
        os.replace(tmp, args.save_state)
        print(f"training state saved to {args.save_state}", flush=True)
    final_loss = (float(loss_acc) / n_acc if n_acc
                  else history[-1]["loss"] if history else math.nan)
    print(f"trained {step} steps in {train_minutes:.2f} min; loss {first_loss} -> {final_loss:.4f}",
          flush=True)

    model.eval()
    # NOTE: shards under 16 MB: the repository keeps every file small.
    save_checkpoint(model, out, cfg, dtype=torch.bfloat16, max_shard_bytes=15_000_000)
    gen_cfg = {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["eot"]],
               "pad_token_id": ids["eos"], "mask_token_id": ids["mask"]}
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump(gen_cfg, f, indent=2)
    make_readable(out)
    size_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6

    final_eval: dict = {}
    log = {
        "args": vars(args), "config": cfg, "params": n_params, "steps": step,
        "sequences_seen": seqs, "tokens_seen_padded": tokens, "first_loss": first_loss,
        "final_loss": final_loss, "train_minutes": train_minutes, "parts": parts,
        "data_seconds": t_data, "weights_mb": size_mb,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "history": history, "interim_evals": evals,
        "final_eval": final_eval,
        "final_eval_settings": {"n_per_suite": args.eval_n, "gen_length": args.eval_gen_length,
                                "block": train_demo.EVAL_BLOCK, "tokens_per_step": 1,
                                "remasking": "low_confidence", "temperature": 0,
                                "modes": list(args.eval_modes)},
    }

    def write_log() -> None:
        # NOTE: written before the final eval and after each of its modes: a command cut short
        # by its time limit during the eval still leaves the run's record and what was scored
        log["total_minutes"] = (time.time() - t0) / 60
        tmp = out / "train_log.json.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(log, f, indent=2)
        os.replace(tmp, out / "train_log.json")

    write_log()
    if args.eval_n > 0:
        t_eval = time.time()
        torch.backends.cuda.matmul.allow_tf32 = False
        shipped, _ = load_model(out, device=device, dtype=torch.float32)
        for mode in args.eval_modes:
            try:
                acc = evaluate(shipped, tok, list(SUITES), args.eval_n, ids, device,
                               chat=mode == "chat", show=2, gen_length=args.eval_gen_length,
                               shift=shift)
            except Exception as e:  # noqa: BLE001 - still write train_log.json
                final_eval["error"] = repr(e)
                print(f"final eval failed: {e!r}", flush=True)
                break
            final_eval[mode] = acc
            write_log()
            print(f"final eval ({mode}, {args.eval_n}/suite, exact sampler "
                  f"gen {args.eval_gen_length}): {acc}", flush=True)
        print(f"eval took {time.time() - t_eval:.1f}s", flush=True)
    write_log()
    print(f"done in {(time.time() - t0) / 60:.2f} min", flush=True)
    return log


if __name__ == "__main__":
    main()
