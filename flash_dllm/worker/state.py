"""One running request's device state, kept by the model runner (the request itself is host
data, ``core/request.py``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqState:
    """One running request's device state (the runner's; the request itself is host data)."""

    arena_row: int
    canvas: torch.Tensor                 # [canvas] long: a view of the arena row
    page_row: torch.Tensor               # [pages] int32: the request's page ids
    generator: torch.Generator | None = None
    sentinel_generator: torch.Generator | None = None
    # per-block state (reset when the request's block advances, ``new_block``)
    block: int = 0
    # decode="verify": (slots, tokens), or IN_STORE (in the runner's DraftStore: a fused step's)
    drafts: tuple[torch.Tensor, torch.Tensor] | str | None = None
    refresh: torch.Tensor | None = None      # cached positions the next forward recomputes
    kv_history: torch.Tensor | None = None   # [block_length, k] last top-k keys per slot
    # cache="flash": (the last step's mass [batch, keys], this request's row in it)
    mass_src: tuple[torch.Tensor, int] | None = None
    drift_prev: tuple | None = None          # the drift test's last step (``decoding/drift.py``)
    # a decode policy's or step extension's own per-block state, by its name
    block_state: dict = field(default_factory=dict)

    @property
    def attn_mass(self) -> torch.Tensor | None:
        """cache="flash": attention mass [canvas] each key got in this request's last step."""
        if self.mass_src is None:
            return None
        return self.mass_src[0][self.mass_src[1], :self.canvas.shape[0]]      # (mass, row)

    def new_block(self, block: int) -> None:
        """The request entered ``block``: its per-block state goes."""
        self.block = block
        self.drafts = self.refresh = self.kv_history = None
        self.block_state.clear()

