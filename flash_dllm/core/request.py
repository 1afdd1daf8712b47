"""A request's host-side state: its canvas (a host mirror), its progress through blocks and steps.

NOTE (who owns what): ``Request`` holds host data only. The canvas on the device (a row of the
runner's arena), the request's drafts, sampling generators and attention statistics are the
runner's (``worker/runner.py``); its KV pages are the KV manager's (``cache/kv_manager.py``).
After each step the engine copies the request's active block back into ``tokens`` (one
device->host copy for the whole batch), so everything here (the committed prefix, stop ids,
finishing) is answered on the host, without touching the device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from flash_dllm.config import SamplingParams
from flash_dllm.core.counters import new_counters


@dataclass
class RequestOutput:
    """A request's result so far (host data). ``text`` is filled by whoever detokenises: ``LLM``
    once at the end; the server incrementally on its event loop (the engine thread never does)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]            # generated ids up to (not including) the first end-of-answer id
    num_forwards: int               # model forwards that included this request
    finish_reason: str | None       # "stop" (end-of-answer id), "length" (canvas full), "abort"
    finished: bool
    early_stopped: bool = False     # finished before the last block because an answer had ended
    metrics: dict = field(default_factory=dict)
    error: str | None = None        # finish_reason "error": why this request (alone) failed
    # an editing policy's decoded tokens after the committed prefix (they may still change:
    # never part of ``token_ids`` or of streamed text until their block ends)
    provisional_token_ids: list[int] = field(default_factory=list)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / self.num_forwards if self.num_forwards else 0.0


class StepOutput(NamedTuple):
    """What one step did to one request (host data, from ``Engine.step``; a tuple: one is made
    per request per step)."""

    request_id: str
    new_token_ids: list[int]        # ids appended to the committed answer prefix by this step
    num_tokens: int                 # length of the committed answer prefix after this step
    num_committed: int              # canvas slots this step committed (anywhere in the block)
    finished: bool
    finish_reason: str | None


class Request:
    """The canvas is ``prompt + max_tokens * [MASK]``; ``block`` is the active block;
    ``first_step`` means the next forward is the block's first (full refresh).

    ``grid`` (a block-causal model's block size, 0 otherwise): the blocks lie on the model's
    grid, counted from position 0 (``layers.attention.AttentionPattern``): the first block
    decoded is the one holding the prompt's end (its first ``lead`` slots are prompt), and the
    canvas runs to the end of the block holding ``prompt + max_tokens`` (LLaDA2's reference
    ``generate``); the answer is still cut at ``max_tokens``. Without a grid the blocks start at
    the prompt's end."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 mask_id: int, stop_ids: tuple[int, ...], prompt: str | None = None,
                 grid: int = 0, edits: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.mask_id = mask_id
        self.stop_ids = tuple(stop_ids)
        self._stops = np.array(self.stop_ids, dtype=np.int64)
        P = self.prompt_len = len(prompt_ids)
        bl = params.block_length
        self.grid = grid
        # where block 0 starts, and the canvas: prompt, then MASK until a step's read-back
        # fills it (on the model's grid: to the end of the block holding the last answer slot)
        self.origin = P - P % bl if grid else P
        canvas = -(-(P + params.max_tokens) // bl) * bl if grid else P + params.max_tokens
        self.num_blocks = (canvas - self.origin) // bl
        self.tokens = np.full(canvas, mask_id, dtype=np.int64)       # the host mirror
        self.tokens[:P] = prompt_ids
        self.block = 0
        # NOTE: only the active block ever commits, so every block starts all MASK (but for
        # the prompt slots that lead block 0 on a grid) and the committed answer prefix can only
        # end inside the active block
        self.num_masked = self.origin + bl - P     # MASK slots left in the active block
        # a policy that edits decoded tokens (``DecodePolicy.edits``): a block ends when a step
        # changes nothing, or after ``max_post_edit_steps`` steps with no mask; its text is
        # provisional (not in the committed prefix) until then
        self.edits = edits
        self.post_edit_steps = 0
        self.step_in_block = 0
        self.block_forwards: tuple[int, ...] = ()  # forwards each finished block took
        self.first_step = True
        self.stale = False      # drift trigger (``decoding/drift.py``): next step refreshes all
        self.num_forwards = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.early_stopped = False
        self.error: str | None = None              # set with finish_reason "error"
        self.counters: dict = new_counters()       # decode="verify" and sentinels
        self.num_tokens = 0                        # committed answer prefix length
        self.reused_len = 0      # prompt tokens whose K/V came from the prefix cache (read-only)
        # larger than the GPU pool: where its pages live (``cache/io/kv_overflow.OverflowPlan``)
        self.overflow = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def canvas(self) -> torch.Tensor:
        """The canvas as the host knows it (a CPU tensor view of ``tokens``)."""
        return torch.from_numpy(self.tokens)

    @property
    def canvas_len(self) -> int:
        return self.tokens.shape[0]

    @property
    def block_start(self) -> int:
        return self.origin + self.block * self.params.block_length

    @property
    def lead(self) -> int:
        """Prompt slots at the start of the active block (block 0 on a model's grid)."""
        return max(0, self.prompt_len - self.block_start)

    @property
    def block_end(self) -> int:
        return self.block_start + self.params.block_length

    def apply(self, block: np.ndarray, masked: int, first_end: int, stop_in_block: bool,
              first_slot: bool) -> StepOutput:
        """Book-keeping after a step, from the active block as the step left it (``block``: at
        least ``block_length`` ids, read back from the device) and what the engine computed for
        the whole batch at once: ``masked`` MASK slots left in it, ``first_end`` the first slot
        of it that is MASK or an end-of-answer id (``block_length`` if none), whether it holds an
        end-of-answer id, and whether its first answer slot is committed. On a model's grid the
        block may begin with prompt slots (``lead``): they are neither MASK nor an end of answer
        for the engine's counts, so ``first_end`` counts them."""
        bl = self.params.block_length
        b0 = self.block_start
        committed = self.num_masked - masked
        done = masked == 0
        if self.edits:
            if self.num_masked == 0:
                self.post_edit_steps += 1
            changed = not np.array_equal(self.tokens[b0:b0 + bl], block[:bl])
            spent = self.post_edit_steps > self.params.max_post_edit_steps
            done = done and (not changed or spent)
        self.tokens[b0:b0 + bl] = block[:bl]
        before = self.num_tokens
        start = b0 - self.prompt_len                        # the block, in answer positions
        if before >= start and (done or not self.edits):
            # the committed prefix had reached this block: extend it (an editing policy's block
            # only once it ended: until then its tokens may still change)
            self.num_tokens = min(start + first_end, self.params.max_tokens)
        self._advance(committed, first_slot and self.block == 0 and
                      self.first_token_time is None, stop_in_block, done)
        new = []
        if self.num_tokens > before:
            new = self.tokens[self.prompt_len + before:self.prompt_len + self.num_tokens].tolist()
        return StepOutput(self.request_id, new, self.num_tokens, committed, self.finished,
                          self.finish_reason)

    def _advance(self, committed: int, first_token: bool, stop_in_block: bool,
                 block_done: bool) -> None:
        self.num_forwards += 1
        self.step_in_block += 1
        if self.first_step or not self.params.drift_defer:
            self.stale = False     # the refresh it asked for ran (deferred: at a block start)
        self.first_step = False
        if first_token and self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.num_masked -= committed
        if not block_done:
            return
        self.block_forwards += (self.step_in_block,)
        self.block += 1
        self.step_in_block = 0
        self.post_edit_steps = 0
        self.first_step = True
        self.num_masked = self.params.block_length
        last = self.block == self.num_blocks
        ended = self.params.early_stop and not last and stop_in_block
        if last:
            self._finish("stop" if self._has_stop() else "length")
        elif ended:
            # NOTE: blocks are final once complete and decoded left to right, so nothing after an
            # end-of-answer id can change the answer: stopping here loses nothing.
            self.early_stopped = True
            self._finish("stop")

    def _has_stop(self) -> bool:
        answer = self.tokens[self.prompt_len:self.prompt_len + self.params.max_tokens]
        return bool(np.isin(answer, self._stops).any())

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finish_time = time.monotonic()

    def abort(self) -> None:
        self._finish("abort")

    def provisional_ids(self) -> list[int]:
        """An editing policy's decoded tokens of the active block after the committed prefix
        (they may still change; [] for other policies)."""
        if not self.edits or self.finished:
            return []
        a = self.prompt_len + self.num_tokens
        rest = self.tokens[a:min(self.block_end, self.prompt_len + self.params.max_tokens)]
        end = np.flatnonzero(rest == self.mask_id)
        return rest[:end[0] if end.size else rest.size].tolist()

    def generated_ids(self) -> list[int]:
        """Committed answer ids: the left-contiguous committed prefix of the generated region, cut
        at the first end-of-answer id. Emitted text built from it never changes."""
        return self.tokens[self.prompt_len:self.prompt_len + self.num_tokens].tolist()

    def answer_complete(self) -> bool:
        """True once the committed prefix can grow no further (an end-of-answer id was committed
        right after it, or the canvas is full)."""
        n = self.num_tokens
        return n == self.params.max_tokens or int(self.tokens[self.prompt_len + n]) in self.stop_ids
