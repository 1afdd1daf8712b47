"""Sentinels: cheap per-slot checks that distrust a confident-looking slot (no engine state).

- **entropy**: a slot whose predictive entropy exceeds ``h_max`` (nats) is not committed by the
  threshold rule; it is drafted and must pass verification instead.
- **perturbation**: if Gaussian noise of scale ``sigma`` on the logits changes the top-1 token, the
  slot is treated as unconfident (drafted for verification, not committed).
- **KV consistency**: the top-k keys a slot attends to (last layer, mean over heads) are compared
  with that slot's top-k at its previous step; a Jaccard overlap below ``j_min`` means the context
  it reads has drifted, and the engine recomputes the cached K/V of the keys it now relies on.

- **lazy load** (``cache/io/kv_overflow.py``): under lazy loading, the host pages a block attends
  to most drifting from those its measuring step chose force the next step to load every page.

- **drift** (``decoding/drift.py``, ``drift_min``): the attention the most-attended cached keys get
  moving between two steps of a block makes the next step recompute the whole canvas.

Names in ``SENTINELS`` key the engine's counters (``Engine.stats["sentinel_checks"/"_triggers"]``).
"""
from __future__ import annotations

import torch

from flash_dllm.core.counters import SENTINELS  # noqa: F401 (re-exported: the counters' names)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Predictive entropy in nats, one softmax pass: H = logsumexp(l) - sum softmax(l) * l.

    logits [N, V] -> [N] float32.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)             # [N, 1]
    p = (logits - lse).exp()                                         # [N, V], the only softmax
    # 0 * -inf (a filtered logit) would be nan: those terms are 0
    pl = torch.where(p > 0, p * logits, torch.zeros_like(p))
    return lse.squeeze(-1) - pl.sum(-1)


def perturbation_flips(logits: torch.Tensor, sigma: float, generator: torch.Generator | None,
                       forbid: int | None = None) -> torch.Tensor:
    """True where adding N(0, sigma^2) noise to every logit changes the argmax.

    logits [N, V] -> [N] bool. ``forbid`` (the MASK id) is never a top-1 candidate.
    """
    logits = logits.float()
    if forbid is not None:
        logits = logits.clone()
        logits[:, forbid] = float("-inf")
    noise = torch.randn(logits.shape, generator=generator, device=logits.device,
                        dtype=logits.dtype)
    return (logits + sigma * noise).argmax(-1) != logits.argmax(-1)


def topk_jaccard(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Jaccard overlap of two sets of k distinct indices per row: [N, k], [N, k] -> [N] float."""
    inter = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).float()   # [N]
    k = a.shape[1]
    return inter / (2 * k - inter)
