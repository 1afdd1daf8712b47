"""The rotary tables' per-forward cache never serves a CUDA graph a tensor made outside it.

A capture runs its forward twice over the same static ``positions`` (a warm-up, then the
capture); a cache hit across the two handed the graph the warm-up's tables, which the next
forward freed: LLaDA2 replays then read freed memory (issue 39's illegal memory access). The
capture state is simulated here (CPU); ``tests/gpu/test_engine_gpu.py`` replays real graphs."""
from __future__ import annotations

import torch

from flash_dllm.layers import rotary
from flash_dllm.layers.rotary import Rotary


def test_cache_serves_one_forward_and_never_crosses_a_capture(monkeypatch):
    rot = Rotary(16, 10000.0, True, rotary_dim=8)
    pos = torch.arange(6)
    cos, sin = rot.cos_sin(pos)
    assert rot.cos_sin(pos)[0] is cos                   # layers of one forward: computed once
    assert rot.cos_sin(pos.clone())[0] is not cos       # another forward: recomputed
    cos, _ = rot.cos_sin(pos)
    monkeypatch.setattr(rotary, "capturing_graph", lambda t: True)
    captured, _ = rot.cos_sin(pos)                      # the capture of the warm-up's positions
    assert captured is not cos and torch.equal(captured, cos)
    assert rot.cos_sin(pos)[0] is captured              # inside the capture: shared again
    monkeypatch.setattr(rotary, "capturing_graph", lambda t: False)
    assert rot.cos_sin(pos)[0] is not captured          # and never lent out of it


def test_capturing_graph_is_false_off_cuda():
    assert rotary.capturing_graph(torch.zeros(2)) is False
