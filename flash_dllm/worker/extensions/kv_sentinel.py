"""The KV-consistency sentinel (``SamplingParams.kv_jaccard_min``): when the keys a slot attends to
most (last layer) drift from those of its previous step, the next forward recomputes those keys'
cached K/V (``decoding/sentinels.topk_jaccard``). Any policy, any cache mode."""
from __future__ import annotations

import torch

from flash_dllm.core.counters import count
from flash_dllm.decoding.sentinels import topk_jaccard
from flash_dllm.worker.extensions.base import StepExtension


class KVSentinel(StepExtension):
    name = "kv_consistency"

    def active(self, req) -> bool:
        return req.params.kv_jaccard_min is not None

    def extra_positions(self, req, state, window):
        """The keys the last step flagged (``state.refresh``, consumed), outside the window and
        the read-only reused prefix."""
        if state.refresh is None:
            return None
        q0, q1 = window
        r = state.refresh
        state.refresh = None
        return r[((r < q0) | (r >= q1)) & (r >= req.reused_len)]

    def pack(self, step, members):
        """Probe the request's masked slots (rows from its segment's start)."""
        for b in members:
            s, e = step.bounds[b]
            step.segments[b].probe = step.slot_pos[s:e] - step.windows[b][0]

    def after_commit(self, runner, step, states, members, counters):
        for i in members:
            s, e = step.bounds[i]
            check(step.batch[i], states[i], step.segments[i].probe_weights, step.slot_pos[s:e],
                  counters, i)
        return None


def check(req, st, probe_weights: torch.Tensor | None, masked: torch.Tensor, counters: list,
          i: int) -> None:
    """Compare each probed slot's top-k attended keys with its previous step's; where the Jaccard
    overlap is below ``kv_jaccard_min``, mark those keys for recomputation in the next forward
    (their cached K/V are rewritten; ``cache="none"`` recomputes everything anyway)."""
    if probe_weights is None or masked.numel() == 0:
        return
    p = req.params
    k = min(p.kv_top_k, probe_weights.shape[1])
    top = probe_weights.topk(k, dim=-1).indices                               # [slots, k]
    if st.kv_history is None or st.kv_history.shape[1] != k:
        st.kv_history = torch.full((p.block_length, k), -1, dtype=torch.long, device=top.device)
    local = masked - req.block_start
    prev = st.kv_history[local]
    valid = prev[:, 0] >= 0
    trig = valid & (topk_jaccard(prev, top) < p.kv_jaccard_min)
    st.kv_history[local] = top
    count(counters, i, "sentinel_checks", int(valid.sum()), "kv_consistency")
    n_trig = int(trig.sum())
    count(counters, i, "sentinel_triggers", n_trig, "kv_consistency")
    if n_trig:
        st.refresh = torch.unique(top[trig])
