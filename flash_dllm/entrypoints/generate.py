"""``flash-dllm generate``: one prompt (or chat message) through the engine, answer on stdout."""
from __future__ import annotations

import argparse
import sys
import time

from flash_dllm.entrypoints.args import (EngineArgs, add_sampling_flags, check_text_arg,
                                        sampling_from_args)


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("text", nargs="?", default=None, help="the prompt (same as --prompt)")
    g.add_argument("--prompt", default=None, help="plain prompt text")
    g.add_argument("--chat", default=None, help="a user message; the chat template is applied")
    EngineArgs.add_cli_args(g)
    add_sampling_flags(g)
    g.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from flash_dllm.entrypoints.llm import LLM

    texts = [check_text_arg(t, name) for t, name in ((a.text, "the PROMPT argument"),
                                                      (a.prompt, "--prompt")) if t is not None]
    check_text_arg(a.chat, "--chat")
    if a.chat is None and len(texts) != 1:
        raise ValueError("give exactly one prompt: PROMPT, --prompt TEXT or --chat TEXT")
    if a.chat is not None and texts:
        raise ValueError("--chat and a plain prompt are exclusive")
    if "" in texts or a.chat == "":
        # the tokenizer's BOS alone is a prompt the engine would run in full, answering noise
        raise ValueError("the prompt is empty: give some text to continue")
    sampling_from_args(a)                 # bad flags fail before the model loads
    args = EngineArgs.from_cli_args(a)
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              engine_config=args.engine_config(),
              tensor_parallel_size=args.tensor_parallel_size)
    # the flags given, then the checkpoint's generation_config.json, then the recommended
    params = sampling_from_args(a, defaults=llm.sampling_defaults)
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
