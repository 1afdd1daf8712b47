"""The decode-policy seam: what a policy implements, and the context its commit rule reads.

A policy decides which proposed tokens a step commits. The runner groups a step's requests by
policy and calls each policy once for all of its requests (``select``: batched tensor ops, no loop
of launches per request). A policy may also

- add query rows to the step's forward (``extra_rows``: Flash-Verify's verification rows),
- need the slots' full logits rather than only the greedy proposal (``needs_logits``),
- keep state between steps in the request's runner state (``after_commit``),
- provide a **fused** step (``fusable``): its commit rule in a graph-safe form (static shapes, no
  host syncs) that the runner's fused step (``worker/fused_step.py``) captures in one CUDA graph
  with the forward (``fused_keep``), or a whole graph-safe step body of its own (``fused_body``).

A new policy is one module with a ``DecodePolicy`` subclass plus ``DECODE_POLICIES.register(
MyPolicy())``; ``SamplingParams(decode=...)``, the CLI and the HTTP body accept it from then on.
Policies hold no state themselves (one instance serves every runner).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flash_dllm.decoding.registry import DECODE_POLICIES

__all__ = ["DECODE_POLICIES", "DecodePolicy", "SelectContext"]


@dataclass
class SelectContext:
    """One step's proposals at the masked slots of every request, in batch order (request ``b``
    owns slots ``bounds[b]``), and what the commit rules write: ``keep`` [n_slot] (and, for a
    policy that commits other tokens than the proposals, ``tokens``).

    ``logits`` [n_slot + extra rows, V] when some request's policy ``needs_logits`` or samples
    (None on the greedy path); ``plans``: each request's ``extra_rows`` result (None: none);
    ``current`` [n_slot]: the slots' tokens before the step when some request's policy edits
    (its slots are every answer slot of its block, MASK or not; None: every slot is MASK);
    ``demoters``: the step extensions that may demote slots from commit to verification
    (sentinels), each with ``demote(ctx, members, passing, gid) -> bool [n_slot]``."""

    batch: list
    states: list
    counters: list                      # per request: its counters of this step (or None)
    tokens: torch.Tensor                # [n_slot] proposed token
    conf: torch.Tensor                  # [n_slot] its probability
    positions: torch.Tensor             # [n_slot] canvas slot
    bounds: list[tuple[int, int]]
    keep: torch.Tensor                  # [n_slot] bool, out
    mask_id: int
    logits: torch.Tensor | None = None
    plans: list = field(default_factory=list)
    demoters: list = field(default_factory=list)
    current: torch.Tensor | None = None

    @property
    def n_slot(self) -> int:
        return self.conf.shape[0]


class DecodePolicy:
    """A commit rule (see the module docstring). Subclasses set ``name`` and implement
    ``select``; the rest is optional."""

    name: str = ""
    # its select reads ``SelectContext.logits`` (the full rows at its slots and extra rows)
    needs_logits: bool = False
    # its ``extra_rows`` may add query rows to a step (a request larger than the GPU pool, whose
    # step streams its KV through a stage, cannot carry them)
    adds_rows: bool = False
    # it may replace decoded tokens of the active block (token-to-token editing): its select sees
    # every answer slot of the block (``SelectContext.current`` holds their tokens), the block
    # ends when a step changes nothing (or after ``max_post_edit_steps`` steps without masks),
    # and the block's text is provisional until then (never streamed as final)
    edits: bool = False
    # has a graph-safe form (``fused_keep`` or ``fused_body``) for the fused step
    fusable: bool = False
    # its fused index vector depends only on the requests and their blocks (not on the step
    # within the block), so it is reused for every step of a block
    fused_static_per_block: bool = True
    # its commit count follows ``SamplingParams.steps`` (LLaDA's schedule): what a client's
    # step count (``/generate``'s ``num_inference_steps``) asks for when it names no policy
    reads_steps: bool = False
    # a server's full warm-up runs a request of it on the family's fast cache (its fused-step
    # graphs captured before ready; ``worker/warmup.cases``)
    warm_up: bool = False
    # SamplingParams knobs only this policy reads: a run that compares policies (``eval
    # --matrix``) resets them to None for every other policy
    own_knobs: tuple[str, ...] = ()

    # ------------------------------------------------------------------------------ general path
    def extra_rows(self, req, state, logit_shift: int, start: int):
        """Extra query rows for ``req`` in this step's forward, packed from row ``start`` (an
        object with ``block`` (ids, positions, num_rows), ``rows`` (the attention backend's
        ``VerifyRows``) and ``mask_rows`` (rows whose logits the policy reads); None: none)."""
        return None

    def select(self, ctx: SelectContext, members: list[int]) -> None:
        """Set ``ctx.keep`` (or-ed in) at the slots of the requests ``members`` (batch indices)
        that this step commits."""
        raise NotImplementedError

    def after_commit(self, req, state, tokens: torch.Tensor, conf: torch.Tensor,
                     positions: torch.Tensor, keep: torch.Tensor) -> None:
        """After the commit, with the request's own slot rows (e.g. the next drafts)."""

    def before_general(self, runner, states: list) -> None:
        """Before a general-path step of requests of this policy (e.g. bring device-side state
        that a fused step left behind back to where the general path keeps it)."""

    # -------------------------------------------------------------------------------- fused step
    def fused_fits(self, batch, dims: dict | None) -> bool:
        """The policy's own limits on a fused step of ``batch`` (``dims``: the model's and pool's
        per-rank sizes, ``worker/fused_step.py``)."""
        return True

    def fused_signature(self, req) -> int:
        """What the fused index vector depends on per request besides its block."""
        return 0

    def fused_ahead(self, req, limit: int) -> list[tuple[int, int]]:
        """The steps after ``req``'s next one that are known before it runs (multi-step,
        ``engine/multi_step.py``): for each, up to ``limit``, (its ``fused_signature``, the MASK
        slots left before it). Only a policy whose commit count does not depend on the model's
        output can know them, and only while the block goes on (a step that ends the block is
        the last one known). Default: none."""
        return []

    def fused_fields(self, batch, signature: list, dims: dict | None
                     ) -> tuple[tuple, list[tuple[str, int]]]:
        """The fused step's policy part: (a hashable key that the step's graph is specialised to,
        the named int64 fields the policy adds to the index vector and their lengths). ``dims``:
        the model's and pool's per-rank sizes (vocab, heads, kv_heads, head_dim, page_size,
        table_width)."""
        return (), []

    def fill_fused(self, host, sl: dict, batch, signature: list, arena_rows) -> None:
        """Write the policy's fields of the index vector ``host`` (numpy int64; ``sl``: name ->
        slice; float knobs are stored as float64 bits)."""

    def fused_keep(self, conf: torch.Tensor, masked: torch.Tensor, inp: torch.Tensor, sl: dict,
                   key: tuple) -> torch.Tensor:
        """Graph-safe commit rule: conf/masked [B, bl] (every row has a masked slot) -> keep."""
        raise NotImplementedError

    fused_body = None   # or a method ``fused_body(runner, inp, lay) -> [B, bl + extra]``

    def fused_extra_rows(self, lay) -> int:
        """Query rows a fused step of this policy adds to the forward's ``lay.T``."""
        return 0

    def before_fused(self, runner, states: list) -> None:
        """Before a fused step (e.g. move state that the general path keeps to the device)."""

    def fused_result(self, out, bl: int):
        """The fused step's output [B, bl (+ extra columns)] -> (blocks [B, bl], per-request
        counters or None)."""
        return out, None

    def __repr__(self) -> str:
        return f"<decode policy {self.name}>"
