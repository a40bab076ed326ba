"""The package's shape: no import cycles (function-local imports included), no function over 80 lines,
and the core modules name no backend."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxgpt"
CORE = ("model.py", "cache.py", "sampling.py", "attention.py")


def _modules() -> dict:
    """module name -> parsed source, for every module of the jaxgpt package."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()))
    return out


def _imports(name: str, path: pathlib.Path, tree: ast.AST, known: set) -> set:
    """The jaxgpt modules that `name` imports anywhere in its source (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, tree, known) for name, (path, tree) in mods.items()}


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    # the package's __init__ re-exports the public API; nothing inside the package imports it back
    assert not [m for m, deps in graph.items() if "jaxgpt" in deps], "a module imports the jaxgpt package itself"
    assert _cycles(graph) == []


def test_config_imports_only_leaf_modules():
    graph = import_graph()
    for dep in graph["jaxgpt.config"]:
        assert graph[dep] == set(), f"jaxgpt.config imports {dep}, which imports {graph[dep]}"


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, tree in _modules().values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []


def test_the_core_names_no_backend():
    pattern = re.compile(r"cpu\.|native\.|panels|merged|kernel_layout")
    hits = [f"{name}:{i}: {line.strip()}" for name in CORE
            for i, line in enumerate((ROOT / name).read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
