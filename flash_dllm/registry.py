"""``Registry``: the one shape of every extension seam's list of implementations (cache modes,
decode policies, KV tiers, model families): a name -> object map that a new implementation joins
with one ``register`` call, and that configuration validates names against at run time."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named implementations of one seam, in registration order.

    Iterating yields the names (so ``list(CACHE_MODES)`` is the list of choices, and ``name in
    CACHE_MODES`` checks one); ``registry[name]`` is the implementation, and an unknown name is a
    ``ValueError`` that lists the known ones (it is what a bad option value reports).
    """

    def __init__(self, what: str, builtins: str | None = None) -> None:
        """``builtins``: a module that registers the built-in implementations, imported the
        first time the registry is read (so that importing the registry stays light)."""
        self.what = what
        self._builtins = builtins
        self._all: dict[str, T] = {}

    @property
    def _items(self) -> dict[str, T]:
        if self._builtins is not None:
            module, self._builtins = self._builtins, None     # (its import registers here)
            import importlib
            importlib.import_module(module)
        return self._all

    def register(self, item: T, name: str | None = None) -> T:
        """Add ``item`` under ``name`` (default: its ``name`` attribute); returns it."""
        name = name if name is not None else getattr(item, "name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} needs a non-empty name, got {name!r}")
        if name in self._items:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        self._items.pop(name, None)

    @contextmanager
    def registered(self, item: T, name: str | None = None):
        """Register ``item`` for the duration of a ``with`` block (tests)."""
        item = self.register(item, name)
        try:
            yield item
        finally:
            self.unregister(name if name is not None else getattr(item, "name"))

    def __getitem__(self, name: str) -> T:
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.what} must be one of {list(self._items)}, got "
                             f"{name!r}") from None

    def get(self, name: str, default: T | None = None) -> T | None:
        return self._items.get(name, default)

    def values(self) -> list[T]:
        return list(self._items.values())

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what}: {list(self._items)})"
