"""A name → function registry: one per extension point, duplicates refused, and a lookup
error that lists what exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from rlctl.errors import InputError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise InputError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries
