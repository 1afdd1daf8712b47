"""flash-dllm: a fast, memory-efficient inference engine for diffusion LLMs."""
__version__ = "0.1.0"

import time as _time  # noqa: E402

# when the package was first imported: a server's time to ready counts from here (the import of
# torch and the model load included)
IMPORTED_AT = _time.perf_counter()

# NOTE: the public names load on first use (PEP 562), so that ``flash-dllm --version`` and the
# CLI's usage errors answer without importing torch; the built-in decode policies register when
# the registry is first read (``decoding/registry.py``)
_PUBLIC = {"LLM": "flash_dllm.entrypoints.llm", "SamplingParams": "flash_dllm.config",
           "EngineConfig": "flash_dllm.config", "RequestOutput": "flash_dllm.core.request"}

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'flash_dllm' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
