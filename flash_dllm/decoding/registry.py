"""The registry of decode policies (``decoding/policies/``): a leaf module, so that configuration
can validate ``SamplingParams.decode`` against it without importing the policies themselves
(``flash_dllm/__init__`` imports ``decoding.policies``, which registers the built-in ones)."""
from __future__ import annotations

from flash_dllm.registry import Registry

DECODE_POLICIES: Registry = Registry("decode")
