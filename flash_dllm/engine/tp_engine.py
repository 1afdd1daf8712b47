"""Tensor-parallel serving: every rank runs the same ``Engine`` over its shard of the model.

NOTE (one plan everywhere): scheduling, the page ledger, prefix reuse and every commit decision are
replicated, not sent: each rank holds an ``Engine`` whose inputs are identical, so each computes
the same ``StepPlan`` and, because the forward's collectives (``distributed/tp.py``) give every
rank the same hidden states and the same greedy proposals, the same ``StepResult``. Rank 0 takes
requests; before each step it broadcasts the commands it applied since the last one (add, abort),
and the other ranks apply them in the same order, then step (``LLM.logits`` sends a dense forward
instead of a step: ``dense_logits``). What could make the replicas drift
is pinned down here: request ids and sampling seeds are chosen on rank 0 and sent; the KV manager
ticks on a step counter (not a wall clock) and its cost model does not adapt to local timings.
"""
from __future__ import annotations

import dataclasses
import random
import atexit
import subprocess

import torch
import torch.distributed as dist

from flash_dllm.config import SamplingParams
from flash_dllm.engine.engine import Engine

STOP = "stop"


def make_deterministic(engine: Engine) -> None:
    """Replica-safe settings of an engine under tensor parallelism (see the module note)."""
    engine.kv_manager.clock = lambda: float(engine.steps_run)
    engine.kv_manager.cost.adaptive = False
    # multi-step sizes its calls by the local step time, which would split the replicas' steps
    # differently (and it was never measured on several GPUs): one step per call
    engine.multi_step = 1


class TPEngine(Engine):
    """Rank 0 of a tensor-parallel group: an ``Engine`` that tells the other ranks what it did.
    ``control``: a CPU (gloo) process group used only for the command broadcasts."""

    def __init__(self, model, cfg, config=None, control=None) -> None:
        super().__init__(model, cfg, config)
        make_deterministic(self)
        self.control = control
        self._cmds: list[tuple] = []
        self.closed = False
        self.workers: list = []        # spawned ranks (``entrypoints/tp_launch.launch``)
        self.threads: int | None = None     # the CPU thread count to restore at close

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, prompt: str | None = None):
        if params.temperature > 0 and params.seed is None:
            # every rank must draw the same samples: the seed is chosen here and sent
            params = dataclasses.replace(params, seed=random.randrange(2**62))
        req = super().add_request(prompt_ids, params, request_id, prompt)
        self._cmds.append(("add", list(prompt_ids), req.params, req.request_id, prompt))
        return req

    def abort(self, request_id: str) -> bool:
        done = super().abort(request_id)
        if done:
            self._cmds.append(("abort", request_id))
        return done

    def dense_logits(self, ids: torch.Tensor, pattern=None) -> torch.Tensor:
        """``LLM.logits`` on a sharded model: every rank runs the dense forward of ``ids``
        [B, L] (with ``pattern``), whose collectives need them all; rank 0 gets [B, L, V].
        Requests added since the last step are sent first, so every rank's engine still holds
        the same requests; no rank steps for this command."""
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed (its other ranks stopped)")
        self.check_workers()
        cmds, self._cmds = self._cmds, []
        self._broadcast(cmds + [("logits", ids.cpu(), pattern)])
        return self.model(ids, pattern=pattern)

    def graphs_ready(self) -> None:
        super().graphs_ready()
        self._cmds.append(("graphs_ready",))    # every rank stops capturing at the same step

    def _step_failed(self, plan, exc: Exception):
        """Never isolated, whatever ``isolate_step_failures`` says: the other ranks would not
        know that this one dropped the batch, and the replicas would drift apart."""
        raise exc

    def step(self):
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed (its other ranks stopped)")
        self.check_workers()
        cmds, self._cmds = self._cmds, []
        try:
            self._broadcast(cmds)
            return super().step()
        except Exception as e:
            dead = self.dead_workers()
            if dead:
                raise RuntimeError(f"tensor-parallel step failed: {dead}") from e
            raise

    def dead_workers(self) -> str:
        """'' or a sentence naming the spawned ranks that exited."""
        gone = [f"rank {i + 1} (pid {p.pid}) exited with code {p.returncode}"
                for i, p in enumerate(self.workers) if p.poll() is not None]
        return "; ".join(gone) + (" (its traceback, if any, is above)" if gone else "")

    def check_workers(self) -> None:
        dead = self.dead_workers()
        if dead:
            raise RuntimeError(f"tensor-parallel worker lost: {dead}; restart the engine")

    def close(self) -> None:
        """Tell the other ranks to stop, wait for spawned workers and leave the process group
        (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)      # (registered by entrypoints/tp_launch)
        try:
            if not self.dead_workers():
                self._broadcast([(STOP,)])
        except Exception:  # noqa: BLE001 - a rank already gone: nothing left to stop
            pass
        for p in self.workers:          # subprocess.Popen (``entrypoints/tp_launch``)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def _broadcast(self, cmds: list) -> None:
        box = [cmds]
        dist.broadcast_object_list(box, src=0, group=self.control)


def follow(engine: Engine, control=None) -> None:
    """The loop of every rank but 0: apply rank 0's commands, step, until told to stop."""
    make_deterministic(engine)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        step = True
        for cmd in box[0]:
            if cmd[0] == STOP:
                return
            if cmd[0] == "add":
                _, ids, params, rid, prompt = cmd
                engine.add_request(ids, params, request_id=rid, prompt=prompt)
            elif cmd[0] == "graphs_ready":
                engine.graphs_ready()
            elif cmd[0] == "logits":            # rank 0's ``dense_logits``: a forward, no step
                _, ids, pattern = cmd
                with torch.inference_mode():
                    engine.model(ids.to(engine.device), pattern=pattern)
                step = False
            else:
                engine.abort(cmd[1])
        if step:
            with torch.inference_mode():
                engine.step()
