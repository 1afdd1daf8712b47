"""Per-request (``SamplingParams``) and engine-wide (``EngineConfig``) settings, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass, fields

DECODE_POLICIES = ("vanilla", "threshold")
from flash_dllm.cache.modes import CACHE_MODES
DEFAULT_BLOCK_LENGTH = 32


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _check_int(name: str, value, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    The canvas is the prompt followed by ``max_tokens`` MASK slots, decoded in blocks of
    ``block_length`` left to right. ``steps`` is the total number of denoising steps over all
    blocks for ``decode="vanilla"`` (LLaDA's schedule); ``None`` means one token per step, the
    exact reference. ``decode="threshold"`` commits every slot with confidence >= ``threshold``
    and always the most confident one (Fast-dLLM), ignoring ``steps``.
    """

    max_tokens: int = 64
    block_length: int | None = None      # None: min(32, max_tokens)
    steps: int | None = None             # None: max_tokens (one token per step)
    temperature: float = 0.0
    top_k: int = 0                       # 0: no top-k filtering
    top_p: float = 1.0
    seed: int | None = None
    decode: str = "vanilla"
    cache: str = "none"
    threshold: float = 0.9
    early_stop: bool = True              # finish once a completed block holds an end-of-answer id

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        if self.block_length is None:
            object.__setattr__(self, "block_length", min(DEFAULT_BLOCK_LENGTH, self.max_tokens))
        _check_int("block_length", self.block_length, 1)
        if self.max_tokens % self.block_length:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be a multiple of block_length "
                             f"({self.block_length})")
        if self.steps is None:
            object.__setattr__(self, "steps", self.max_tokens)
        _check_int("steps", self.steps, 1)
        if self.steps > self.max_tokens:
            raise ValueError(f"steps must be in [1, max_tokens={self.max_tokens}], got {self.steps}")
        if self.steps % self.num_blocks:
            raise ValueError(f"steps ({self.steps}) must be a multiple of the number of blocks "
                             f"max_tokens/block_length = {self.num_blocks}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        _check_choice("decode", self.decode, DECODE_POLICIES)
        _check_choice("cache", self.cache, CACHE_MODES)
        if not isinstance(self.threshold, (int, float)) or not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold!r}")

    @property
    def num_blocks(self) -> int:
        return self.max_tokens // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide knobs."""

    max_num_seqs: int = 64               # requests decoded together in one forward

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
