"""The registry of decode policies (``decoding/policies/``): a leaf module, so that configuration
can validate ``SamplingParams.decode`` against it without importing the policies themselves
(``decoding.policies`` registers the built-in ones: imported when the registry is first read)."""
from __future__ import annotations

from flash_dllm.registry import Registry

DECODE_POLICIES: Registry = Registry("decode", builtins="flash_dllm.decoding.policies")
