"""flash-dllm: a fast, memory-efficient inference engine for diffusion LLMs."""
__version__ = "0.1.0"

import time as _time  # noqa: E402

# when the package was first imported: a server's time to ready counts from here (the import of
# torch and the model load included)
IMPORTED_AT = _time.perf_counter()

# the built-in decode policies register themselves (``SamplingParams.decode`` is checked
# against the registry)
import flash_dllm.decoding.policies  # noqa: E402,F401
from flash_dllm.config import EngineConfig, SamplingParams  # noqa: E402
from flash_dllm.core.request import RequestOutput  # noqa: E402
from flash_dllm.entrypoints.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
