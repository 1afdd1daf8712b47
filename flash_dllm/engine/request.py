"""A request's canvas and its progress through blocks and denoising steps."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flash_dllm.config import SamplingParams
from flash_dllm.decoding.schedule import num_transfer_tokens
from flash_dllm.engine.verify_step import new_counters


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]            # generated ids up to (not including) the first end-of-answer id
    num_forwards: int               # model forwards that included this request
    finish_reason: str | None       # "stop" (end-of-answer id), "length" (canvas full), "abort"
    finished: bool
    early_stopped: bool = False     # finished before the last block because an answer had ended
    metrics: dict = field(default_factory=dict)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.num_forwards if self.num_forwards else 0.0


class Request:
    """Engine-side state. The canvas is ``prompt + max_tokens * [MASK]``; ``block`` is the active
    block; ``first_step`` means the next forward is the block's first (full refresh)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, mask_id: int,
                 stop_ids: tuple[int, ...], device: torch.device, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.mask_id = mask_id
        self.stop_ids = stop_ids
        self._stops = torch.tensor(stop_ids, dtype=torch.long, device=device)   # for isin()
        self.prompt_len = len(prompt_ids)
        self.canvas = torch.full((self.prompt_len + params.max_tokens,), mask_id, dtype=torch.long,
                                 device=device)
        self.canvas[:self.prompt_len] = torch.tensor(prompt_ids, dtype=torch.long, device=device)
        self.block = 0
        # NOTE: only the active block ever commits, so every block starts all MASK; the engine
        # keeps this count instead of reading the canvas back after each step
        self.num_masked = params.block_length      # MASK slots left in the active block
        self.step_in_block = 0
        self.first_step = True
        self.schedule = num_transfer_tokens(params.block_length, params.steps_per_block)
        self.kv: torch.Tensor | None = None
        self.pages: list[int] | None = None    # KV pages reserved at admission (serving ledger)
        self.arena_row: int | None = None      # the engine's canvas-arena row while running
        self.page_row: torch.Tensor | None = None  # the same page ids, int32 on the device (paged)
        # cache="flash": (the last step's mass [batch, keys], this request's row in it)
        self.mass_src: tuple[torch.Tensor, int] | None = None
        self.num_forwards = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.early_stopped = False
        self.generator: torch.Generator | None = None
        # decode="verify" and sentinels (flash_dllm.engine.verify_step)
        self.drafts: tuple[torch.Tensor, torch.Tensor] | None = None   # (slots, tokens) to verify
        self.refresh: torch.Tensor | None = None      # cached positions the next forward recomputes
        self.kv_history: torch.Tensor | None = None   # [block_length, k] last top-k keys per slot
        self.sentinel_generator: torch.Generator | None = None
        self.counters: dict = new_counters()
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def attn_mass(self) -> torch.Tensor | None:
        """cache="flash": attention mass [canvas] each key got in this request's last step."""
        if self.mass_src is None:
            return None
        mass, row = self.mass_src
        return mass[row, :self.canvas_len]

    @property
    def canvas_len(self) -> int:
        return self.canvas.shape[0]

    @property
    def block_start(self) -> int:
        return self.prompt_len + self.block * self.params.block_length

    @property
    def block_end(self) -> int:
        return self.block_start + self.params.block_length

    def transfer_count(self) -> int:
        """Tokens ``vanilla`` commits at this step of the block."""
        return self.schedule[min(self.step_in_block, len(self.schedule) - 1)]

    def advance(self, committed: int, first_token: bool) -> None:
        """Book-keeping after a step committed ``committed`` of this request's slots
        (``first_token``: the first generated slot was among them). Host-side only: the engine
        gathers these numbers for the whole batch in one device->host copy."""
        self.num_forwards += 1
        self.step_in_block += 1
        self.first_step = False
        if first_token and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.num_masked -= committed
        if self.num_masked > 0:
            return
        done_block = self.canvas[self.block_start:self.block_end]
        self.drafts = self.refresh = self.kv_history = None   # all per-block
        self.block += 1
        self.step_in_block = 0
        self.first_step = True
        self.num_masked = self.params.block_length
        last = self.block == self.params.num_blocks
        # a host sync, once per block and only when its answer matters
        ended = self.params.early_stop and not last and bool(
            torch.isin(done_block, self._stops).any())
        if last:
            self._finish("stop" if self._has_stop() else "length")
        elif ended and self.params.early_stop:
            # NOTE: blocks are final once complete and decoded left to right, so nothing after an
            # end-of-answer id can change the answer: stopping here loses nothing.
            self.early_stopped = True
            self._finish("stop")

    def _has_stop(self) -> bool:
        return bool(torch.isin(self.canvas[self.prompt_len:], self._stops).any())

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        self.kv = self.page_row = self.mass_src = None

    def abort(self) -> None:
        self._finish("abort")

    def generated_ids(self) -> list[int]:
        """Committed answer ids: the left-contiguous committed prefix of the generated region, cut at
        the first end-of-answer id. Emitted text built from it never changes."""
        gen = self.canvas[self.prompt_len:]
        ends = (gen == self.mask_id) | torch.isin(gen, self._stops)   # [max_tokens]
        # argmax of a bool row is its first True; an all-False row means the whole region counts
        n = int(ends.to(torch.uint8).argmax()) if bool(ends.any()) else gen.numel()
        return gen[:n].tolist()

    def answer_complete(self) -> bool:
        """True once the committed prefix can grow no further (an end-of-answer id was committed
        right after it, or the canvas is full)."""
        n = len(self.generated_ids())
        return n == self.params.max_tokens or int(self.canvas[self.prompt_len + n]) in self.stop_ids
