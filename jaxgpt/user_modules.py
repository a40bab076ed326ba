"""The user's modules that register parts (blocks, attention functions): imported by name
(`--config.imports`, `jaxgpt-sample --import`), recorded in a run, and named when a run's part is missing.
Imports nothing from jaxgpt but the registry."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Sequence, Union

from jaxgpt.registry import ATTENTION, BLOCKS, Registry

# the GPTConfig fields that name a registered part, and their registries
PARTS: dict[str, Registry] = {"block": BLOCKS, "attention": ATTENTION}

Names = Union[None, str, Sequence[str]]


class MissingPart(ValueError):
    """A model names a block or attention that no imported module has registered."""


def module_names(value: Names, flag: str = "--import") -> list[str]:
    """Module names from a comma-separated string, or a list of such strings; duplicates dropped."""
    if value is None:
        return []
    out = []
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if not isinstance(item, str):
            raise ValueError(f"{flag}: module names must be strings such as 'mypkg.blocks', got {item!r}")
        for name in (part.strip() for part in item.split(",")):
            if name and name not in out:
                out.append(name)
    return out


def import_modules(value: Names, flag: str = "--import") -> list[str]:
    """Import each module `value` names (from sys.path or the current directory); ValueError naming `flag`
    for one that cannot be found. Errors inside a module that is found (the user's code) propagate."""
    names = module_names(value, flag)
    for name in names:
        _import(name, flag)
    return names


def _import(name: str, flag: str) -> None:
    reason = _try_import(name)
    if reason is not None:
        raise ValueError(f"{flag}={name}: {reason}")


def _try_import(name: str):
    """Import module `name`; None once imported, else why it could not be (a name that is not a module's,
    a module not found, or an ImportError inside it). Other errors in the user's module propagate."""
    if name.endswith(".py") or "/" in name or os.sep in name:
        return "name a module as Python imports it (mypkg.blocks for mypkg/blocks.py), not a file"
    cwd = os.getcwd()  # the console scripts' sys.path lacks it (python -m puts it first)
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return f"no module named {e.name!r} on PYTHONPATH or in the current directory ({cwd})"
        return f"importing it failed: {e}"  # a module it imports
    except ImportError as e:
        return f"importing it failed: {e}"
    return None


def registering_modules(config) -> list[str]:
    """The modules outside jaxgpt that registered the parts `config` (a GPTConfig) names: what a run
    records so that it loads in another process. A part defined in a script run as __main__ is left out
    (no other process can import it by that name)."""
    out = []
    for field, registry in PARTS.items():
        module = getattr(registry.get(getattr(config, field)), "__module__", None)
        if (isinstance(module, str) and module not in out and module != "__main__" and module != "jaxgpt"
                and not module.startswith("jaxgpt.")):
            out.append(module)
    return out


def recorded_imports(named: Names, config) -> list[str]:
    """What a run records as its meta["imports"]: the modules it was told to import (config.imports), then
    the other modules that registered the parts `config` names."""
    return module_names([*module_names(named, "--config.imports"), *registering_modules(config)])


def _missing(model: dict) -> list[tuple[str, str]]:
    return [(field, model[field]) for field, registry in PARTS.items()
            if isinstance(model.get(field), str) and model[field] not in registry.names()]


def require_parts(model: dict, recorded: Names = None, flag: str = "--import", whose: str = "this run's") -> None:
    """Make sure the parts a model's fields (`model`: GPTConfig.to_dict()) name are registered, importing the
    `recorded` modules if one is not; MissingPart naming the part and the module(s) to import otherwise."""
    if not _missing(model):
        return
    recorded = module_names(recorded, flag)
    failed = {name: reason for name in recorded if (reason := _try_import(name)) is not None}
    missing = _missing(model)
    if not missing:
        return
    field, part = missing[0]
    said = f"{whose} {field} {part!r} is not registered (registered: {', '.join(PARTS[field].names())})"
    if not recorded:
        raise MissingPart(f"{said}; name the module that registers it: {flag}=MODULE (importable from "
                          "PYTHONPATH or the current directory)")
    names = ", ".join(repr(n) for n in recorded)
    which = f"module {names}" if len(recorded) == 1 else f"one of the modules {names}"
    if failed:
        why = "; ".join(r if len(failed) == 1 else f"{n}: {r}" for n, r in failed.items())
        raise MissingPart(f"{said}; it was registered by {which} (pass {flag}={','.join(recorded)}, and make "
                          f"sure it is importable: {why})")
    raise MissingPart(f"{said}, and importing {which}, which the run records, did not register it; pass "
                      f"{flag}=MODULE naming the module that registers it now")
