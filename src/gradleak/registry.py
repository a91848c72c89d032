"""One registry pattern for attacks, defenses, datasets, metrics and experiments (docs/DESIGN.md §2).

Modelled on Opacus' grad-sampler registry: a decorator registers an object under a name together
with a one-line summary, so configs and ``gradleak list`` find it without ``if name == ...`` chains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from gradleak.errors import BadInput, nearest

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    summary: str


class Registry(Generic[T]):
    def __init__(self, kind: str, home: str | None = None):
        self.kind = kind
        self.home = home
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}
        self._loaded = home is None

    def _load(self) -> None:
        if not self._loaded:
            import importlib

            self._loaded = True  # before the import: entries looked up while the home package loads are found
            importlib.import_module(self.home)

    def register(self, name: str, summary: str = "") -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if (name in self._entries and self._entries[name].obj is not obj) or name in self._aliases:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            doc = summary or ((getattr(obj, "__doc__", "") or "").strip().splitlines() or [""])[0]
            self._entries[name] = Entry(name, obj, doc)
            return obj

        return deco

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` and its aliases (a plug-in registered for a while, e.g. by a test, and taken
        back); an unknown name is an error."""
        self._load()
        if name not in self._entries:
            raise ValueError(f"{self.kind} '{name}' is not registered")
        del self._entries[name]
        for a in [a for a, n in self._aliases.items() if n == name]:
            del self._aliases[a]

    def alias(self, alias: str, name: str) -> None:
        """``alias`` names the entry ``name`` too (``get(alias)`` returns the same object)."""
        if alias in self._entries or alias in self._aliases or name not in self._entries:
            raise ValueError(f"{self.kind} alias '{alias}' -> '{name}': taken, or no such entry")
        self._aliases[alias] = name

    def aliases(self, name: str) -> list[str]:
        """The other names of the entry ``name``."""
        self._load()
        return sorted(a for a, n in self._aliases.items() if n == name)

    def get(self, name: str, field: str | None = None) -> T:
        self._load()
        name = self._aliases.get(name, name)
        if name not in self._entries:
            near = nearest(name, list(self._entries) + list(self._aliases))
            raise BadInput(field or self.kind, f"unknown {self.kind} '{name}'.",
                           (f"did you mean '{self._aliases.get(near, near)}'? " if near else "")
                           + f"use one of: {', '.join(sorted(self._entries)) or '(none registered)'}.")
        return self._entries[name].obj

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[Entry[T]]:
        """The entries under their own names (aliases are not repeated)."""
        self._load()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)


ATTACKS: Registry[Any] = Registry("attack", home="gradleak.attacks")
DEFENSES: Registry[Any] = Registry("defense", home="gradleak.defenses")
DATASETS: Registry[Any] = Registry("dataset")
METRICS: Registry[Any] = Registry("metric")
#: the experiment presets, registered by the modality plug-ins (:func:`gradleak.modalities.register_experiment`)
EXPERIMENTS: Registry[Any] = Registry("experiment", home="gradleak.modalities._discover")


def load_all() -> None:
    """Import every module that registers something (so ``gradleak list`` sees them all)."""
    import importlib

    for mod in (
        "gradleak.data",
        "gradleak.models",
        "gradleak.models.features",  # registers the feature_distance metric
        "gradleak.peft",
        "gradleak.defenses",
        "gradleak.metrics",
        "gradleak.modalities._discover",  # registers the modalities and their experiment presets
        "gradleak.attacks",
        "gradleak.config",
    ):
        importlib.import_module(mod)
