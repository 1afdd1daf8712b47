"""Byte-level BPE tokenizers of the proxy models, trained with `tokenizers` on the task text.

Two layouts, each with the special tokens, chat template and config keys of the real checkpoint
family it stands in for (see ../shared/MODELS.md):

- ``llada``: ``<|startoftext|>`` BOS (added by the post-processor, as LLaDA's tokenizer does),
  ``<|endoftext|>`` EOS = pad, ``<|mdm_mask|>``, ``<|eot_id|>``, ``<|start_header_id|>``,
  ``<|end_header_id|>``; LLaDA-Instruct's chat template.
- ``dream``: Qwen2 style: no BOS added on encode (``<|beginoftext|>`` exists, as in Dream's
  tokenizer), ``<|endoftext|>`` EOS = pad, ``<|mask|>``, ``<|im_start|>``, ``<|im_end|>``; the
  Qwen2.5 chat template with Dream's default system prompt.

Pre-tokenisation: digits are split one per token (as LLaMA's and Qwen's tokenizers do, so numbers
are learnable digit by digit), then GPT-2 byte-level splitting; the BPE merges are learnt from
``corpus`` (the suites' training text). The result is a pure function of the corpus and
``vocab_size``: the same corpus gives the same ids.

``python tools/proxy_tokenizer.py {llada|dream} OUT_DIR`` writes just the tokenizer files, trained
on the default corpus (10k problems of each long suite, as train_proxy.py).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Iterable

if __package__ in (None, ""):  # `python tools/proxy_tokenizer.py` from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_tokenizer import CHAT_TEMPLATE

VOCAB_SIZE = 1024

LLADA_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|mdm_mask|>", "<|eot_id|>",
                  "<|start_header_id|>", "<|end_header_id|>")
DREAM_SPECIALS = ("<|endoftext|>", "<|beginoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>")

# LLaDA-Instruct's layout, the demo's (content verbatim, BOS from the post-processor)
LLADA_CHAT_TEMPLATE = CHAT_TEMPLATE
# Qwen2.5 / Dream-Instruct's layout with its default system prompt.
DREAM_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

FORMATS = ("llada", "dream")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def specials(fmt: str) -> tuple[str, ...]:
    if fmt not in FORMATS:
        raise ValueError(f"tokenizer format must be one of {FORMATS}, got {fmt!r}")
    return LLADA_SPECIALS if fmt == "llada" else DREAM_SPECIALS


def default_corpus(n: int = 10000, seed: int = 12345) -> list[str]:
    """Training text of the long suites (prompts and answers), never a test question."""
    from flash_dllm.evals.tasks import LONG_SUITES, SUITES
    out: list[str] = []
    for name in LONG_SUITES:
        for p in SUITES[name].train_problems(n, seed):
            out += [p.prompt, p.answer]
    return out


def train_backend(fmt: str, corpus: Iterable[str], vocab_size: int = VOCAB_SIZE):
    """The `tokenizers.Tokenizer`: specials get ids 0..k-1, then the 256 bytes, then merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    sp = specials(fmt)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(sp),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(corpus, trainer=trainer)
    if fmt == "llada":
        bos = sp[0]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, tk.token_to_id(bos))])
    else:
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, t in enumerate(sp):
        if tk.token_to_id(t) != i:
            raise AssertionError(f"special {t!r} got id {tk.token_to_id(t)}, expected {i}")
    return tk


def token_ids(fmt: str) -> dict[str, int]:
    """Ids of the special tokens by role (bos, eos, mask, eot): they come first, in order."""
    sp = specials(fmt)
    if fmt == "llada":
        return {"bos": 0, "eos": 1, "mask": 2, "eot": 3}
    return {"eos": sp.index("<|endoftext|>"), "bos": sp.index("<|beginoftext|>"),
            "mask": sp.index("<|mask|>"), "eot": sp.index("<|im_end|>")}


def build_tokenizer(folder: str | os.PathLike, fmt: str, corpus: Iterable[str] | None = None,
                    vocab_size: int = VOCAB_SIZE, max_length: int = 4096) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tk = train_backend(fmt, default_corpus() if corpus is None else corpus, vocab_size)
    tk.save(str(folder / "tokenizer.json"))
    sp = specials(fmt)
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(sp)}
    if fmt == "llada":
        roles = {"bos_token": sp[0], "eos_token": sp[1], "pad_token": sp[1], "mask_token": sp[2],
                 "additional_special_tokens": list(sp[3:])}
        extra = {"add_bos_token": True, "chat_template": LLADA_CHAT_TEMPLATE}
    else:
        roles = {"bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>",
                 "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
                 "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
        extra = {"add_bos_token": False, "chat_template": DREAM_CHAT_TEMPLATE}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
              **roles, "add_eos_token": False,
              # NOTE: False, as for the demo: the clean-up would rewrite " ." and break code text.
              "clean_up_tokenization_spaces": False, "model_max_length": max_length,
              "padding_side": "right", **extra}
    with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(folder / "special_tokens_map.json", "w", encoding="utf-8") as f:
        json.dump(roles, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in FORMATS:
        sys.exit("usage: python tools/proxy_tokenizer.py {llada|dream} OUT_DIR")
    out = build_tokenizer(sys.argv[2], sys.argv[1])
    print(f"wrote {sys.argv[1]} tokenizer files to {out} (ids {token_ids(sys.argv[1])})")
