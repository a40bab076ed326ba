"""Named registries of interchangeable parts (attention functions, blocks); imports nothing from jaxgpt.

GPTConfig validates its `attention` and `block` fields against these names, and the model looks the
parts up here, so a new variant is one function or class plus one `register` line. A name is taken once:
registering it again needs `replace=True`, and the registry remembers which of jaxgpt's own parts
(`builtin=True`) were replaced, so a backend's own kernel for a built-in name stands down for the
replacement.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _definition(part) -> tuple:
    """Where `part` was defined (module, qualified name), or None where that does not name it (a lambda,
    a functools.partial): a module run again or a notebook cell run twice defines the same part again."""
    module, qualname = getattr(part, "__module__", None), getattr(part, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<lambda>" in qualname:
        return None
    return module, qualname


class Registry(Generic[T]):
    """A name -> part table with a decorator to fill it and a lookup that lists the choices on a miss."""

    def __init__(self, kind: str):
        self.kind = kind
        self._parts: dict[str, T] = {}
        self._builtin: dict[str, T] = {}  # name -> the part jaxgpt itself registered under it

    def register(self, name: str, *, replace: bool = False, builtin: bool = False) -> Callable[[T], T]:
        """Decorator: make the decorated part available under `name`. A name already taken needs
        `replace=True`, unless the part is the same definition run again (a re-run cell, a reloaded module);
        `builtin=True` is for jaxgpt's own parts."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r} "
                             f"({type(name).__name__})")

        def add(part: T) -> T:
            old = self._parts.get(name)
            again = old is not None and _definition(old) is not None and _definition(old) == _definition(part)
            if old is not None and not replace and not again:
                which = "jaxgpt's built-in" if name in self._builtin else "the"
                raise ValueError(f"{self.kind} {name!r} is already registered ({which} {_describe(old)}); "
                                 f"pass replace=True to replace it, or choose another name")
            self._parts[name] = part
            if builtin:
                self._builtin[name] = part
            return part
        return add

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's or notebook's temporary part)."""
        self._parts.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._parts))

    def builtin_names(self) -> tuple[str, ...]:
        """The names jaxgpt registered its own parts under."""
        return tuple(sorted(self._builtin))

    def builtin(self, name: str) -> T:
        """The part jaxgpt registered as `name`, replaced or not (KeyError for a name it did not)."""
        return self._builtin[name]

    def replaced(self, name: str) -> bool:
        """Whether `name` is one of jaxgpt's built-ins now holding another part: a backend's own kernel
        for it computes the built-in, so it must not stand in for the replacement."""
        return name in self._builtin and self._parts.get(name) is not self._builtin[name]

    def get(self, name: str) -> T:
        try:
            return self._parts[name]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {self.names()}") from None


def _describe(part) -> str:
    where = _definition(part)
    return ".".join(where) if where else repr(part)


ATTENTION: Registry = Registry("attention implementation")
BLOCKS: Registry = Registry("block")
# The backends `resolve` can build (jaxgpt/backends/); "auto" picks one by JAX's default backend.
BACKEND_NAMES = ("auto", "portable", "cpu", "tpu", "gpu")
