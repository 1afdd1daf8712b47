"""Maps a checkpoint's ``architectures`` / ``model_type`` to its model family."""
from __future__ import annotations

from flash_dllm.models import dream, llada
from flash_dllm.models.family import Family

FAMILIES: tuple[Family, ...] = (llada.FAMILY, dream.FAMILY)


def resolve(raw_config: dict) -> Family:
    archs = raw_config.get("architectures") or []
    for fam in FAMILIES:
        if any(a in fam.architectures for a in archs):
            return fam
    mtype = str(raw_config.get("model_type", "")).lower()
    for fam in FAMILIES:
        if mtype in fam.model_types:
            return fam
    known = sorted({a for f in FAMILIES for a in f.architectures})
    raise ValueError(f"unknown architecture: architectures={archs!r}, model_type="
                     f"{raw_config.get('model_type')!r}; flash-dllm supports {known} "
                     f"(model_type one of {sorted({t for f in FAMILIES for t in f.model_types})})")


def by_name(name: str) -> Family:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")
