"""Named registries of interchangeable parts (attention functions, blocks); imports nothing from jaxgpt.

GPTConfig validates its `attention` and `block` fields against these names, and the model looks the
parts up here, so a new variant is one function or class plus one `register` line.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> part table with a decorator to fill it and a lookup that lists the choices on a miss."""

    def __init__(self, kind: str):
        self.kind = kind
        self._parts: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated part available under `name`."""
        def add(part: T) -> T:
            self._parts[name] = part
            return part
        return add

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's or notebook's temporary part)."""
        self._parts.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._parts))

    def get(self, name: str) -> T:
        try:
            return self._parts[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {self.names()}") from None


ATTENTION: Registry = Registry("attention implementation")
BLOCKS: Registry = Registry("block")
# The backends `resolve` can build (jaxgpt/backends/); "auto" picks one by JAX's default backend.
BACKEND_NAMES = ("auto", "portable", "cpu", "tpu", "gpu")
