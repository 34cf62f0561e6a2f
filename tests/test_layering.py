"""The package's floors (docs/design.md, "Layers"): every import points down, none sideways between
sibling packages of one floor, and no modules import each other round in a cycle.

Every import counts: at module level and inside functions (an import deferred to call time is
still a dependency), relative ones resolved. An import names the deepest module it reaches
(`from ..core.plan import Plan` is allocmoe.core.plan; `from . import deepseek` is the submodule);
importing a module also runs its packages' `__init__`, which is not counted as an edge.

The floors, lowest first. A unit is a top-level module or package of allocmoe; units on one floor
are siblings and import nothing from each other; anything may import a lower floor. The package's
own `__init__` (the public names) and `__main__` stand on top: nothing inside imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "allocmoe"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),                   # AllocMoeError, Interrupted; __version__
    ("core",),                               # pure: budgets, plans, policies, the solver, files
    ("routing", "texts"),                    # plans on a live model; the built-in texts and UTF-8 files
    ("models", "scoring"),                   # loading a model; perplexity of a model on text, in windows
    ("calibrate", "measure", "serve", "integrations"),   # making plans; measuring them; serving; engines
    ("pipelines",),                          # the sweep: calibrate and measure, budget by method
    ("cli",),                                # the command line
    ("__init__", "__main__"),                # the public names; `python -m allocmoe`
]

FLOOR = {unit: floor for floor, units in enumerate(LAYERS) for unit in units}


def module_names() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__.py`)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("allocmoe",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def deepest(name: str, modules: dict[str, Path]) -> str:
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module, line) for every allocmoe import in the file, function-level ones included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(deepest(alias.name, modules), node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "allocmoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "allocmoe":
                continue
            for alias in node.names:                     # `from pkg import submodule` names the submodule
                found.append((deepest(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source,
                                      modules), node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, int]]]:
    modules = module_names()
    return {name: [(target, line) for target, line in imports(name, path, modules) if target != name]
            for name, path in modules.items()}


def unit(module: str) -> str:
    """The floor's unit a module belongs to: allocmoe.core.plan -> core; allocmoe -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_module_is_on_a_floor():
    units = {unit(name) for name in module_names()}
    assert units <= set(FLOOR), f"put these in LAYERS (and docs/design.md): {sorted(units - set(FLOOR))}"


def test_imports_point_down():
    wrong = []
    for module, targets in graph().items():
        for target, line in sorted(set(targets), key=lambda t: t[1]):
            here, there = unit(module), unit(target)
            if here == there:
                continue                                 # within one unit: the cycle test has those
            if FLOOR[there] > FLOOR[here]:
                wrong.append(f"{module} imports {target} (layer {here} -> higher layer {there}), line {line}")
            elif FLOOR[there] == FLOOR[here]:
                wrong.append(f"{module} imports {target} (layer {here} -> sibling layer {there}), line {line}")
    assert not wrong, "imports against the layers (docs/design.md):\n" + "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    edges = {module: {target for target, _ in targets} for module, targets in graph().items()}
    found = cycles(edges)
    lines = []
    for component in found:
        members = set(component)
        lines.append(f"{len(component)} modules import each other round: " + ", ".join(component))
        lines += [f"  {module} imports {target} at line {line}" for module in component
                  for target, line in sorted(set(graph()[module]), key=lambda t: t[1]) if target in members]
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(lines)


def test_the_checks_see_function_level_and_relative_imports(tmp_path):
    """The walker itself: an import inside a function, relative at depth 2, is found and resolved."""
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from ..core.plan import Plan\n    from . import sibling\n")
    modules = {"allocmoe.core.plan": Path(), "allocmoe.core": Path(), "allocmoe.serve.sibling": Path(),
               "allocmoe.serve": Path(), "allocmoe": Path()}
    assert imports("allocmoe.serve.x", source, modules) == [("allocmoe.core.plan", 2), ("allocmoe.serve.sibling", 3)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
