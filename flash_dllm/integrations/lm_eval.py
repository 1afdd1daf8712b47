"""``flash-dllm`` as an lm-evaluation-harness model: GSM8K, HumanEval, ... as the field runs them.

    python -m flash_dllm.integrations.lm_eval --model flash-dllm \\
        --model_args pretrained=DIR,device=cuda,dtype=bfloat16,gen_length=256,block_length=32,\\
decode=threshold,threshold=0.9,cache=dual --tasks gsm8k --num_fewshot 5

lm-eval 0.4.x has no plugin discovery for models (``--include_path`` finds tasks, not models), so
the class is registered when this module is imported: the ``-m`` wrapper above imports it and then
runs lm-eval's own command line; in Python, ``import flash_dllm.integrations.lm_eval`` and then
``lm_eval.simple_evaluate(model="flash-dllm", ...)`` (or pass a ``FlashDLLM`` instance).

- ``generate_until``: every request in one ``LLM.generate`` call (one continuous batch); the text
  is cut at the first ``until`` string, as the server cuts at stop strings.
- ``loglikelihood``: LLaDA's Monte-Carlo estimate of the masked-diffusion likelihood bound (see
  ``_mask_plan``), batched over samples and requests; ``is_greedy`` from one all-masked forward.
- ``loglikelihood_rolling`` (perplexity tasks) is not supported.
"""
from __future__ import annotations

import logging
import math
import sys
import zlib
from dataclasses import fields

import torch
import torch.nn.functional as F

from flash_dllm.config import DEFAULT_BLOCK_LENGTH, EngineConfig, SamplingParams
from flash_dllm.entrypoints.args import AUTO_GPU_MEMORY_UTILIZATION
from flash_dllm.entrypoints.llm import LLM
from flash_dllm.layers.attention import DenseContext
from flash_dllm.server.stops import find_stop

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("flash_dllm.integrations.lm_eval needs lm-evaluation-harness: "
                      "pip install lm-eval (it is in flash-dllm's 'dev' extra)") from e

log = logging.getLogger(__name__)

MODEL_NAME = "flash-dllm"
DEFAULT_MAX_GEN_TOKS = 256      # lm-eval's default when a task sets no max_gen_toks
_SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))
_ENGINE_KEYS = frozenset(f.name for f in fields(EngineConfig))
# lm-eval hands these to every model's constructor (``--batch_size`` defaults to 1). The engine
# batches continuously up to ``max_num_seqs`` and the likelihood forwards by ``mc_batch_size``,
# so they are accepted and not used.
_HARNESS_KEYS = frozenset({"batch_size", "max_batch_size"})
_MAX_TOKEN_ALIASES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
_GEN_KEYS = frozenset({"until", "do_sample", "temperature", "top_p", "top_k", "seed",
                       *_MAX_TOKEN_ALIASES})


def _register(cls):
    # NOTE: ``python -m flash_dllm.integrations.lm_eval`` runs this file as ``__main__`` and then
    # imports it under its own name (``main``); registering both classes would collide.
    return cls if __name__ == "__main__" else register_model(MODEL_NAME)(cls)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@_register
class FlashDLLM(LM):
    """lm-eval model over ``flash_dllm.LLM``.

    ``model_args``: ``pretrained`` (checkpoint folder; default the shipped demo model),
    ``device`` (a CUDA device without CUDA falls back to the CPU, as lm-eval's HF model does),
    ``dtype`` (default bfloat16 on CUDA, float32 on the CPU), any ``EngineConfig`` field
    (``max_num_seqs``, ``kv_cache_gb``, ``gpu_memory_utilization``: 0.8 on CUDA unless a KV
    size is given, ...), any ``SamplingParams`` field (``gen_length`` is an alias of
    ``max_tokens``), ``mc_num`` / ``mc_batch_size`` (likelihood samples per request / rows per
    forward). An unknown key is an error. ``llm`` (Python only) reuses a loaded ``LLM``.
    """

    def __init__(self, pretrained: str | None = None, device: str = "cpu",
                 dtype: str | None = None, mc_num: int = 128, mc_batch_size: int = 32,
                 llm: LLM | None = None, **kwargs) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - _SAMPLING_KEYS - _ENGINE_KEYS - _HARNESS_KEYS
                         - {"gen_length"})
        if unknown:
            known = sorted({"pretrained", "device", "dtype", "mc_num", "mc_batch_size",
                            "gen_length", *_SAMPLING_KEYS, *_ENGINE_KEYS})
            raise ValueError(f"unknown {MODEL_NAME} model_args key(s) {unknown}; known: {known}")
        self.mc_num = _positive_int("mc_num", mc_num)
        self.mc_batch_size = _positive_int("mc_batch_size", mc_batch_size)
        if "gen_length" in kwargs and "max_tokens" in kwargs:
            raise ValueError("give gen_length or max_tokens (the same knob), not both")
        if "gen_length" in kwargs:
            kwargs["max_tokens"] = kwargs.pop("gen_length")
        sampling = {k: v for k, v in kwargs.items() if k in _SAMPLING_KEYS}
        engine = {k: v for k, v in kwargs.items() if k in _ENGINE_KEYS}
        # NOTE: max_tokens, when given, caps every request's max_gen_toks (Fast-dLLM / LLaDA run
        # lm-eval with one gen_length for every task); otherwise each request's max_gen_toks
        # (default 256) sets its canvas.
        self._cap = sampling.pop("max_tokens", None)
        if self._cap is not None:
            _positive_int("max_tokens (gen_length)", self._cap)
        self._block_length = sampling.pop("block_length", None)
        steps = sampling.pop("steps", None)
        self._sampling = sampling
        # validate every sampling knob now, on the nominal canvas (the cap or 256, rounded up to
        # whole blocks); ``steps`` counts over that canvas and scales with each request's blocks
        n = self._cap or DEFAULT_MAX_GEN_TOKS
        bl = self._block_length or min(DEFAULT_BLOCK_LENGTH, n)
        nominal = SamplingParams(**sampling, max_tokens=-(-n // bl) * bl, block_length=bl,
                                 steps=steps)
        self._steps_per_block = None if steps is None else nominal.steps_per_block

        if llm is not None:
            if not isinstance(llm, LLM):
                raise TypeError(f"llm must be a flash_dllm.LLM, got {type(llm).__name__}")
            if engine or pretrained is not None:
                raise ValueError("llm= reuses a loaded model: pass no pretrained or engine knobs")
            self.llm = llm
        else:
            from flash_dllm.models.loader import resolve_device
            if str(device).startswith("cuda") and not torch.cuda.is_available():
                # as lm-eval's own HF model does: its command line passes --device cuda:0 unless
                # told otherwise
                log.warning("%s: CUDA is not available, running on the CPU (pass --device cpu "
                            "to silence this)", MODEL_NAME)
                device = "cpu"
            dev = resolve_device(device)
            if dtype is None:
                dtype = "bfloat16" if dev.type == "cuda" else "float32"
            if dev.type == "cuda" and not {"kv_cache_gb", "num_kv_pages",
                                           "gpu_memory_utilization"} & set(engine):
                # EngineConfig's 1 GiB holds ~2k tokens of an 8B model; leave room for the
                # likelihood forwards, which run outside the KV pool
                engine["gpu_memory_utilization"] = AUTO_GPU_MEMORY_UTILIZATION
            self.llm = LLM(pretrained, device=str(dev), dtype=dtype,
                           engine_config=EngineConfig(**engine))
        self.tokenizer = self.llm.tokenizer
        self.cfg = self.llm.cfg
        grid = self.cfg.attention.block_size
        if grid and self._block_length is None:
            # NOTE: a block-causal model runs its own block only (SDAR's 4, LLaDA2's 32)
            self._block_length = grid
            if steps is not None:
                self._steps_per_block = SamplingParams(
                    **sampling, max_tokens=-(-n // grid) * grid, block_length=grid,
                    steps=steps).steps_per_block
        self.model = self.llm.engine.model
        self._device = self.llm.device
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------ lm-eval API
    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.model_path)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer.hf, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.hf.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params, plans = [], [], []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            until, n, p = self._params_for(gen_kwargs, i)
            ids = self.tokenizer.encode(context)
            room = self.cfg.max_position - p.max_tokens
            if room < 1:
                raise ValueError(f"max_gen_toks canvas {p.max_tokens} leaves no room for a prompt "
                                 f"in the model's {self.cfg.max_position} positions")
            if len(ids) > room:
                self._warn_once("truncate", f"prompt of {len(ids)} tokens + canvas "
                                f"{p.max_tokens} exceeds {self.cfg.max_position} positions: "
                                "keeping the prompt's last tokens")
                ids = ids[-room:]
            prompts.append(ids)
            params.append(p)
            plans.append((until, n))
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm) if prompts else []
        texts = []
        for req, out, (until, n) in zip(requests, outs, plans):
            # NOTE: the canvas is max_gen_toks rounded up to whole blocks; what lies past
            # max_gen_toks is cut here, before the stop strings are looked for
            text = self.tokenizer.decode(out.token_ids[:n])
            stop = find_stop(text, until) if until else -1
            if stop >= 0:
                text = text[:stop]
            texts.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        items = [self._encode_pair(*req.args) for req in requests]
        results = self._score(items, disable_tqdm)
        for req, res in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            f"{MODEL_NAME}: loglikelihood_rolling (perplexity tasks such as wikitext) is not "
            "supported: a diffusion LM gives a Monte-Carlo bound on a continuation's likelihood, "
            "not token-by-token rolling likelihoods. Use generate_until or multiple-choice tasks.")

    # ------------------------------------------------------------------------------- generation
    def _params_for(self, gen_kwargs: dict | None, index: int):
        """(until strings, max tokens to keep, SamplingParams) for one generate_until request."""
        gk = dict(gen_kwargs or {})
        until = gk.pop("until", None)
        until = [] if until is None else [until] if isinstance(until, str) else list(until)
        if not all(isinstance(s, str) for s in until):
            raise ValueError(f"until must be a string or a list of strings, got {until!r}")
        until = [s for s in until if s]
        given = [gk.pop(k) for k in _MAX_TOKEN_ALIASES if gk.get(k) is not None]
        for k in _MAX_TOKEN_ALIASES:
            gk.pop(k, None)
        n = _positive_int("max_gen_toks", int(given[0]) if given else DEFAULT_MAX_GEN_TOKS)
        if self._cap is not None:
            n = min(n, self._cap)
        do_sample, temp = gk.pop("do_sample", None), gk.pop("temperature", None)
        knobs = dict(self._sampling)
        if do_sample is False:
            knobs["temperature"] = 0.0
        elif temp is not None:
            knobs["temperature"] = float(temp)
        elif do_sample:                       # sampling asked for, no temperature: HF's 1.0
            knobs["temperature"] = knobs.get("temperature") or 1.0
        for k in ("top_p", "top_k", "seed"):
            if gk.get(k) is not None:
                knobs[k] = gk.pop(k)
        if gk:
            self._warn_once("gen_kwargs", f"ignoring generation kwargs {sorted(gk)} "
                            f"(understood: {sorted(_GEN_KEYS)})")
        if knobs.get("temperature", 0.0) > 0 and knobs.get("seed") is not None:
            knobs["seed"] = int(knobs["seed"]) + index    # repeats of one prompt differ
        # NOTE: a canvas is whole blocks: max_gen_toks rounds up to the block length (the
        # surplus is cut after decoding); steps keep the nominal steps per block
        bl = self._block_length or min(DEFAULT_BLOCK_LENGTH, n)
        blocks = -(-n // bl)
        steps = None if self._steps_per_block is None else min(self._steps_per_block, bl) * blocks
        return until, n, SamplingParams(**knobs, max_tokens=blocks * bl, block_length=bl,
                                        steps=steps)

    # ------------------------------------------------------------------------------- likelihood
    def _encode_pair(self, context: str, continuation: str):
        # trailing spaces of the context belong to the continuation (as lm-eval's HF model does)
        strip = len(context) - len(context.rstrip(" "))
        if strip:
            context, continuation = context[:-strip], context[-strip:] + continuation
        ctx = self.tokenizer.encode(context)
        cont = self.tokenizer.encode(context + continuation)[len(ctx):]
        if self.cfg.logit_shift and not ctx:
            # Dream reads slot i from output i - 1: the first scored slot needs one before it
            start = self.cfg.bos_token_id
            ctx = [self.cfg.eos_token_ids[0] if start is None else start]
        return ctx, cont, zlib.crc32(context.encode("utf-8"))

    def _mask_plan(self, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which continuation slots each likelihood row masks ([R, T] bool) and its weight ([R]).

        The quantity is LLaDA's bound: log p(c | x) >= -E_m E_S[(T/m) sum_{i in S} CE_i] with
        m uniform in 1..T, S a uniform m-subset of the T slots, CE_i the cross-entropy of slot i
        when the slots in S are MASK (context never masked). LLaDA estimates it with mc_num rows
        whose m are spread evenly over 1..T from a random start (stratified: each row's m is
        still uniform, the spread lowers the variance), each row weighted (T/m)/mc_num. When all
        2^T - 1 subsets fit in mc_num rows they are enumerated instead, with weight
        1/(m C(T, m)): the exact value of the same bound, at no more cost.
        """
        if T <= 20 and 2 ** T - 1 <= self.mc_num:
            codes = torch.arange(1, 2 ** T)
            masks = (codes[:, None] >> torch.arange(T)) & 1 == 1        # [2^T - 1, T]
            m = masks.sum(1)
            comb = torch.tensor([math.comb(T, int(k)) for k in m], dtype=torch.float64)
            return masks, 1.0 / (m.double() * comb)
        n = self.mc_num
        g = torch.Generator().manual_seed(seed)
        start = int(torch.randint(T, (), generator=g))
        m = (start + torch.arange(n) * T // n) % T + 1                   # [n], each uniform in 1..T
        rank = torch.rand(n, T, generator=g).argsort(1)                  # a random order per row
        return rank < m[:, None], T / (m.double() * n)

    @torch.inference_mode()
    def _score(self, items, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(log-likelihood estimate, is_greedy) per (context ids, continuation ids, seed)."""
        mask_id, shift, limit = self.cfg.mask_token_id, self.cfg.logit_shift, self.cfg.max_position
        seqs, plans = [], []
        for ctx, cont, h in items:
            if len(cont) + shift > limit:
                raise ValueError(f"continuation of {len(cont)} tokens exceeds the model's "
                                 f"{limit} positions")
            if len(ctx) + len(cont) > limit:
                self._warn_once("truncate", f"context + continuation exceed {limit} positions: "
                                "keeping the context's last tokens")
                ctx = ctx[len(ctx) + len(cont) - limit:]
            seqs.append((torch.tensor(ctx + cont), len(ctx)))
            T = len(cont)
            if T == 0:
                plans.append(None)
                continue
            masks, w = self._mask_plan(T, (h + 1_000_003 * int(self._sampling.get("seed") or 0))
                                       % 2 ** 63)
            # NOTE: is_greedy is one forward with the whole continuation masked, its argmax at
            # every slot compared with the continuation: an approximation of greedy decoding
            # (LLaDA checks by decoding the continuation one token per step)
            plans.append((torch.cat([masks, torch.ones(1, T, dtype=torch.bool)]),
                          torch.cat([w, w.new_zeros(1)])))
        logp = [0.0] * len(items)
        greedy = [True] * len(items)
        # rows of all requests, longest sequences first, mc_batch_size rows per forward
        order = sorted((i for i, p in enumerate(plans) if p is not None),
                       key=lambda i: -len(seqs[i][0]))
        rows = [(i, r) for i in order for r in range(plans[i][0].shape[0])]
        batches = [rows[s:s + self.mc_batch_size] for s in range(0, len(rows), self.mc_batch_size)]
        if not disable_tqdm and batches:
            from tqdm import tqdm
            batches = tqdm(batches, desc="loglikelihood forwards")
        dev = self.llm.device
        for batch in batches:
            B, L = len(batch), max(len(seqs[i][0]) for i, _ in batch)
            x = torch.full((B, L), mask_id, dtype=torch.long)               # [B, L]
            key_mask = torch.zeros(B, L, dtype=torch.bool)
            slot_mask = torch.zeros(B, L, dtype=torch.bool)                 # masked continuation
            for b, (i, r) in enumerate(batch):
                ids, P = seqs[i]
                x[b, :len(ids)] = ids
                key_mask[b, :len(ids)] = True
                slot_mask[b, P:len(ids)] = plans[i][0][r]
            target = x.clone()
            x[slot_mask] = mask_id
            h = self.model.hidden(x.to(dev), torch.arange(L, device=dev),
                                  DenseContext(None if key_mask.all() else key_mask.to(dev)))
            rb, pos = slot_mask.nonzero(as_tuple=True)                       # [N], [N]
            tgt = target[rb, pos].to(dev)
            ce = torch.empty(len(rb), device=dev)
            hit = torch.empty(len(rb), dtype=torch.bool, device=dev)
            for s in range(0, len(rb), 4096):        # LM head in chunks: [4096, vocab] at most
                lg = self.model.logits(h[rb[s:s + 4096].to(dev), (pos[s:s + 4096] - shift).to(dev)])
                lg = lg.float()
                ce[s:s + 4096] = F.cross_entropy(lg, tgt[s:s + 4096], reduction="none")
                lg[:, mask_id] = -float("inf")       # MASK is never a prediction
                hit[s:s + 4096] = lg.argmax(-1) == tgt[s:s + 4096]
            row_ce = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(
                0, rb.to(dev), ce.double()).cpu()
            row_miss = torch.zeros(B, dtype=torch.long, device=dev).index_add_(
                0, rb.to(dev), (~hit).long()).cpu()
            for b, (i, r) in enumerate(batch):
                weight = float(plans[i][1][r])
                if r == plans[i][0].shape[0] - 1:     # the all-masked row
                    greedy[i] = int(row_miss[b]) == 0
                else:
                    logp[i] -= weight * float(row_ce[b])
        return list(zip(logp, greedy))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s: %s", MODEL_NAME, message)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line with the ``flash-dllm`` model registered."""
    import importlib

    importlib.import_module("flash_dllm.integrations.lm_eval")   # registers (see _register)
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
