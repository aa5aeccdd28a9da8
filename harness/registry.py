"""A registry of named things (backends, checks, model builders, issue sinks): one per name, with
errors that list what exists, filled from one entry-point group.

Every kind of extension registers the same way, harness's own built-ins included: a package declares
an entry point in the kind's group (``harness.checks``, ``harness.backends``, ``harness.models``,
``harness.sinks``) whose target is ``register(registry)``, and :meth:`NamedRegistry.load_entry_points`
calls each. A broken entry point (it does not import, or its ``register`` raises) costs only what it
would have registered: it is recorded as one message naming it (:func:`broken_entry_points`, shown
by every ``harness`` command and at the end of a pytest session) and the others load as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from harness.messages import first_line

T = TypeVar("T")

# "group name = value" -> the message; process-wide, so that the CLI and the pytest plugin can say
# what did not load whichever registry tried.
_BROKEN: dict[str, str] = {}
# group -> the registry class its owner declares (a subclass with that ``group``), and the one loaded
# registry of each group in this process (:func:`of_group`).
_TYPES: dict[str, type[NamedRegistry]] = {}
_LOADED: dict[str, NamedRegistry] = {}


def broken_entry_points() -> list[str]:
    """One line per entry point that failed to load in this process, naming it."""
    return list(_BROKEN.values())


def _dist_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"




class NamedRegistry(Generic[T]):
    kind = "item"  # used in messages: "unknown backend 'x' (registered: ...)"
    group = ""  # its entry-point group
    item_type: type | None = None  # what may be added (the one interface its users rely on)

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.group:
            _TYPES[cls.group] = cls

    def __init__(self):
        self._items: dict[str, T] = {}
        self.errors: list[str] = []  # broken entry points of this registry's group

    def add(self, item: T, *, replace: bool = False) -> T:
        t = self.item_type
        if t is not None and not isinstance(item, t):
            raise ValueError(f"a {self.kind} must be an instance of {t.__module__}.{t.__qualname__}, got "
                             f"{type(item).__module__}.{type(item).__qualname__}")
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

    # --- entry points -----------------------------------------------------------------------------
    def load_entry_points(self, group: str | None = None) -> NamedRegistry[T]:
        """Call ``register(self)`` of every entry point in ``group``: harness's own first, then the
        other distributions' sorted by distribution and entry-point name (a stable order). What a
        third-party entry point adds gets ``source = "<distribution> (<module:attr>)"``."""
        group = group or self.group
        eps = sorted(entry_points(group=group),
                     key=lambda ep: (_dist_name(ep) != "harness", _dist_name(ep), ep.name))
        if not any(_dist_name(ep) == "harness" for ep in eps):
            self._broken(f"{group}:harness", f"harness: no built-in entry points in group {group!r}: "
                         "harness is not installed (`pip install -e .` in the source tree)")
        for ep in eps:
            before = dict(self._items)
            try:
                ep.load()(self)
            except Exception as e:  # noqa: BLE001 - a broken plugin must not cost the others
                self._items = before  # nothing half-registered
                self._broken(f"{group}:{_dist_name(ep)}:{ep.name}",
                             f"broken {group} entry point {ep.name} = {ep.value} (from {_dist_name(ep)}): "
                             f"{type(e).__name__}: {first_line(e)}")
                continue
            if _dist_name(ep) != "harness":
                for n, item in self._items.items():
                    if before.get(n) is not item:
                        self._set_source(item, f"{_dist_name(ep)} ({ep.value})")
        return self

    def _broken(self, key: str, message: str) -> None:
        self.errors.append(message)
        _BROKEN[key] = message

    @staticmethod
    def _set_source(item, source: str) -> None:
        try:
            item.source = source
        except AttributeError:  # frozen or slotted: keeps its own
            pass


def of_group(group: str) -> NamedRegistry:
    """The process's one registry of an entry-point group, loaded on first use.

    Its class is the one the group's owner declares (the ``NamedRegistry`` subclass whose ``group``
    it is: it validates and orders what is added). Importing the entry points' targets imports the
    owner, so a lower layer that reads an upper one's extensions (the suite schema, which has one
    ``[checks.<name>]`` table per registered check) gets the owner's registry without importing the
    owner's package: the extension point crosses the layers, no import does (docs/architecture.md)."""
    reg = _LOADED.get(group)
    if reg is None:
        for ep in entry_points(group=group):
            try:
                ep.load()
            except Exception:  # noqa: BLE001, S110 - load_entry_points below records it, naming it
                pass
        reg = _LOADED[group] = _TYPES.get(group, NamedRegistry)().load_entry_points(group)
    return reg
