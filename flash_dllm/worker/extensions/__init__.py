"""Step extensions, in this explicit list (the order their hooks run in); ``base.py`` says what
an extension implements. A new one is one module plus one entry here."""
from __future__ import annotations

from flash_dllm.worker.extensions.base import HOOKS, StepExtension, has_hook
from flash_dllm.worker.extensions.drift import DriftTrigger
from flash_dllm.worker.extensions.kv_sentinel import KVSentinel
from flash_dllm.worker.extensions.mass import AttentionMass
from flash_dllm.worker.extensions.overflow import OverflowStream
from flash_dllm.worker.extensions.sentinels import EntropySentinel, PerturbationSentinel

EXTENSIONS: list[StepExtension] = [
    OverflowStream(),
    AttentionMass(),
    KVSentinel(),
    EntropySentinel(),
    PerturbationSentinel(),
    DriftTrigger(),
]


def active_on(batch) -> list[tuple[StepExtension, list[int]]]:
    """The extensions active on a step of ``batch``, each with its members (batch indices)."""
    out = []
    for ext in EXTENSIONS:
        members = [i for i, r in enumerate(batch) if ext.active(r)]
        if members:
            out.append((ext, members))
    return out


def refresh(req) -> bool | None:
    """Whether ``req``'s next step recomputes its whole canvas, as an active extension decides it
    (None: none does; its cache mode's rule applies)."""
    decided = None
    for ext in EXTENSIONS:
        if has_hook(ext, "refresh") and ext.active(req):
            v = ext.refresh(req)
            if v is not None:
                decided = v
    return decided


__all__ = ["EXTENSIONS", "HOOKS", "StepExtension", "active_on", "has_hook", "refresh"]
