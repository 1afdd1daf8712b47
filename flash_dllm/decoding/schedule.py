"""LLaDA's step schedule: how many tokens each denoising step of a block commits."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1024)
def num_transfer_tokens(mask_count: int, steps: int) -> tuple[int, ...]:
    """Split ``mask_count`` masks over ``steps`` steps: ``mask_count // steps`` each, the remainder
    one extra to the earliest steps (LLaDA's ``get_num_transfer_tokens``)."""
    if steps <= 0:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, rem = divmod(mask_count, steps)
    return tuple(base + (1 if i < rem else 0) for i in range(steps))


def transfer_count(req, step: int | None = None) -> int:
    """Tokens ``vanilla`` commits at ``req``'s current step of its block (``step``: at that
    step of the block instead)."""
    p = req.params
    sched = num_transfer_tokens(p.block_length, p.steps_per_block)
    return sched[min(req.step_in_block if step is None else step, len(sched) - 1)]
