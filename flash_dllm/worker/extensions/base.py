"""The step-extension seam: a feature that rides along a step without being part of every step.

Sentinels, the drift trigger, the ``flash`` mode's attention-mass collection and the streaming of
requests larger than the GPU pool each hook into a few points of the general step
(``worker/general_step.py``); an extension is active on a request (``active``) or not, and a step
on which no extension is active calls none of them (off the hot path). Every hook is optional:

| hook | when | what for |
|---|---|---|
| ``refresh(req)`` | the scheduler plans a request | whether the step recomputes the whole canvas (drift) |
| ``extra_positions(req, state, window)`` | packing | cached positions to recompute too (KV sentinel) |
| ``pack(step, members)`` | after packing, before the attention metadata | rows to probe (KV sentinel) |
| ``wrap_metadata(runner, plan, step)`` | before the forward | another KV layout (overflow) |
| ``after_forward(runner, step, states, members)`` | after the forward | read the attention mass |
| ``demote(ctx, members, passing, gid)`` | inside a policy's ``select`` | sentinels: commit -> verify |
| ``after_commit(runner, step, states, members, counters)`` | after the commit | device tests; may return one int64 [B] column that rides on the step's device->host copy |
| ``read_back(runner, step, members, column, counters)`` | after that copy | its result for the engine, put in ``StepResult.extensions[name]`` |
| ``apply(engine, req, value)`` | ``Engine._apply``, per request | host state (e.g. a refresh for the next step) |

A new extension is one module with a ``StepExtension`` subclass plus one entry in the explicit
list ``worker/extensions/__init__.py``. ``wants_mass``: the step must keep the last layer's per-key
attention mass. ``fusable``: a fused step may run while it is active (only extensions that need
none of the hooks above on a steady step can say so). ``block_causal_ok``: it may run on a
block-causal model (none of today's does; each is refused there with its name).
"""
from __future__ import annotations


class StepExtension:
    name: str = ""
    fusable: bool = False
    wants_mass: bool = False
    # may run on a block-causal model (whose attention is split at block bounds: no scattered
    # extra positions, no per-request attention statistics)
    block_causal_ok: bool = False

    def active(self, req) -> bool:
        """Whether the extension runs for ``req``'s steps."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<step extension {self.name}>"


HOOKS = ("refresh", "extra_positions", "pack", "wrap_metadata", "after_forward", "demote",
         "after_commit", "read_back", "apply")


def has_hook(ext: StepExtension, hook: str) -> bool:
    """Whether ``ext`` implements ``hook`` (every hook is optional: absent means nothing to do)."""
    return callable(getattr(ext, hook, None))
