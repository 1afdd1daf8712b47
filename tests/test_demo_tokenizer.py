"""The demo checkpoint's character-level tokenizer (tools/demo_tokenizer.py), through transformers."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

from flash_dllm.evals.problem import CHARSET

_ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("demo_tokenizer", _ROOT / "tools" / "demo_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("demo_tokenizer", mod)
    spec.loader.exec_module(mod)
    return mod


dt = _load_tool()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return dt.build_tokenizer(tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def test_files_written(folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (folder / name).is_file(), name
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["clean_up_tokenization_spaces"] is False
    assert "bos_token" not in cfg["chat_template"]


def test_layout_is_deterministic(tmp_path, folder):
    again = dt.build_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


def test_special_ids(tok):
    ids = dt.token_ids()
    assert len(tok) == dt.vocab_size() == len(CHARSET) + len(dt.SPECIAL_TOKENS)
    assert tok.bos_token_id == ids["bos"] and tok.convert_tokens_to_ids(dt.BOS) == ids["bos"]
    assert tok.eos_token_id == ids["eos"] == tok.pad_token_id
    assert tok.convert_tokens_to_ids(dt.MASK) == ids["mask"]
    assert tok.convert_tokens_to_ids(dt.EOT) == ids["eot"]
    assert tok.unk_token_id == ids["unk"]
    assert len(set(ids.values())) == len(ids)


def test_one_token_per_char_with_bos(tok):
    v = dt.vocab()
    for c in CHARSET:
        assert tok(c)["input_ids"] == [tok.bos_token_id, v[c]], repr(c)
    text = CHARSET + CHARSET[::-1]
    assert tok(text)["input_ids"] == [tok.bos_token_id] + [v[c] for c in text]
    assert tok("")["input_ids"] == [tok.bos_token_id]
    assert tok("abc", add_special_tokens=False)["input_ids"] == [v["a"], v["b"], v["c"]]


@pytest.mark.parametrize("text", [
    "def add_k(xs):\n    return [x + 3 for x in xs]",
    "12+7=19. 19-3=16. #### 16",
    "  leading and trailing  \n\n\n",
    " . , ! ? ' \" ( ) [ ] { }",
    "a  b   c\n    d\n        e",
])
def test_roundtrip_examples(tok, text):
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_roundtrip_random_charset_text(tok):
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(CHARSET) for _ in range(rng.randint(0, 120)))
        ids = tok(text)["input_ids"]
        assert len(ids) == len(text) + 1
        assert tok.decode(ids, skip_special_tokens=True) == text
    batch = ["x = 1\n", "  y", "#### 42"]
    assert [tok.decode(i, skip_special_tokens=True) for i in tok(batch)["input_ids"]] == batch


def test_special_tokens_in_text_are_single_tokens(tok):
    ids = dt.token_ids()
    v = dt.vocab()
    got = tok("a<|mdm_mask|>b<|eot_id|><|endoftext|>")["input_ids"]
    assert got == [ids["bos"], v["a"], ids["mask"], v["b"], ids["eot"], ids["eos"]]
    # skip_special_tokens drops them all, keeps the characters
    assert tok.decode(got, skip_special_tokens=True) == "ab"
    # a lone "<" or "|" is an ordinary character
    assert tok("<|x|>")["input_ids"] == [ids["bos"]] + [v[c] for c in "<|x|>"]


def test_unknown_char_is_unk(tok):
    assert tok("\t")["input_ids"] == [tok.bos_token_id, tok.unk_token_id]


def test_chat_template(tok):
    q = "Ann has 3 pens. How many?\n"
    text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|start_header_id|>user<|end_header_id|>\n\n" + q
                    + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    ids_ = dt.token_ids()
    assert ids[1] == ids_["start_header"] and ids[-3] == ids_["end_header"]
    assert ids.count(ids_["eot"]) == 1
    no_gen = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=False,
                                     tokenize=False)
    assert no_gen.endswith("<|eot_id|>")
    multi = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c"}], add_generation_prompt=True, tokenize=False)
    assert multi.count("<|eot_id|>") == 3 and multi.endswith("assistant<|end_header_id|>\n\n")


def test_engine_tokenizer_wrapper(folder):
    from flash_dllm.models.tokenizer import Tokenizer
    t = Tokenizer(folder)
    text = "def f(x):\n    return x * 2"
    assert t.encode(text)[0] == dt.token_ids()["bos"]
    assert t.decode(t.encode(text)) == text
    assert t.token_id("<|mdm_mask|>") == dt.token_ids()["mask"]
    assert t.encode_chat([{"role": "user", "content": "hi"}])[-1] == dt.vocab()["\n"]


def test_training_batches_encode_like_the_engine(folder, tok):
    """tools/train_demo.py builds its token pool with this tokenizer exactly as the engine encodes."""
    import torch

    spec = importlib.util.spec_from_file_location("train_demo", _ROOT / "tools" / "train_demo.py")
    td = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(td)
    from flash_dllm.models.tokenizer import Tokenizer

    engine = Tokenizer(folder)
    prompts = ["Ann has 3 pens. How many?\n", "Write a Python function f(xs) that sums xs.\n"]
    assert td.chat_texts(tok, prompts) == [engine.apply_chat_template(
        [{"role": "user", "content": p}]) for p in prompts]

    ids = dt.token_ids()
    pool = td.Pool(["arith", "code"], 40, 0, str(folder), ids["eos"], torch.device("cpu"), workers=1)
    assert pool.n == 80
    gen = torch.Generator().manual_seed(0)
    noisy, key_mask, target, weight = td.make_batch(pool, 16, 64, 0.5, ids["eos"], ids["mask"],
                                                    1e-3, gen, torch.device("cpu"))
    for i in range(16):
        row = target[i][key_mask[i]].tolist()
        assert len(row) == int(key_mask[i].sum())
        # the prompt part is exactly the engine's encoding (plain or chat), the gen region is 64 long
        text = tok.decode(row, skip_special_tokens=False)
        assert row[0] == ids["bos"]
        body = row[:len(row) - 64]
        prompt_text = tok.decode(body, skip_special_tokens=False)
        if prompt_text.startswith("<|startoftext|><|start_header_id|>"):
            inner = prompt_text[len("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n"):]
            inner = inner[:-len("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")]
            assert engine.encode_chat([{"role": "user", "content": inner}]) == body
        else:
            assert engine.encode(prompt_text[len("<|startoftext|>"):]) == body
        region = row[len(body):]
        answer = tok.decode(region, skip_special_tokens=True)
        assert region[len(answer):] == [ids["eos"]] * (64 - len(answer)), text
        # only the generated region is ever masked, and weights sit exactly on masked slots
        masked = noisy[i] == ids["mask"]
        assert not masked[:len(body)].any()
        assert torch.equal(weight[i] > 0, masked)
