"""``flash-dllm`` command line: generate, eval, serve, bench."""
from __future__ import annotations

import argparse
import sys
import time

from flash_dllm.cache.modes import CACHE_MODES
from flash_dllm.config import DECODE_POLICIES, VERIFY_RULES, SamplingParams


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder (Hugging Face layout); default: the shipped demo model")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=128, help="requests decoded together")
    p.add_argument("--kv-layout", default="paged", choices=["paged", "dense"],
                   help="paged: K/V in the page pool, paged kernels (default); dense: plain "
                        "PyTorch path")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: run every forward eagerly (no graph capture)")
    p.add_argument("--fused-step", action="store_true",
                   help="CUDA: run steady greedy dual/prefix steps as one graph each "
                        "(EngineConfig.fused_step; opt-in)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    g = p.add_argument_group("sampling (mirrors SamplingParams)")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens)
    g.add_argument("--block-length", type=int, default=None,
                   help="tokens per block (default: min(32, max-tokens))")
    g.add_argument("--steps", type=int, default=None,
                   help="vanilla: total denoising steps (default: max-tokens, one token per step)")
    g.add_argument("--temperature", type=float, default=d.temperature)
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--decode", default=d.decode, choices=DECODE_POLICIES)
    g.add_argument("--cache", default=d.cache, choices=CACHE_MODES)
    g.add_argument("--threshold", type=float, default=d.threshold)
    g.add_argument("--gamma", type=float, default=d.gamma,
                   help="verify: acceptance level (> 1 accepts nothing)")
    g.add_argument("--verify-rule", default=d.verify_rule, choices=VERIFY_RULES)
    g.add_argument("--max-verify", type=int, default=None,
                   help="verify: drafts checked per forward (default: block length)")
    g.add_argument("--entropy-max", type=float, default=None,
                   help="verify sentinel: verify slots with entropy above this (nats)")
    g.add_argument("--perturb-sigma", type=float, default=None,
                   help="verify sentinel: verify slots whose top-1 flips under logit noise")
    g.add_argument("--kv-jaccard-min", type=float, default=None,
                   help="KV sentinel: refresh keys when a slot's top-k overlap drops below this")
    g.add_argument("--kv-top-k", type=int, default=d.kv_top_k)
    g.add_argument("--flash-budget", type=int, default=d.flash_budget,
                   help="cache=flash: most-attended cached positions recomputed per step")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-early-stop", action="store_true",
                   help="decode every block even after the answer ended")


def sampling_from_args(a: argparse.Namespace, **override) -> SamplingParams:
    kw = dict(max_tokens=a.max_tokens, block_length=a.block_length, steps=a.steps,
              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, decode=a.decode,
              cache=a.cache, threshold=a.threshold, seed=a.seed, early_stop=not a.no_early_stop,
              gamma=a.gamma, verify_rule=a.verify_rule, max_verify=a.max_verify,
              entropy_max=a.entropy_max, perturb_sigma=a.perturb_sigma,
              kv_jaccard_min=a.kv_jaccard_min, kv_top_k=a.kv_top_k, flash_budget=a.flash_budget)
    kw.update(override)
    return SamplingParams(**kw)


def load_llm(a: argparse.Namespace):
    from flash_dllm.engine.llm import LLM
    from flash_dllm.config import EngineConfig
    return LLM(a.model, device=a.device, dtype=a.dtype,
               engine_config=EngineConfig(max_num_seqs=a.max_num_seqs, kv_layout=a.kv_layout,
                                          cuda_graphs=not a.no_cuda_graphs,
                                          fused_step=a.fused_step))


def cmd_generate(a: argparse.Namespace) -> int:
    texts = [t for t in (a.text, a.prompt) if t is not None]
    if a.chat is None and len(texts) != 1:
        raise SystemExit("error: give exactly one prompt: PROMPT, --prompt TEXT or --chat TEXT")
    if a.chat is not None and texts:
        raise SystemExit("error: --chat and a plain prompt are exclusive")
    params = sampling_from_args(a)
    llm = load_llm(a)
    t0 = time.perf_counter()
    if a.chat is not None:
        out = llm.chat([{"role": "user", "content": a.chat}], params)[0]
    else:
        out = llm.generate(texts[0], params)[0]
    dt = time.perf_counter() - t0
    print(out.text)
    n = len(out.token_ids)
    print(f"[{n} tokens, {out.num_forwards} forwards, {out.tokens_per_forward:.2f} tokens/forward, "
          f"{n / dt:.1f} tokens/s, {dt:.2f} s, finish={out.finish_reason}"
          f"{', early stop' if out.early_stopped else ''}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flash-dllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("text", nargs="?", default=None, help="the prompt (same as --prompt)")
    g.add_argument("--prompt", default=None, help="plain prompt text")
    g.add_argument("--chat", default=None, help="a user message; the chat template is applied")
    add_model_flags(g)
    add_sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    try:
        from flash_dllm.evals.cli import add_eval_parser
        add_eval_parser(sub)
    except ImportError:
        pass
    # serving: `serve` and `bench serve` (need the [server] extras: fastapi, uvicorn, httpx)
    try:
        from flash_dllm.bench.cli import add_bench_parser
        from flash_dllm.server.serve import add_serve_parser
        add_serve_parser(sub)
        add_bench_parser(sub)
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
