"""The drift trigger (``SamplingParams.drift_min``, ``decoding/drift.py``) as a step extension: it
decides when a ``block_refresh`` cache mode refreshes (``refresh``), tests each step's attention
mass on the device (``after_commit``: one flag per request, read back with the step's blocks) and
marks the requests whose test failed (``apply``: ``req.stale``, the next step refreshes)."""
from __future__ import annotations

from flash_dllm.core.counters import count
from flash_dllm.decoding import drift
from flash_dllm.worker.extensions.base import StepExtension


class DriftTrigger(StepExtension):
    name = "drift"
    wants_mass = True

    def active(self, req) -> bool:
        return req.params.drift_min is not None and req.overflow is None

    def refresh(self, req) -> bool | None:
        return drift.refresh_step(req)

    def after_commit(self, runner, step, states, members, counters):
        return drift.test(step.batch, states, step.windows, step.meta.mass, counters)

    def read_back(self, runner, step, members, column, counters):
        """The ids of the requests whose test failed (their triggers counted here)."""
        drifted = set()
        for i in column.nonzero()[0].tolist():
            drifted.add(step.batch[i].request_id)
            count(counters, i, "sentinel_triggers", 1, "drift")
        return drifted

    def apply(self, engine, req, value) -> None:
        if req.request_id in value and not req.finished:
            req.stale = True       # the next step refreshes the cache
