"""The checkpoint's own tokenizer and chat template, through `transformers` (never hand-rolled)."""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from flash_dllm.models.config import ModelConfig


# transformers' warning when a checkpoint's config.json names a model type it does not know
# (llada, Dream: their code is remote code, which the engine never runs); harmless here, since
# only the tokenizer is read through transformers.
_MODEL_TYPE_WARNING = "You are using a model of type"


# the mask token's text in each family's released tokenizer, tried in order when config.json names
# no mask id: LLaDA's, LLaDA2's and LLaDA-MoE's (156895), SDAR's (151669)
MASK_TOKEN_TEXTS = ("<|mdm_mask|>", "<|mask|>", "<|MASK|>")


class _DropModelTypeWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_MODEL_TYPE_WARNING)


@contextmanager
def _quiet_transformers():
    """Drop exactly that warning while the tokenizer loads; every other one still shows."""
    logger = logging.getLogger("transformers.configuration_utils")
    f = _DropModelTypeWarning()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class Tokenizer:
    """Encodes prompts exactly as the checkpoint's tokenizer does, decodes answers.

    BOS is whatever the tokenizer's own post-processor adds; special tokens written in the prompt
    text are recognised. Chat prompts are rendered with the folder's chat template first and then
    encoded like any other text, as the reference scripts do.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        with _quiet_transformers():
            self.hf = self._load(folder)
        # NOTE: the engine checks prompt + max_tokens against the model's own length and
        # answers with an error naming both; transformers' "Token indices sequence length is
        # longer than the specified maximum" warning (from tokenizer_config's model_max_length,
        # which need not be the model's) would only repeat it, or be wrong. transformers warns
        # once per tokenizer and remembers it here: mark it as already said.
        warned = getattr(self.hf, "deprecation_warnings", None)
        if isinstance(warned, dict):
            warned["sequence-length-is-longer-than-the-specified-maximum"] = True

    @staticmethod
    def _load(folder: Path):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        if (folder / "tokenizer.json").is_file():
            # NOTE: PreTrainedTokenizerFast reads tokenizer.json + tokenizer_config.json (chat
            # template, special tokens) and never needs the checkpoint's remote code.
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            from transformers import Qwen2TokenizerFast
            return Qwen2TokenizerFast.from_pretrained(str(folder), local_files_only=True)
        if not (folder / "tokenizer.model").is_file():
            # NOTE: nothing AutoTokenizer could load either; its own error ends in advice to
            # install sentencepiece or tiktoken, which is not the fix: the files are missing
            have = [n for n in ("vocab.json", "merges.txt") if (folder / n).is_file()]
            other = "merges.txt" if have == ["vocab.json"] else "vocab.json"
            lacks = (f"tokenizer.json, and {other} to go with its {have[0]}" if have
                     else "tokenizer.json (or vocab.json + merges.txt)")
            raise FileNotFoundError(f"no tokenizer in {folder}: it lacks {lacks}; copy the "
                                    "checkpoint's tokenizer files into it")
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                 trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - rewrap with the folder named
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FileNotFoundError(f"no usable tokenizer in {folder} (expected tokenizer.json, "
                                    f"or vocab.json + merges.txt; its tokenizer.model did not "
                                    f"load: {first})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text)["input_ids"])

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this checkpoint's tokenizer has no chat template "
                             "(tokenizer_config.json 'chat_template'); use a plain prompt")
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_id(self, text: str) -> int | None:
        tid = self.hf.convert_tokens_to_ids(text)
        return tid if isinstance(tid, int) and tid != self.hf.unk_token_id else None

    def resolve_ids(self, cfg: ModelConfig) -> ModelConfig:
        """Fill a mask id missing from config.json from the tokenizer (the first of
        ``MASK_TOKEN_TEXTS`` it has, else its declared mask token), add its EOS."""
        from dataclasses import replace

        from flash_dllm.models.family import as_id_tuple

        mask = cfg.mask_token_id
        if mask is None:
            # NOTE: LLaDA2's config.json names no mask id (its generate() takes one); the
            # tokenizer's declared mask token is the next authority after LLaDA's text
            for text in MASK_TOKEN_TEXTS:
                mask = self.token_id(text)
                if mask is not None:
                    break
            declared = self.hf.special_tokens_map.get("mask_token")
            if mask is None and isinstance(declared, str):
                mask = self.token_id(declared)
            if mask is None:
                raise ValueError("config.json has no mask_token_id and the tokenizer has none "
                                 f"of {', '.join(MASK_TOKEN_TEXTS)} nor a mask_token: cannot "
                                 "tell which id is MASK")
        eos = as_id_tuple(cfg.eos_token_ids, self.hf.eos_token_id)
        return replace(cfg, mask_token_id=mask, eos_token_ids=eos)
