"""``LLM``: the offline Python API (load a checkpoint folder, generate, chat)."""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.core.request import RequestOutput
from flash_dllm.engine.engine import run_to_completion
from flash_dllm.entrypoints.args import EngineArgs
from flash_dllm.entrypoints.loader import close_engine, load_engine


class LLM:
    """Load a diffusion LLM from a local Hugging Face folder and generate with it.

    >>> llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    >>> outs = llm.generate(["prompt a", "prompt b"], SamplingParams(max_tokens=64))

    ``dtype="auto"`` (the default): bfloat16 on a GPU, float32 on the CPU.
    ``tensor_parallel_size=N`` splits the model over N GPUs (``device="cuda"``; rank r on cuda:r)
    or N CPU processes: the other ranks are worker processes started here and stopped by
    ``close()`` (or ``with LLM(...) as llm:``, or at exit).
    """

    def __init__(self, model: str | os.PathLike | None = None, device: str = "cpu",
                 dtype: str = "auto", max_num_seqs: int | None = None,
                 engine_config: EngineConfig | None = None,
                 tensor_parallel_size: int = 1) -> None:
        override = {} if engine_config is None else dataclasses.asdict(engine_config)
        if max_num_seqs is not None:
            override["max_num_seqs"] = max_num_seqs
        loaded = load_engine(EngineArgs(model=None if model is None else str(model),
                                        device=device, dtype=dtype,
                                        tensor_parallel_size=tensor_parallel_size), **override)
        self.engine, self.tokenizer, self.model_path = (loaded.engine, loaded.tokenizer,
                                                        loaded.folder)
        self.device = self.engine.device
        self.cfg = self.engine.cfg

    # ------------------------------------------------------------------------------------ public
    def close(self) -> None:
        """Stop the other tensor-parallel ranks (idempotent; also at interpreter exit)."""
        close_engine(self.engine)

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

    # ---------------------------------------------------------------------------------- internal
    def _run(self, encoded: list[tuple[str | None, list[int]]], params, use_tqdm: bool,
             on_step=None):
        if params is None:
            params = SamplingParams()
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
