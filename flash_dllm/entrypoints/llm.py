"""``LLM``: the offline Python API (load a checkpoint folder, generate, chat, logits)."""
from __future__ import annotations

import dataclasses
import numbers
import os
from typing import Sequence

import torch

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import RequestOutput
from flash_dllm.defaults import SamplingDefaults
from flash_dllm.engine.engine import Engine, run_to_completion
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.loader import (close_engine, load_engine, report_weights,
                                          tensor_parallel_world)
from flash_dllm.layers.attention import block_causal
from flash_dllm.entrypoints.calibration import calibrate_as_configured
from flash_dllm.layers.quant import quantize_as_configured
from flash_dllm.models.loader import load_model, model_path, read_config, resolve_device
from flash_dllm.models.tokenizer import Tokenizer


class LLM:
    """Load a diffusion LLM from a local Hugging Face folder and generate with it.

    >>> llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    >>> outs = llm.generate(["prompt a", "prompt b"], SamplingParams(max_tokens=64))

    ``dtype="auto"`` (the default): bfloat16 on a GPU, float32 on the CPU.
    ``generate`` / ``chat`` without params decode with ``sampling_params()``: the knobs of
    ``sampling_defaults`` (a dict, a layer of your own), then the checkpoint's
    ``generation_config.json``, then the recommended defaults (threshold 0.99 with the family's
    fast cache; ``flash_dllm.defaults``). A ``SamplingParams`` you build yourself is the whole
    request: its fields left out are ``SamplingParams``' own defaults (the recommended ones).
    ``tensor_parallel_size=N`` splits the model over N GPUs (``device="cuda"``; rank r on cuda:r)
    or N CPU processes: the other ranks are worker processes started here and stopped by
    ``close()`` (or ``with LLM(...) as llm:``, or at exit). ``deterministic=True``
    (``EngineConfig.deterministic``): a request's answer does not depend on what else runs or
    is cached (docs/serving.md#same-answer-under-load). ``quantization="fp8" | "int8" | "int4"``
    (``EngineConfig.quantization``, with ``quantization_group_size``; ``quantize_lm_head``: the
    LM head too): the weights quantized at load (``flash_dllm/layers/quant.py``);
    ``quantization_calibration`` (int8 / int4): their codes fitted by GPTQ on those samples
    first (``flash_dllm/entrypoints/calibration.py``).

    NOTE: a model the paged engine cannot run (``ModelConfig.paged_unsupported`` says why) loads
    without an engine: ``logits`` works through the dense forward, while ``generate`` / ``chat``
    / ``engine`` raise that reason. Every other model builds its engine here, as before.
    """

    def __init__(self, model: str | os.PathLike | None = None, device: str = "cpu",
                 dtype: str = "auto", max_num_seqs: int | None = None,
                 engine_config: EngineConfig | None = None,
                 tensor_parallel_size: int = 1,
                 sampling_defaults: dict | None = None,
                 deterministic: bool | None = None, quantization: str | None = None,
                 quantization_group_size: int | None = None,
                 quantize_lm_head: bool | None = None,
                 quantization_calibration: str | None = None,
                 quantization_calibration_samples: int | None = None) -> None:
        override = {} if engine_config is None else dataclasses.asdict(engine_config)
        for name, value in (("max_num_seqs", max_num_seqs), ("deterministic", deterministic),
                            ("quantization", quantization),
                            ("quantization_group_size", quantization_group_size),
                            ("quantize_lm_head", quantize_lm_head),
                            ("quantization_calibration", quantization_calibration),
                            ("quantization_calibration_samples",
                             quantization_calibration_samples)):
            if value is not None:
                override[name] = value
        args = EngineArgs(model=None if model is None else str(model), device=device,
                          dtype=dtype, tensor_parallel_size=tensor_parallel_size)
        self._engine: Engine | None = None
        self._no_engine: str | None = None          # why there is no engine (dense only)
        if tensor_parallel_world(args) == 1:
            folder = model_path(args.model)
            self._no_engine = read_config(folder)[1].paged_unsupported()
        if self._no_engine is None:
            loaded = load_engine(args, **override)
            self._engine, self.tokenizer, self.model_path = (loaded.engine, loaded.tokenizer,
                                                             loaded.folder)
            self._model, self.device, self.cfg = (self._engine.model, self._engine.device,
                                                  self._engine.cfg)
            self.sampling_defaults = SamplingDefaults.of(
                sampling_defaults, self.model_path, flags_source="LLM(sampling_defaults)",
                model_block=self.cfg.attention.block_size or None)
            return
        config = args.engine_config(**override)     # bad knobs fail here, as with an engine
        self.device = resolve_device(args.device)
        self._model, cfg = load_model(folder, device=self.device, dtype=args.dtype)
        self.tokenizer, self.model_path = Tokenizer(folder), folder
        self.cfg = self.tokenizer.resolve_ids(cfg)
        calibrate_as_configured(self._model, self.tokenizer, self.cfg, config)   # GPTQ
        quant = quantize_as_configured(self._model, config)   # as the engine's runner would
        if quant is not None:
            report_weights(quant)
        self.sampling_defaults = SamplingDefaults.of(
            sampling_defaults, folder, flags_source="LLM(sampling_defaults)",
            model_block=self.cfg.attention.block_size or None)

    # ------------------------------------------------------------------------------------ public
    @property
    def engine(self) -> Engine:
        """The paged engine that ``generate`` and ``chat`` run on."""
        if self._engine is None:
            raise ValueError(f"{self._no_engine}; LLM.logits(token_ids) computes this model's "
                             "logits meanwhile")
        return self._engine

    def sampling_params(self, **fields) -> SamplingParams:
        """A request's ``SamplingParams``: ``fields`` (knobs) over this LLM's sampling defaults
        (``sampling_defaults``, the checkpoint's generation_config.json, the recommended ones).
        ``cache`` left out stays None: the engine resolves it to the family's fast cache."""
        return self.sampling_defaults.params(fields)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; also at interpreter exit)."""
        if self._engine is not None:
            close_engine(self._engine)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, on_step=None) -> list[RequestOutput]:
        """Generate for one prompt or a batch. Prompts are text or lists of token ids; all run
        together (continuous batching) and outputs come back in input order. ``on_step``: called
        with each step's ``StepOutput`` list (progress reporting)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p))
                   for p in prompts]
        return self._run(encoded, params, use_tqdm, on_step)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, on_step=None) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (with the assistant prompt) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv)
            encoded.append((text, self.tokenizer.encode(text)))
        return self._run(encoded, params, use_tqdm, on_step)

    @torch.inference_mode()
    def logits(self, token_ids: Sequence[int] | Sequence[Sequence[int]] | torch.Tensor,
               block_length: int | None = None) -> torch.Tensor:
        """The model's logits over whole canvases, from its dense forward (every position at
        once, nothing cached): for research, scoring and parity tests.

        ``token_ids``: one canvas (a list of ids, or a 1-D tensor) -> [L, V]; a batch of canvases
        of one length (a list of lists, or a 2-D tensor) -> [B, L, V]. Row i is the prediction
        for position i (Dream's shift by one applied, as ``generate`` reads it). The logits are
        in the model's dtype, on its device.

        ``block_length``: None attends as the model does (LLaDA2: block-causal, blocks of 32;
        LLaDA, Dream: full attention); an integer attends block-causally with blocks of that many
        positions counted from position 0, whatever the model's own pattern (a block as long as
        the canvas is full attention)."""
        ids, batched = self._canvases(token_ids)
        pattern = None
        if block_length is not None:
            if not isinstance(block_length, int) or isinstance(block_length, bool) \
                    or block_length < 1:
                raise ValueError(f"block_length must be an integer >= 1 or None, got "
                                 f"{block_length!r}")
            pattern = block_causal(block_length)
        if getattr(self._model, "tp", None) is not None:   # every rank runs the forward
            out = self.engine.dense_logits(ids.to(self.device), pattern)
        else:
            out = self._model(ids.to(self.device), pattern=pattern)     # [B, L, V]
        if self.cfg.logit_shift:
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out if batched else out[0]

    # ---------------------------------------------------------------------------------- internal
    def _canvases(self, token_ids) -> tuple[torch.Tensor, bool]:
        """``token_ids`` as a [B, L] int64 tensor, checked, and whether it was a batch."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() not in (1, 2) or token_ids.is_floating_point() \
                    or token_ids.is_complex() or token_ids.dtype == torch.bool:
                raise ValueError(f"LLM.logits takes a 1-D or 2-D integer tensor of token ids, "
                                 f"got a {token_ids.dim()}-D {token_ids.dtype} tensor")
            batched = token_ids.dim() == 2
            rows = token_ids.long().reshape(-1, token_ids.shape[-1]).cpu()
        else:
            if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
                raise ValueError(f"LLM.logits takes a list of token ids or a list of such lists "
                                 f"(encode text with llm.tokenizer.encode), got "
                                 f"{type(token_ids).__name__}")
            batched = len(token_ids) > 0 and not isinstance(token_ids[0], numbers.Integral)
            canvases = list(token_ids) if batched else [token_ids]
            for b, c in enumerate(canvases):
                if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
                    raise ValueError(f"LLM.logits: canvas {b} is a {type(c).__name__}, not a "
                                     "list of token ids")
                if len(c) != len(canvases[0]):
                    raise ValueError(f"LLM.logits: the canvases of a batch must have one length, "
                                     f"got {len(canvases[0])} (canvas 0) and {len(c)} (canvas "
                                     f"{b})")
                for i, t in enumerate(c):
                    if not isinstance(t, numbers.Integral) or isinstance(t, bool):
                        raise ValueError(f"LLM.logits: token ids must be integers, got {t!r} "
                                         f"at position {i} of canvas {b}")
            rows = torch.tensor([[int(t) for t in c] for c in canvases], dtype=torch.long)
        B, L = rows.shape
        if B == 0 or L == 0:
            raise ValueError("LLM.logits needs at least one canvas of at least one token")
        if L > self.cfg.max_position:
            raise ValueError(f"LLM.logits: a canvas of {L} tokens exceeds the model's maximum "
                             f"length of {self.cfg.max_position} positions")
        bad = (rows < 0) | (rows >= self.cfg.vocab_size)
        if bad.any():
            b, i = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"LLM.logits: token id {int(rows[b, i])} at position {i} of canvas "
                             f"{b} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return rows, batched

    def _run(self, encoded: list[tuple[str | None, list[int]]], params, use_tqdm: bool,
             on_step=None):
        if params is None:
            params = self.sampling_params()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(plist) != len(encoded):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(encoded)} prompts")
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
        # validate everything before queueing anything, so a bad prompt never strands the rest
        for (_, ids), p in zip(encoded, plist):
            self.engine.validate(ids, p)
        reqs = [self.engine.add_request(ids, p, prompt=text) for (text, ids), p in zip(encoded, plist)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(reqs), desc="generating", unit="req")
        try:
            run_to_completion(self.engine, reqs, None if bar is None else lambda _: bar.update(1),
                              on_step)
        finally:
            if bar is not None:
                bar.close()
        outs = [self.engine.output(r) for r in reqs]
        for o in outs:                   # detokenised once, here, off any engine thread
            o.text = self.tokenizer.decode(o.token_ids)
        return outs
