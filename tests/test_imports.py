"""Imports flow one way: no module of glm46_jax imports, directly or through others, a module that imports it back.

Read from the source (every `import` and `from ... import`, at module level or inside a function: a late import
only hides a cycle), with Python's package rule that importing `a.b.c` first runs `a.b`'s `__init__`.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
PACKAGE = "glm46_jax"


def modules() -> dict[str, str]:
    """{dotted name: path} of every module of the package."""
    out = {}
    for directory, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(directory, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: str, known: dict[str, str]) -> set[str]:
    """The package's modules `name` imports, with the packages whose `__init__` those imports run."""
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    out = set()
    for target in found:
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        if target not in known or target == PACKAGE:
            continue
        # Importing a.b.c runs a.b's __init__ too, unless `name` is inside a.b (already being imported).
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep != name and not name.startswith(dep + "."):
                out.add(dep)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert len(graph) > 40 and graph["glm46_jax.train"]  # it read the package
    assert cycles(graph) == []


def test_packages_import_one_way():
    """The folders are the architecture: no package (recipes, training, monitoring, data, infer, interop, model,
    parallel) imports one that imports it back, through any of their modules."""
    known = modules()
    package = {name: ".".join(name.split(".")[:2]) for name in known}  # glm46_jax.<package or top-level module>
    graph: dict[str, set[str]] = {p: set() for p in package.values()}
    for name, path in known.items():
        deps = {package[dep] for dep in imports_of(name, path, known)}
        graph[package[name]].update(deps - {package[name]})
    assert len(graph) > 15 and "glm46_jax.training" in graph["glm46_jax.recipes"]  # it read the packages
    assert cycles(graph) == []


# README "Layout", top to bottom: a package or top-level module imports only what sits in a lower layer.
LAYERS = [
    {"rlhf"},  # a pipeline over train's stages
    {"train", "bench", "plan", "generate", "score", "eval", "harness", "convert"},  # the command lines
    {"plan_search"},  # the plan tool's layout search: it gets the planning as a callable
    {"recipes"},
    {"run_config"},
    {"infer"},
    {"interop"},
    {"training"},
    {"monitoring"},
    {"data"},
    {"model"},
    {"parallel"},
    {"config"},
    {"cli"},
    {"errors", "atomic", "host"},
]


def test_packages_import_only_lower_layers():
    known = modules()
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    top = {name: name.split(".")[1] for name in known if name != PACKAGE}
    assert set(top.values()) == set(layer), "a package or top-level module is missing from LAYERS (or gone)"
    upward = sorted(f"{name} imports {dep}" for name, path in known.items() if name != PACKAGE
                    for dep in imports_of(name, path, known)
                    if top[dep] != top[name] and layer[top[dep]] <= layer[top[name]])
    assert upward == []


def test_the_cycle_finder_finds_a_cycle_through_a_package_init():
    """a.x imports b.y; b's __init__ imports a.z (a.x and a.z sit in package a, whose __init__ is empty)."""
    graph = {"p.a": set(), "p.a.x": {"p.b", "p.b.y"}, "p.b": {"p.a", "p.a.z"}, "p.b.y": set(), "p.a.z": {"p.a.x"}}
    assert cycles(graph) == [["p.a.x", "p.a.z", "p.b"]]
