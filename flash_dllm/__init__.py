"""flash-dllm: a fast, memory-efficient inference engine for diffusion LLMs."""
from flash_dllm.config import EngineConfig, SamplingParams
from flash_dllm.engine.llm import LLM
from flash_dllm.engine.request import RequestOutput

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput"]
__version__ = "0.1.0"
