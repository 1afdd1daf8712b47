"""The precision-fallback sentinel (``SamplingParams.precision_fallback``; issue 40): on a model
quantized with a fallback copy (``--quantization int4 --quantization-fallback int8``,
``layers/quant.py``), a slot the commit rule would keep whose predictive entropy is above the
request's limit is held back (stays MASK), and the request's next forward runs on the finer copy
(eagerly: the CUDA graphs replay the main copy), where the commit rule applies unchanged. So an
uncertain proposal of the coarse weights is recomputed at the finer precision before it is
committed; a step on the fallback copy holds nothing back, so every two forwards make progress.

The forward's precision is per step, not per request: when one member asks for the fallback,
the whole batch's forward runs on it (the others are then not checked on that step).
Counted as sentinel ``precision``; the runner counts the fallback forwards
(``ModelRunner.fallback_forwards``)."""
from __future__ import annotations

import torch

from flash_dllm.core.counters import count
from flash_dllm.decoding.registry import DECODE_POLICIES
from flash_dllm.decoding.sentinels import entropy
from flash_dllm.transfer import h2d
from flash_dllm.worker.extensions.base import StepExtension


class PrecisionFallback(StepExtension):
    name = "precision"
    block_causal_ok = True          # no positions added, no attention statistics read

    def active(self, req) -> bool:
        return req.params.precision_fallback is not None

    def refuse(self, params, runner) -> str | None:
        """Why a request with ``precision_fallback`` cannot run on ``runner`` (None: it can)."""
        if params.precision_fallback is None:
            return None
        if not runner.weight_info.get("fallback"):
            return ("precision_fallback needs a model loaded with a fallback copy of its "
                    "quantized weights (--quantization int4 --quantization-fallback int8)")
        if not DECODE_POLICIES[params.decode].holds_back:
            ok = [n for n in DECODE_POLICIES if DECODE_POLICIES[n].holds_back]
            return f"precision_fallback runs with decode {ok}, got decode={params.decode!r}"
        return None

    def wrap_metadata(self, runner, plan, step) -> None:
        """Before the forward: run it on the fallback copies when a member's last step held
        slots back."""
        members = [runner.state(r.request_id) for r in plan.requests if self.active(r)]
        now = any(st.fallback_next for st in members)
        for st in members:
            st.fallback_now, st.fallback_next = now, False
        step.fallback_precision = step.fallback_precision or now

    def hold_back(self, ctx, members, passing, gid) -> torch.Tensor:
        """[n_slot] bool: the slots of ``members`` in ``passing`` (``gid``: member index per slot,
        -1 for others) whose entropy is above their request's limit, on a step that ran on the
        main copy; a member with any sets ``fallback_next``."""
        G = len(members)
        held = torch.zeros_like(passing)
        # (``members``: the policy's; those without the sentinel, or whose forward ran on the
        # fallback copies, are not checked)
        on = [ctx.batch[i].params.precision_fallback is not None
              and not ctx.states[i].fallback_now for i in members]
        limits = [ctx.batch[i].params.precision_fallback if o else float("inf")
                  for i, o in zip(members, on)]
        if not any(on):
            return held
        hm = h2d(limits + [float("inf")], torch.float32, passing.device)
        g = torch.where(gid >= 0, gid, G)
        rows = torch.nonzero(passing & (g < G)).squeeze(-1)
        trig = entropy(ctx.logits[rows]) > hm[g[rows]]
        held[rows[trig]] = True
        checks = torch.bincount(g[rows], minlength=G + 1).tolist()
        trigs = torch.bincount(g[rows[trig]], minlength=G + 1).tolist()
        for k, i in enumerate(members):
            if not on[k]:
                continue
            count(ctx.counters, i, "sentinel_checks", checks[k], "precision")
            count(ctx.counters, i, "sentinel_triggers", trigs[k], "precision")
            ctx.states[i].fallback_next = trigs[k] > 0
        return held
