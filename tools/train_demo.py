#!/usr/bin/env python
"""Train the shipped demo dLLM: a small LLaDA-format masked-diffusion model on the arith + code suites.

The model is the engine's own ``DiffusionTransformer`` (LLaDA config + tensor names), trained from
scratch with the LLaDA SFT objective: per sample ``t ~ U(eps, 1)``, every token of the generated
region (answer + EOS padding up to a generation length G drawn per batch from {64, 96, 128}) is masked with
probability ``t``, the prompt never is; loss = sum over masked tokens of CE / t, divided by the
number of generated-region tokens, averaged over the batch.

Prompts are encoded exactly as the engine encodes them: ``tok(prompt)`` (BOS + chars) for plain
prompts and, for ``--chat-frac`` of the samples, ``tok(tok.apply_chat_template(...))``.

Writes into ``--out``: ``config.json`` + ``model.safetensors`` (bf16, via
``flash_dllm.models.loader.save_checkpoint``), ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``, ``generation_config.json`` and ``train_log.json``. At the end it reloads
the written checkpoint with ``load_model`` and scores it with a reference LLaDA sampler (greedy, one
token per step, low-confidence remasking, blocks of 32, gen length 64) on held-out problems.

Reproduce the shipped weights (one H200, see tools/README.md):
    python tools/train_demo.py --out $OUT/demo
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python tools/train_demo.py` from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_tokenizer
import numpy as np
import torch
import torch.nn.functional as F

from flash_dllm.evals.tasks import SUITES
from flash_dllm.models.loader import build_model, load_model, save_checkpoint

GEN_LENGTHS = (64, 96, 128)
EVAL_GEN_LENGTH = 64
EVAL_BLOCK = 32
VOCAB_PADDED = 128  # 103 real tokens, rounded up for tidy matmuls (LLaDA pads its vocab too)
# token arrays of the data pool: uint8 fits the demo's 103 ids (train_proxy.py passes int16)
TOKEN_DTYPE = np.uint8


# --------------------------------------------------------------------------------------------- data

_WORKER_TOK = {}


def _load_tok(folder: str):
    if folder not in _WORKER_TOK:
        from transformers import PreTrainedTokenizerFast
        _WORKER_TOK[folder] = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    return _WORKER_TOK[folder]


def chat_text(tok, prompt: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": prompt}],
                                   add_generation_prompt=True, tokenize=False)


def chat_texts(tok, prompts: list[str], check: int = 500) -> list[str]:
    """``chat_text`` of many prompts fast: the template wraps the content verbatim, so render it once
    around a sentinel and splice; the first ``check`` prompts are compared with the real rendering."""
    sentinel = "\x00CONTENT\x00"
    head, tail = chat_text(tok, sentinel).split(sentinel)
    out = [head + p + tail for p in prompts]
    for p, fast in zip(prompts[:check], out):
        if chat_text(tok, p) != fast:
            raise AssertionError(f"chat template is not a plain wrapper for {p!r}")
    return out


def _pad_rows(seqs: list[list[int]], fill: int, width: int | None = None,
              dtype=TOKEN_DTYPE):
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    arr = np.full((len(seqs), width or int(lens.max())), fill, dtype=dtype)
    for i, s in enumerate(seqs):
        arr[i, :len(s)] = s
    return arr, lens


def _gen_chunk(job: tuple[str, int, int, str, int, str]) -> dict[str, np.ndarray]:
    """``n`` training problems of one suite, tokenized exactly as the engine tokenizes them."""
    suite, n, seed, tok_folder, eos, dtype = job
    tok = _load_tok(tok_folder)
    probs = SUITES[suite].train_problems(n, seed)
    # NOTE: suite prompts end in "\n"; people typing a question (`flash-dllm generate "..."`, chat)
    # leave it out, so every other problem drops it (plain and chat alternate, both forms seen).
    plain = [p.prompt if i % 2 else p.prompt.rstrip("\n") for i, p in enumerate(probs)]
    chat = [p.prompt.rstrip("\n") if i % 2 else p.prompt for i, p in enumerate(probs)]
    out = {}
    for name, ids in (("plain", tok(plain)["input_ids"]),
                      ("chat", tok(chat_texts(tok, chat))["input_ids"]),
                      ("ans", tok([p.answer for p in probs], add_special_tokens=False)["input_ids"])):
        out[name], out[name + "_len"] = _pad_rows(ids, eos, dtype=np.dtype(dtype))
    return out


class Pool:
    """Token arrays of every training problem, resident on the training device (``token_dtype``:
    the demo's ``TOKEN_DTYPE``, int16 for the proxies' BPE vocabularies).

    ``plain``/``chat`` hold the encoded prompt (BOS + chars, or the chat-templated version), ``ans``
    the answer's character ids; each is EOS-padded with its ``*_len`` alongside.
    """

    def __init__(self, suites: list[str], per_suite: int, seed: int, tok_folder: str, eos: int,
                 device: torch.device, workers: int, chunk: int = 10000,
                 min_gen_length: int | None = min(GEN_LENGTHS), token_dtype=TOKEN_DTYPE) -> None:
        dtype = np.dtype(token_dtype)
        jobs = []
        for s_idx, suite in enumerate(suites):
            for c in range(math.ceil(per_suite / chunk)):
                n = min(chunk, per_suite - c * chunk)
                jobs.append((suite, n, seed * 100003 + s_idx * 10007 + c, tok_folder, eos,
                             dtype.name))
        # NOTE: the pool is a pure function of (suites, per_suite, seed, chunk): each chunk has its
        # own seed, so the worker count changes nothing.
        if workers > 1:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            with mp.get_context("fork").Pool(workers) as p:
                parts = p.map(_gen_chunk, jobs, chunksize=1)
        else:
            parts = [_gen_chunk(j) for j in jobs]
        self.counts = {s: sum(j[1] for j in jobs if j[0] == s) for s in suites}
        self.n = sum(self.counts.values())
        for name in ("plain", "chat", "ans"):
            width = max(part[name].shape[1] for part in parts)
            arr = np.full((self.n, width), eos, dtype=dtype)
            row = 0
            for part in parts:
                k, w = part[name].shape
                arr[row:row + k, :w] = part[name]
                row += k
            lens = np.concatenate([part[name + "_len"] for part in parts])
            setattr(self, name, torch.from_numpy(arr).to(device))
            setattr(self, name + "_len", torch.from_numpy(lens).to(device))
        self.max_answer = int(self.ans_len.max())
        # NOTE: min_gen_length None: answers longer than a canvas are cut to it (proxy models)
        if min_gen_length is not None and self.max_answer >= min_gen_length:
            raise ValueError(f"an answer has {self.max_answer} tokens; the shortest generation "
                             f"length {min_gen_length} must leave room for EOS")


def make_batch(pool: Pool, batch_size: int, glen: int, chat_frac: float, eos: int, mask_id: int,
               eps: float, gen: torch.Generator, device: torch.device, round_to: int = 8):
    """A noised training batch of generation length ``glen``, built entirely on ``device``.

    Row i = prompt_i (never masked) + gen region of ``glen`` tokens (answer_i then EOS), then EOS
    padding up to a fixed length per ``glen`` (static shapes, no host sync) that ``key_mask`` hides.
    Returns (noisy, key_mask, target, weight): ``weight`` is 1/(t_i * glen) on masked positions and 0
    elsewhere, so ``(CE * weight).sum() / B`` is the LLaDA SFT loss.
    """
    B = batch_size
    idx = torch.randint(pool.n, (B,), device=device, generator=gen)
    use_chat = torch.rand(B, device=device, generator=gen) < chat_frac
    plen = torch.where(use_chat, pool.chat_len[idx], pool.plain_len[idx])
    alen = pool.ans_len[idx]
    total = plen + glen
    pc, pp = pool.chat.shape[1], pool.plain.shape[1]
    L = -(-(max(pc, pp) + glen) // round_to) * round_to
    j = torch.arange(L, device=device)[None, :]                              # [1, L]
    chat_tok = pool.chat[idx].long().gather(1, j.clamp(max=pc - 1).expand(B, L))
    plain_tok = pool.plain[idx].long().gather(1, j.clamp(max=pp - 1).expand(B, L))
    prompt_tok = torch.where(use_chat[:, None], chat_tok, plain_tok)
    g = j - plen[:, None]                                                    # index in gen region
    ans_tok = pool.ans[idx].long().gather(1, g.clamp(0, pool.ans.shape[1] - 1))
    is_prompt = j < plen[:, None]
    target = torch.where(is_prompt, prompt_tok,
                         torch.where(g < alen[:, None], ans_tok, torch.full_like(ans_tok, eos)))
    key_mask = j < total[:, None]
    region = (~is_prompt) & key_mask
    t = eps + (1 - eps) * torch.rand(B, device=device, generator=gen)
    masked = region & (torch.rand(B, L, device=device, generator=gen) < t[:, None])
    noisy = torch.where(masked, torch.full_like(target, mask_id), target)
    weight = masked.float() / (t[:, None] * glen)
    return noisy, key_mask, target, weight


# ------------------------------------------------------------------------------- reference sampler

@torch.no_grad()
def reference_generate(model, prompts: list[list[int]], mask_id: int, pad_id: int,
                       gen_length: int = EVAL_GEN_LENGTH, block: int = EVAL_BLOCK,
                       device: torch.device | str = "cpu", autocast: bool = False,
                       shift: int = 0) -> torch.Tensor:
    """LLaDA's sampler at temperature 0, one token per step, low-confidence remasking, semi-AR blocks.

    Prompts are left-padded with ``pad_id`` behind a key mask (RoPE is relative, so this equals the
    unpadded computation). ``shift`` 1: Dream's shifted logits (position i read from output i-1).
    Returns the generated ids ``[B, gen_length]``.
    """
    B = len(prompts)
    P = max(len(p) for p in prompts)
    x = torch.full((B, P + gen_length), mask_id, dtype=torch.long, device=device)
    key_mask = torch.ones(B, P + gen_length, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        x[i, :P - len(p)] = pad_id
        key_mask[i, :P - len(p)] = False
        x[i, P - len(p):P] = torch.tensor(p, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)
    pos = torch.arange(gen_length, device=device)
    dev_type = torch.device(device).type
    for b in range(gen_length // block):
        in_block = (pos >= b * block) & (pos < (b + 1) * block)
        for _ in range(block):
            with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(x, key_mask)[:, P - shift:P + gen_length - shift].float()
            conf, x0 = F.softmax(logits, dim=-1).max(-1)
            masked = x[:, P:] == mask_id
            conf = torch.where(masked & in_block, conf, torch.full_like(conf, -math.inf))
            j = conf.argmax(-1)
            ok = torch.isfinite(conf[rows, j])
            x[rows[ok], P + j[ok]] = x0[rows[ok], j[ok]]
    return x[:, P:]


def decode_completions(tok, gen: torch.Tensor, stop_ids: set[int]) -> list[str]:
    out = []
    for row in gen.tolist():
        cut = next((k for k, t in enumerate(row) if t in stop_ids), len(row))
        ids = [t for t in row[:cut] if t < len(tok)]
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def evaluate(model, tok, suites: list[str], n: int, ids: dict, device, batch: int = 256,
             chat: bool = False, autocast: bool = False, show: int = 0,
             gen_length: int = EVAL_GEN_LENGTH, shift: int = 0) -> dict[str, float]:
    """Accuracy per suite on the first ``n`` held-out problems (reference sampler)."""
    model.eval()
    acc = {}
    for suite_name in suites:
        suite = SUITES[suite_name]
        probs = suite.test_problems(n, 0)
        comps: list[str] = []
        for s in range(0, len(probs), batch):
            chunk = probs[s:s + batch]
            texts = [chat_text(tok, p.prompt) if chat else p.prompt for p in chunk]
            prompts = [tok(t)["input_ids"] for t in texts]
            gen = reference_generate(model, prompts, ids["mask"], ids["eos"], device=device,
                                     autocast=autocast, gen_length=gen_length, shift=shift)
            comps += decode_completions(tok, gen, {ids["eos"], ids["eot"]})
        ok = suite.score_batch(probs, comps)
        acc[suite_name] = sum(ok) / max(len(ok), 1)
        for p, c, good in list(zip(probs, comps, ok))[:show]:
            print(f"  [{suite_name}{' chat' if chat else ''}] {'OK ' if good else 'BAD'} "
                  f"{p.prompt.strip()!r} -> {c!r}", flush=True)
    return acc


# ------------------------------------------------------------------------------------------- main

def hf_config(args, ids: dict) -> dict:
    return {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
        "n_kv_heads": args.n_heads, "mlp_hidden_size": args.mlp,
        "mlp_ratio": args.mlp / args.d_model,
        "vocab_size": VOCAB_PADDED, "embedding_size": VOCAB_PADDED,
        "max_sequence_length": 512, "rope": True, "rope_theta": 10000.0,
        "rope_full_precision": True, "rms_norm_eps": 1e-5, "layer_norm_type": "rms",
        "activation_type": "silu", "block_type": "llama", "include_bias": False,
        "include_qkv_bias": False, "weight_tying": False,
        "mask_token_id": ids["mask"], "eos_token_id": ids["eos"], "pad_token_id": ids["eos"],
        "bos_token_id": ids["bos"],
    }


def setup_run(args) -> tuple[torch.device, bool, Path]:
    """Threads, seed and TF32 for a training run; returns (device, is CUDA, output folder)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(args.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return device, cuda, out


def make_readable(folder: Path) -> None:
    """safetensors writes 0600; a checkpoint folder is meant to be shipped."""
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(0o644)


def make_optimizer(model, args, cuda: bool) -> torch.optim.AdamW:
    """AdamW (beta 0.9/0.95), weight decay on matrices only, fused on CUDA."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             **({"fused": True} if cuda else {}))


def lr_at(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup))
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * warm * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cos)


def parse_args(argv=None):
    out_default = os.path.join(os.environ["OUT"], "demo") if os.environ.get("OUT") else "demo_ckpt"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=out_default, help="checkpoint folder ($OUT/demo if OUT is set)")
    ap.add_argument("--minutes", type=float, default=8.0,
                    help="wall-clock budget from script start to the end of training; the LR "
                         "schedule follows it. Final save + eval add ~1 min at most")
    ap.add_argument("--steps", type=int, default=0,
                    help="stop after this many steps (0 = time budget only); when set, the LR "
                         "schedule follows steps (use with a large --minutes to reproduce exactly)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eps", type=float, default=1e-3, help="t ~ U(eps, 1)")
    ap.add_argument("--chat-frac", type=float, default=0.5,
                    help="fraction of samples whose prompt goes through the chat template")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=6)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=512)
    ap.add_argument("--suites", default="arith,code")
    ap.add_argument("--pool", type=int, default=500_000, help="training problems per suite")
    ap.add_argument("--workers", type=int, default=0, help="data-generation processes (0 = auto)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (optional)")
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--eval-n", type=int, default=200, help="held-out problems per suite at the end")
    ap.add_argument("--eval-every", type=float, default=2.0,
                    help="minutes between interim evals of --eval-interim-n problems (0 = off)")
    ap.add_argument("--eval-interim-n", type=int, default=100)
    ap.add_argument("--init-from", default="",
                    help="start from this checkpoint folder (same dims) instead of random init")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    t0 = time.time()
    args = parse_args(argv)
    device, cuda, out = setup_run(args)
    suites = [s for s in args.suites.split(",") if s]

    # tokenizer (the same files are shipped with the checkpoint)
    demo_tokenizer.build_tokenizer(out)
    ids = demo_tokenizer.token_ids()

    # data: workers generate + tokenize fixed-seed chunks (before this process touches tokenizers)
    workers = args.workers or max(1, min(16, os.cpu_count() or 1))
    pool = Pool(suites, args.pool, args.seed, str(out), ids["eos"], device, workers)
    tok = _load_tok(str(out))
    assert tok.bos_token_id == ids["bos"] and tok.eos_token_id == ids["eos"]
    t_data = time.time() - t0
    print(f"data: {pool.n} problems ({', '.join(f'{k} {v}' for k, v in pool.counts.items())}), "
          f"prompt widths plain {pool.plain.shape[1]} / chat {pool.chat.shape[1]}, max answer "
          f"{pool.max_answer} tokens; built in {t_data:.1f}s with {workers} workers", flush=True)

    # model
    cfg = hf_config(args, ids)
    model = build_model(cfg, device=device, dtype=torch.float32, seed=args.seed)
    if args.init_from:
        # NOTE: continues from a written checkpoint (bf16-rounded weights, fresh optimizer state and
        # LR schedule); for a second 10-minute command when one is not enough.
        start, _ = load_model(args.init_from, device=device, dtype=torch.float32)
        model.load_state_dict(start.state_dict())
        del start
        print(f"initialised from {args.init_from}", flush=True)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: d={args.d_model} layers={args.n_layers} heads={args.n_heads} mlp={args.mlp} "
          f"vocab={VOCAB_PADDED}: {n_params / 1e6:.2f}M params ({n_params * 2 / 1e6:.1f} MB bf16)",
          flush=True)
    opt = make_optimizer(model, args, cuda)
    fwd = torch.compile(model, dynamic=False) if args.compile else model
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    glen_rng = random.Random(args.seed + 2)  # generation length per batch (host side: no sync)

    budget_s = args.minutes * 60.0
    t_train = time.time()
    train_budget = max(1.0, budget_s - (t_train - t0))
    step, tokens, seqs = 0, 0, 0
    loss_acc = torch.zeros((), device=device)
    n_acc = 0
    history: list[dict] = []
    evals: list[dict] = []
    first_loss = None
    last_log_t, last_log_step = time.time(), 0
    next_eval = args.eval_every * 60 if args.eval_every > 0 else math.inf
    while True:
        elapsed = time.time() - t_train
        progress = step / args.steps if args.steps else elapsed / train_budget
        if args.steps and step >= args.steps:
            break
        if not args.steps and elapsed >= train_budget:
            break
        if args.steps and time.time() - t0 >= budget_s:
            print(f"stopping at the --minutes budget before --steps {args.steps}", flush=True)
            break
        lr = lr_at(step, progress, args)
        for group in opt.param_groups:
            group["lr"] = lr
        glen = glen_rng.choice(GEN_LENGTHS)
        noisy, key_mask, target, weight = make_batch(
            pool, args.batch_size, glen, args.chat_frac, ids["eos"], ids["mask"], args.eps, gen,
            device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = fwd(noisy, key_mask)
        ce = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
        loss = (ce * weight.flatten()).sum() / args.batch_size
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        seqs += args.batch_size
        tokens += int(key_mask.numel())
        loss_acc += loss.detach()
        n_acc += 1
        if step % args.log_every == 0 or step == 1:
            avg = float(loss_acc) / n_acc
            if first_loss is None:
                first_loss = avg
            now = time.time()
            sps = (step - last_log_step) / max(now - last_log_t, 1e-9)
            last_log_t, last_log_step = now, step
            history.append({"step": step, "loss": avg, "lr": lr, "elapsed_s": now - t0})
            print(f"step {step:6d}  loss {avg:.4f}  lr {lr:.2e}  {sps:6.1f} steps/s  "
                  f"{seqs / 1e6:.2f}M seqs  {(now - t0) / 60:.2f} min", flush=True)
            loss_acc.zero_()
            n_acc = 0
        if time.time() - t_train >= next_eval:
            try:
                acc = evaluate(model, tok, suites, args.eval_interim_n, ids, device, autocast=cuda)
                evals.append({"step": step, "n": args.eval_interim_n, **acc})
                print(f"eval @ step {step}: {acc}", flush=True)
            except Exception as e:  # noqa: BLE001 - an eval hiccup must not cost the training run
                print(f"interim eval failed: {e!r}", flush=True)
            model.train()
            next_eval += args.eval_every * 60
    train_minutes = (time.time() - t_train) / 60
    final_loss = history[-1]["loss"] if history else float("nan")
    if n_acc:
        final_loss = float(loss_acc) / n_acc
    print(f"trained {step} steps in {train_minutes:.2f} min (+{t_data:.0f}s data); "
          f"loss {first_loss or math.nan:.4f} -> {final_loss:.4f}", flush=True)

    # save (bf16 weights + tokenizer + generation config), then reload and evaluate what was written
    model.eval()
    save_checkpoint(model, out, cfg, dtype=torch.bfloat16)
    with open(out / "generation_config.json", "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["eot"]],
                   "pad_token_id": ids["eos"], "mask_token_id": ids["mask"]}, f, indent=2)
    make_readable(out)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    print(f"saved {out} (model.safetensors {size_mb:.1f} MB)", flush=True)

    final_eval: dict = {}
    if args.eval_n > 0:
        t_eval = time.time()
        # NOTE: full fp32 (no TF32) so this matches the engine's float32 CPU numerics.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        shipped, _ = load_model(out, device=device, dtype=torch.float32)
        for chat in (False, True):
            try:
                acc = evaluate(shipped, tok, suites, args.eval_n, ids, device, chat=chat, show=3)
            except Exception as e:  # noqa: BLE001 - still write train_log.json
                print(f"final eval failed: {e!r}", flush=True)
                final_eval["error"] = repr(e)
                break
            final_eval["chat" if chat else "plain"] = acc
            print(f"final eval ({'chat' if chat else 'plain'} prompts, {args.eval_n}/suite, bf16 "
                  f"weights in fp32, exact sampler gen {EVAL_GEN_LENGTH} block {EVAL_BLOCK}): "
                  f"{acc}", flush=True)
        print(f"eval took {time.time() - t_eval:.1f}s", flush=True)

    log = {
        "args": vars(args), "config": cfg, "params": n_params, "steps": step,
        "sequences_seen": seqs, "tokens_seen_padded": tokens, "first_loss": first_loss,
        "final_loss": final_loss, "train_minutes": train_minutes, "data_seconds": t_data,
        "total_minutes": (time.time() - t0) / 60, "model_safetensors_mb": size_mb,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "history": history, "interim_evals": evals,
        "final_eval": final_eval,
        "final_eval_settings": {"n_per_suite": args.eval_n, "gen_length": EVAL_GEN_LENGTH,
                                "block": EVAL_BLOCK, "tokens_per_step": 1,
                                "remasking": "low_confidence", "temperature": 0},
    }
    with open(out / "train_log.json", "w", encoding="utf-8") as f:
        json.dump(log, f, indent=2)
    print(f"done in {(time.time() - t0) / 60:.2f} min", flush=True)
    return log


if __name__ == "__main__":
    main()
