"""Decode policies: one class per commit rule, registered by name (``DECODE_POLICIES``).

The built-in ones are registered here, in this explicit list; a new policy is one module with a
``DecodePolicy`` subclass (``base.py`` says what it implements) plus one ``register`` call.
``rules.py`` holds the pure tensor rules they share (and their graph-safe twins).
"""
from __future__ import annotations

from flash_dllm.decoding.policies.base import DECODE_POLICIES, DecodePolicy, SelectContext
from flash_dllm.decoding.policies.edit import EditPolicy
from flash_dllm.decoding.policies.llada2 import LLaDA2Policy
from flash_dllm.decoding.policies.rules import (group_ids, select_threshold, select_top_k,
                                                threshold_rows, top_k_rows)
from flash_dllm.decoding.policies.threshold import ThresholdPolicy
from flash_dllm.decoding.policies.vanilla import VanillaPolicy
from flash_dllm.decoding.policies.verify import VerifyPolicy

for _policy in (VanillaPolicy(), ThresholdPolicy(), VerifyPolicy(), LLaDA2Policy(),
                EditPolicy()):
    DECODE_POLICIES.register(_policy)

__all__ = ["DECODE_POLICIES", "DecodePolicy", "EditPolicy", "LLaDA2Policy", "SelectContext",
           "ThresholdPolicy",
           "VanillaPolicy", "VerifyPolicy", "group_ids", "select_threshold", "select_top_k",
           "threshold_rows", "top_k_rows"]
