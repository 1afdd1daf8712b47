"""What a model family declares: how to read its config.json and how its tensors are named."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from flash_dllm.models.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    ``weight_map`` pairs checkpoint module paths with engine module paths, segment by segment;
    ``{i}`` stands for a layer index. A tensor name is its module path plus ``weight``/``bias``.
    Mapping is by whole dotted segments, so LLaDA's top-level ``ff_out`` (LM head) and a block's
    ``ff_out`` (down projection) can never be confused.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse_config: Callable[[dict], ModelConfig]
    to_hf_config: Callable[[ModelConfig], dict]
    weight_map: tuple[tuple[str, str], ...]

    @staticmethod
    def _match(template: str, path: str) -> str | None:
        """The layer index bound by ``{i}`` ('' if none) when ``path`` fits ``template``, else None."""
        pat = "^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$"
        m = re.match(pat, path)
        if m is None:
            return None
        return m.group(1) if m.groups() else ""

    def to_engine_name(self, ckpt_name: str) -> str | None:
        """Checkpoint tensor name -> engine parameter name, or None if no rule covers it."""
        path, _, leaf = ckpt_name.rpartition(".")
        for ckpt, ours in self.weight_map:
            i = self._match(ckpt, path)
            if i is not None:
                return ours.replace("{i}", i) + "." + leaf
        return None

    def to_ckpt_name(self, engine_name: str) -> str:
        """Engine parameter name -> checkpoint tensor name (for writing checkpoints)."""
        path, _, leaf = engine_name.rpartition(".")
        for ckpt, ours in self.weight_map:
            i = self._match(ours, path)
            if i is not None:
                return ckpt.replace("{i}", i) + "." + leaf
        raise KeyError(f"no checkpoint name for engine parameter {engine_name!r}")


def require(raw: dict, key: str, family: str):
    if key not in raw or raw[key] is None:
        raise ValueError(f"{family} config.json is missing required key {key!r}")
    return raw[key]


def as_id_tuple(*values) -> tuple[int, ...]:
    """Flatten ints / lists of ints / None into a de-duplicated tuple, order kept."""
    out: list[int] = []
    for v in values:
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) not in out:
                out.append(int(x))
    return tuple(out)
