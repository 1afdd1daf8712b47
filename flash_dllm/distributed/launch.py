"""Starting ranks on one host: each rank's device, its process groups, and worker processes.

``init_groups`` joins two process groups: the compute group (NCCL on GPUs, gloo on the CPU) that
the model's all-reduces and vocabulary reductions use, with a timeout so a dead rank fails the
step instead of hanging it; and a gloo control group for rank 0's command broadcasts, whose
timeout is long because a server may sit idle for hours between steps. ``spawn_ranks`` starts
ranks 1..N-1 as fresh interpreters running this module.
"""
from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

COMPUTE_TIMEOUT = timedelta(seconds=int(os.environ.get("FLASH_DLLM_TP_TIMEOUT_S", "300")))
CONTROL_TIMEOUT = timedelta(days=7)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int, world: int) -> torch.device:
    """This rank's device: ``cuda`` -> ``cuda:<rank>``; the CPU for every rank otherwise."""
    dev = torch.device(device if device != "auto" else
                       ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        if dev.index is not None and world > 1:
            raise ValueError(f"device {device!r}: with tensor_parallel_size {world} give "
                             "device='cuda' (rank r uses cuda:r)")
        n = torch.cuda.device_count()
        if n < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, but {n} "
                             f"{'is' if n == 1 else 'are'} visible")
        return torch.device("cuda", rank)
    return torch.device("cpu")


def init_groups(rank: int, world: int, init_method: str, dev: torch.device):
    """(TPGroup over the default group, gloo control group)."""
    from flash_dllm.distributed.tp import TPGroup

    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        # CPU ranks share the machine's cores: oversubscribed intra-op threads make every
        # collective wait on a descheduled rank (a 15x slower step on 2 cores, 2 ranks)
        share = max(1, (os.cpu_count() or 1) // world)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)
    if dist.is_initialized():
        if init_method == "env://" and dist.get_world_size() == world:
            # torchrun users who set up the default group themselves: use it
            return TPGroup(rank, world), dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        raise RuntimeError("a torch.distributed process group is already initialised in this "
                           "process: close the earlier tensor-parallel engine first "
                           "(LLM.close())")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=world, timeout=COMPUTE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, world), control


def _watch_parent() -> None:
    """A worker whose parent died exits (it would otherwise wait on the control group)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            threading.Event().wait(2.0)
    threading.Thread(target=watch, daemon=True, name="flash-dllm-tp-watch").start()


def spawn_ranks(world: int, target, *args) -> tuple[list, str]:
    """Start ranks 1..world-1, each running ``target(rank, world, init_method, *args)`` (a
    module-level function) in a fresh interpreter; returns (their ``Popen``s, init_method).

    NOTE: fresh interpreters running this module, not ``multiprocessing`` spawn: spawn re-imports
    the caller's main script, so it needs an ``if __name__ == "__main__"`` guard there, and
    ``LLM(..., tensor_parallel_size=2)`` at the top level of a script would start itself again."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn(target, r, world, init_method, *args) for r in range(1, world)]
    return procs, init_method


def spawn(target, *args) -> subprocess.Popen:
    """A fresh interpreter running ``target(*args)`` (a module-level function; see
    ``spawn_ranks``'s note)."""
    env = dict(os.environ)
    env["FLASH_DLLM_TP_SPEC"] = base64.b64encode(pickle.dumps((target, args))).decode()
    return subprocess.Popen([sys.executable, "-m", "flash_dllm.distributed.launch"], env=env)


def main() -> None:
    """A spawned rank (``python -m flash_dllm.distributed.launch``): what to run comes
    pickled in ``FLASH_DLLM_TP_SPEC`` from the parent process (never from a user)."""
    target, args = pickle.loads(base64.b64decode(os.environ.pop("FLASH_DLLM_TP_SPEC")))
    _watch_parent()
    target(*args)



if __name__ == "__main__":
    main()
