"""pytest setup for the study kernels: ``python3 -m pytest benchmarks/studies -q``.

NOTE: a Triton kernel module fixes whether it runs interpreted when it is imported, so on a machine
with no NVIDIA GPU choose the interpreter before anything imports triton (as ``tests/conftest.py``
does). This folder goes on ``sys.path`` so the tests import the studies as ``skinny_gemm`` and
``confidence``; both import ``flash_dllm.kernels._triton`` from the installed package.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
