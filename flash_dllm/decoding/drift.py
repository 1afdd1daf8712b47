"""The drift trigger (``SamplingParams.drift_min``): refresh a request's cached K/V when the
attention its cached keys get has drifted, instead of at every block (after Elastic-Cache,
Nguyen-Tri et al. 2025).

Fast-dLLM's ``dual`` / ``prefix`` caches recompute the whole canvas at the first step of every
block. With ``drift_min`` set, a block's first step recomputes only the previous block (its last
commits are stale in the cache) and the active block (and, for ``prefix``, the masked suffix, as
every step of it does), unless the **drift test** failed during the block before: then that
first step recomputes the whole canvas, where Fast-dLLM would have (``drift_defer``, the
default). With ``drift_defer=False`` the refresh runs at the step right after the failed test,
mid-block; that lost 7-8 points on the Dream proxy's chain suite where the deferred refresh lost
none (benchmarks/FINDINGS.md).

The drift test runs after every step whose query window equals the request's previous step's
(both are decode steps of the same block: the same query rows). It takes the ``kv_top_k`` cached
keys (outside the window) that got the most attention mass in the previous step (the paged
attention kernel's per-key mass of the last layer, summed over heads and query rows) and compares
the mass those keys get now with what they got then; a cosine similarity below ``drift_min``
means the context the block reads has moved, so the cache is refreshed.

NOTE (a blind spot): a block's first step is never compared (its window differs from the step
before), so a block decoded in two forwards or fewer runs no test and can never ask for a
refresh; the prompt and earlier blocks then keep the K/V of the last refresh.

NOTE (what differs from Elastic-Cache): it tests one layer (the last, where drift is largest) and
the mass summed over query rows, not each layer's attention column of the most-attended token;
it refreshes the whole canvas, not the layers from the drifting one on, and keeps the block
layout (no sliding window).
"""
from __future__ import annotations

import torch

from flash_dllm.core.counters import count as _count


def wants_mass(batch) -> bool:
    """Whether a step of ``batch`` needs the last layer's per-key attention mass for the test."""
    return any(r.params.drift_min is not None and r.overflow is None for r in batch)


def refresh_step(req) -> bool | None:
    """Whether ``req``'s next step recomputes its whole canvas (None: its cache mode decides,
    at every block's first step)."""
    if req.params.drift_min is None or req.overflow is not None:
        return None
    if req.params.drift_defer:
        return req.first_step and (req.stale or req.block == 0)
    return req.stale or (req.first_step and req.block == 0)


def test(batch, states, windows, mass: torch.Tensor | None, counters: list
         ) -> torch.Tensor | None:
    """Run the drift test for the drift requests of a step. ``mass`` [B, keys]: the step's
    per-key attention mass. Returns [B] int64 on the device (1: refresh at the next step), or
    None when no request of the batch has the trigger on; counts checks and triggers under the
    sentinel name ``drift`` (triggers are added by the caller, from the host copy)."""
    if mass is None or not wants_mass(batch):
        return None
    flags = torch.zeros(len(batch), dtype=torch.long, device=mass.device)
    for i, (req, st, (q0, q1)) in enumerate(zip(batch, states, windows)):
        if req.params.drift_min is None or req.overflow is not None:
            continue
        L = req.canvas_len
        now = mass[i, :L].float()
        prev = st.drift_prev
        st.drift_prev = (now.clone(), (q0, q1), req.block)
        if prev is None or prev[1] != (q0, q1) or prev[2] != req.block:
            continue              # not the same query rows: nothing to compare with
        k = min(req.params.kv_top_k, L - (q1 - q0))
        if k <= 0:
            continue
        ranked = prev[0].clone()
        ranked[q0:q1] = -1.0              # the window's own keys are recomputed, not cached
        top = ranked.topk(k).indices
        sim = torch.nn.functional.cosine_similarity(now[top], prev[0][top], dim=0, eps=1e-12)
        flags[i] = (sim < req.params.drift_min).long()
        _count(counters, i, "sentinel_checks", 1, "drift")
    return flags
