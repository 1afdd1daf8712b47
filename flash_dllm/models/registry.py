"""The model families the loader knows, and how a checkpoint's ``architectures`` / ``model_type``
picks one. A family is one module ``models/<family>.py`` exposing ``FAMILY`` plus its line in
``FAMILIES`` below; ``register`` (or ``registered``, for a test) adds one defined elsewhere."""
from __future__ import annotations

from contextlib import contextmanager

from flash_dllm.models import dream, llada, llada2, llada_moe, sdar, sdar_moe
from flash_dllm.cache.modes import fast_default
from flash_dllm.models.family import Family

# NOTE: no two families share a name, an architecture or a model type (``register`` refuses
# one already taken), so which family a checkpoint resolves to never depends on the order here.
# A family whose model_type another already uses (LLaDA-MoE's is "llada") resolves by its
# architectures alone (model_types=()).
FAMILIES: list[Family] = []


def register(family: Family) -> Family:
    """Add ``family``; its name, architectures and model types must all be new."""
    for fam in FAMILIES:
        clash = ({family.name} & {fam.name}
                 or set(family.architectures) & set(fam.architectures)
                 or {t.lower() for t in family.model_types} & {t.lower() for t in fam.model_types})
        if clash:
            raise ValueError(f"family {family.name!r} clashes with the registered family "
                             f"{fam.name!r} on {sorted(clash)}")
    FAMILIES.append(family)
    return family


def unregister(family: Family) -> None:
    """Remove ``family`` (by name)."""
    FAMILIES[:] = [f for f in FAMILIES if f.name != family.name]


@contextmanager
def registered(family: Family):
    """``family`` registered for the block only (tests)."""
    register(family)
    try:
        yield family
    finally:
        unregister(family)


register(llada.FAMILY)
register(dream.FAMILY)
register(llada2.FAMILY)
register(llada_moe.FAMILY)
register(sdar.FAMILY)
register(sdar_moe.FAMILY)


def resolve(raw_config: dict) -> Family:
    archs = raw_config.get("architectures") or []
    for fam in FAMILIES:
        if any(a in fam.architectures for a in archs):
            return fam
    mtype = str(raw_config.get("model_type", "")).lower()
    for fam in FAMILIES:
        if mtype in (t.lower() for t in fam.model_types):
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


def default_cache(cfg) -> str:
    """The cache mode a request of a model of ``cfg`` (a ``ModelConfig``) gets when it names
    none: its family's ``default_cache``; for a config of no registered family (a test's
    unregistered toy), the cache mode that declares itself the default for its attention
    (``cache.modes.fast_default``)."""
    for fam in FAMILIES:
        if fam.name == cfg.arch:
            return fam.default_cache
    return fast_default(cfg.attention.block_causal)
