"""LLaDA's step schedule: how many tokens each denoising step of a block commits."""
from __future__ import annotations


def num_transfer_tokens(mask_count: int, steps: int) -> list[int]:
    """Split ``mask_count`` masks over ``steps`` steps: ``mask_count // steps`` each, the remainder
    one extra to the earliest steps (LLaDA's ``get_num_transfer_tokens``)."""
    if steps <= 0:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, rem = divmod(mask_count, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]
