"""The fused step's data (``worker/fused_step.py``): the index vector's layout, and a step on its
way (multi-step's handle)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from flash_dllm.core.plan import StepResult


@dataclass
class Layout:
    """Offsets of the step's index vector (one int64 tensor; float knobs are stored as float64
    bits): the parts every fused step has, then its policy's ``fields``. ``key``: what the
    policy's graph is specialised to (``DecodePolicy.fused_fields``)."""

    B: int
    T: int
    bl: int
    width: int
    max_q: int
    max_k: int               # paged_attention.seqlen_bound of the longest canvas (split-KV)
    policy: str
    key: tuple
    fields: tuple            # the policy's (name, length) parts
    # the attention's sequences: a block-causal step's windows cut at block bounds
    # (``layers/paged_index.split_blocks``); 0: one per request
    A: int = 0
    starts: int = 0          # requests at a block start (``EngineConfig.fused_first_steps``)

    @property
    def R(self) -> int:
        return self.B * self.bl

    @property
    def S(self) -> int:
        """Sequences the attention sees (its ``cu_q``, ``seq_lens`` and block table rows)."""
        return self.A or self.B

    @cached_property
    def slices(self) -> dict[str, slice]:
        T, R, B, S = self.T, self.R, self.B, self.S
        sizes = [("ids_idx", T), ("positions", T), ("slots", T), ("rows", R), ("blk_idx", R),
                 ("cu_q", S + 1), ("seq_lens", S), ("bstart", B), ("table", S * self.width),
                 *self.fields]
        # every part starts on a 16-byte boundary (an even int64 offset): Triton compiles a
        # kernel variant per alignment of its pointer arguments (see attention_backend)
        out, a = {}, 0
        for name, n in sizes:
            out[name] = slice(a, a + n)
            a = -(-(a + n) // 2) * 2
        return out

    @property
    def size(self) -> int:
        return max(s.stop for s in self.slices.values())


@dataclass
class Launched:
    """A fused step on its way (``FusedSteps.launch``): its output lands in ``out`` (host
    memory) once ``done`` (a CUDA event; None: already there) has passed."""

    policy: object
    bl: int
    out: torch.Tensor
    done: torch.cuda.Event | None = None

    def result(self) -> StepResult:
        """Wait for the step; its result."""
        if self.done is not None:
            self.done.synchronize()
        blocks, counters = self.policy.fused_result(self.out.numpy(), self.bl)
        return StepResult(blocks, counters)
