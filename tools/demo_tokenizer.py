"""Character-level tokenizer of the shipped demo dLLM, built with the `tokenizers` library.

``build_tokenizer(folder)`` writes ``tokenizer.json``, ``tokenizer_config.json`` (with a LLaDA-like
chat template) and ``special_tokens_map.json``, so that
``transformers.PreTrainedTokenizerFast.from_pretrained(folder)`` loads it offline and encodes any
``CHARSET`` text as ``[BOS] + one id per character``.

Ids: the characters of ``CHARSET`` in order (0 .. len(CHARSET)-1), then the special tokens in
``SPECIAL_TOKENS`` order. The layout is a pure function of ``CHARSET``, so rebuilding gives the same
ids. Usage: ``python tools/demo_tokenizer.py OUT_DIR``.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python tools/demo_tokenizer.py` from a source checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flash_dllm.evals.problem import CHARSET

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"
MASK = "<|mdm_mask|>"
EOT = "<|eot_id|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
UNK = "<unk>"
SPECIAL_TOKENS = (BOS, EOS, MASK, EOT, START_HEADER, END_HEADER, UNK)

# LLaDA-Instruct's layout minus the BOS (the post-processor adds it when the text is encoded) and
# minus its `| trim` (content goes in verbatim, so a prompt's trailing newline survives).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content']"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def charset() -> str:
    chars = CHARSET
    if len(set(chars)) != len(chars):
        raise ValueError("CHARSET has repeated characters")
    return chars


def vocab() -> dict[str, int]:
    """token -> id of the whole vocabulary (characters first, then specials)."""
    chars = charset()
    ids = {c: i for i, c in enumerate(chars)}
    for j, tok in enumerate(SPECIAL_TOKENS):
        ids[tok] = len(chars) + j
    return ids


def token_ids() -> dict[str, int]:
    """Ids of the special tokens, by role: bos, eos, mask, eot, start_header, end_header, unk."""
    v = vocab()
    return {"bos": v[BOS], "eos": v[EOS], "mask": v[MASK], "eot": v[EOT],
            "start_header": v[START_HEADER], "end_header": v[END_HEADER], "unk": v[UNK]}


def vocab_size() -> int:
    return len(charset()) + len(SPECIAL_TOKENS)


def build_backend():
    """The `tokenizers.Tokenizer`: BPE with single-character vocab and no merges = one token per char."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    v = vocab()
    # NOTE: no normalizer and no pre-tokenizer: the whole text is one "word", which BPE splits into
    # characters and (with no merges) leaves that way, so spaces and newlines are ordinary tokens.
    # Specials sit in the model vocab too, so add_special_tokens reuses their ids.
    tk = Tokenizer(models.BPE(vocab=dict(v), merges=[],
                              unk_token=UNK, dropout=None, fuse_unk=False))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False, single_word=False,
                                      lstrip=False, rstrip=False) for t in SPECIAL_TOKENS])
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, v[BOS])])
    # Fuse joins the character tokens with nothing in between (the default would add spaces).
    tk.decoder = decoders.Fuse()
    for tok, i in v.items():
        if tk.token_to_id(tok) != i:
            raise AssertionError(f"token {tok!r} got id {tk.token_to_id(tok)}, expected {i}")
    return tk


def build_tokenizer(folder: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_backend().save(str(folder / "tokenizer.json"))
    v = vocab()
    added = {str(v[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": UNK,
        "mask_token": MASK,
        "additional_special_tokens": [EOT, START_HEADER, END_HEADER],
        "add_bos_token": True,
        "add_eos_token": False,
        # NOTE: must stay False: the clean-up would turn " ." into "." and break code/arith text.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": UNK,
               "mask_token": MASK, "additional_special_tokens": [EOT, START_HEADER, END_HEADER]}
    with open(folder / "special_tokens_map.json", "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/demo_tokenizer.py OUT_DIR")
    out = build_tokenizer(sys.argv[1])
    print(f"wrote tokenizer files to {out} (vocab {vocab_size()}, ids {token_ids()})")
