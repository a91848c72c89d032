"""One registry pattern for attacks, defenses, datasets, metrics and experiments (DESIGN §2).

Modelled on Opacus' grad-sampler registry: a decorator registers an object under a name together
with a one-line summary, so configs and ``gradleak list`` find it without ``if name == ...`` chains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from gradleak.errors import BadInput

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    obj: T
    summary: str


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, summary: str = "") -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name].obj is not obj:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            doc = summary or ((getattr(obj, "__doc__", "") or "").strip().splitlines() or [""])[0]
            self._entries[name] = Entry(name, obj, doc)
            return obj

        return deco

    def get(self, name: str, field: str | None = None) -> T:
        if name not in self._entries:
            raise BadInput(field or self.kind, f"unknown {self.kind} '{name}'.",
                           f"use one of: {', '.join(sorted(self._entries)) or '(none registered)'}.")
        return self._entries[name].obj

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def names(self) -> list[str]:
        return sorted(self._entries)


ATTACKS: Registry[Any] = Registry("attack")
DEFENSES: Registry[Any] = Registry("defense")
DATASETS: Registry[Any] = Registry("dataset")
METRICS: Registry[Any] = Registry("metric")
EXPERIMENTS: Registry[Any] = Registry("experiment")


def load_all() -> None:
    """Import every module that registers something (so ``gradleak list`` sees them all)."""
    import importlib

    for mod in (
        "gradleak.data",
        "gradleak.models",
        "gradleak.peft",
        "gradleak.defenses",
        "gradleak.metrics",
        "gradleak.attacks",
        "gradleak.experiments",
    ):
        importlib.import_module(mod)
