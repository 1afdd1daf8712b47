"""``LLM``: the offline Python API (load a checkpoint folder, generate, chat)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import torch

from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.engine import Engine
from flash_dllm.engine.request import RequestOutput
from flash_dllm.models.loader import load_model
from flash_dllm.models.tokenizer import Tokenizer

DEMO_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"


def default_model_path() -> Path:
    """The small checkpoint shipped inside the package."""
    if not (DEMO_MODEL / "config.json").is_file():
        raise FileNotFoundError(f"no model given and the shipped demo checkpoint is missing at "
                                f"{DEMO_MODEL}; pass a checkpoint folder")
    return DEMO_MODEL


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda[:N]' or 'auto', got {device!r}")
    return dev


class LLM:
    """Load a diffusion LLM from a local Hugging Face folder and generate with it.

    >>> llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    >>> outs = llm.generate(["prompt a", "prompt b"], SamplingParams(max_tokens=64))
    """

    def __init__(self, model: str | os.PathLike | None = None, device: str = "cpu",
                 dtype: str = "float32", max_num_seqs: int | None = None,
                 engine_config: EngineConfig | None = None) -> None:
        folder = Path(model) if model is not None else default_model_path()
        self.model_path = folder
        self.device = resolve_device(device)
        net, cfg = load_model(folder, device=self.device, dtype=dtype)
        self.tokenizer = Tokenizer(folder)
        cfg = self.tokenizer.resolve_ids(cfg)
        self.cfg = cfg
        config = engine_config or EngineConfig()
        if max_num_seqs is not None:
            config = dataclasses.replace(config, max_num_seqs=max_num_seqs)
        self.engine = Engine(net, cfg, config, decode_text=self.tokenizer.decode)

    # ------------------------------------------------------------------------------------ public
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a batch. Prompts are text or lists of token ids; all run
        together (continuous batching) and outputs come back in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p))
                   for p in prompts]
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (with the assistant prompt) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv)
            encoded.append((text, self.tokenizer.encode(text)))
        return self._run(encoded, params, use_tqdm)

    # ---------------------------------------------------------------------------------- internal
    def _run(self, encoded: list[tuple[str | None, list[int]]], params, use_tqdm: bool):
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
        pending = {id(r) for r in reqs}
        while pending:
            for r in self.engine.step():
                if id(r) in pending:
                    pending.discard(id(r))
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [self.engine.output(r) for r in reqs]
