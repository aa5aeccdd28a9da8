"""A registry of named things (backends, checks): one per name, with errors that list what exists."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class NamedRegistry(Generic[T]):
    kind = "item"  # used in messages: "unknown backend 'x' (registered: ...)"

    def __init__(self):
        self._items: dict[str, T] = {}

    def add(self, item: T, *, replace: bool = False) -> T:
        name = item.name
        if name in self._items and not replace:
            raise ValueError(f"{self.kind} {name!r} registered twice "
                             f"({self._describe(self._items[name])} and {self._describe(item)})")
        self._items[name] = item
        return item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r} (registered: {', '.join(self._items)})") from None

    def names(self) -> list[str]:
        return list(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __contains__(self, name: str) -> bool:
        return name in self._items

    @staticmethod
    def _describe(item) -> str:
        return getattr(item, "source", None) or type(item).__module__
