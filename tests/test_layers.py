"""No upward import: every `hybridflow` import follows the layer table of docs/design.md, section 2.

The table is the one copy of the order: this test reads its `packages` column
(bottom to top), walks every module under hybridflow/ with `ast` and maps each
`import hybridflow.X` / `from hybridflow.X import ...` (module level, inside
functions, under TYPE_CHECKING) to its package. A package may import its own
modules and packages in lower layers; an import of a package in the same or a
higher layer fails, naming the file, the line and the import. Inside a package,
no two modules may import each other either, directly or around a longer
circle (test_no_import_circle), at module or function level.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridflow"
DESIGN = ROOT / "docs" / "design.md"

def layer_table() -> list[tuple[str, ...]]:
    """The `packages` column of docs/design.md section 2, bottom layer first."""
    text = DESIGN.read_text()
    section = text[text.index("## 2. Layers"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split("|") for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    layers = [tuple(re.findall(r"`([\w.]+)`", row[3])) for row in rows]
    assert layers and all(layers), f"no layer table with a packages column in {DESIGN}"
    return layers


LAYERS = layer_table()
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
LEAVES = set(LAYERS[0])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit(module: str) -> str:
    """The table's name for a hybridflow module: its most specific listed prefix, else its package."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER_OF:
            return ".".join(parts[:n])
    return parts[0] if parts else "hybridflow"


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported hybridflow module) for every import in the file, at any depth."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing file's package
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from hybridflow.rollout import hf` imports the module hybridflow.rollout.hf
            targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):  # once per import statement, in order
            if target == "hybridflow" or target.startswith("hybridflow."):
                yield node.lineno, target


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def upward_imports() -> list[tuple[str, str, str]]:
    """(file, imported package, message) for each import of a package in the same or a higher layer."""
    found = []
    for path in sources():
        here = unit(module_name(path))
        for line, target in imports(path):
            there = unit(target)
            if there == here or there not in LAYER_OF or here not in LAYER_OF:
                continue  # within one package; unlisted packages fail test_every_package_is_in_the_table
            if LAYER_OF[there] >= LAYER_OF[here]:
                way = "up" if LAYER_OF[there] > LAYER_OF[here] else "sideways"
                found.append((rel(path), there, f"{rel(path)}:{line}: {here} (layer {LAYER_OF[here]}) imports "
                              f"{target} ({there}, layer {LAYER_OF[there]}): {way}"))
    return found


def test_every_package_is_in_the_table():
    packages = {unit(module_name(path)) for path in sources()}
    assert packages - set(LAYER_OF) == set(), (
        f"packages missing from the layer table of {rel(DESIGN)}: {sorted(packages - set(LAYER_OF))}")
    listed = {name for name in LAYER_OF if not is_module(f"hybridflow.{name}") and name != "hybridflow"}
    assert listed == set(), f"the layer table of {rel(DESIGN)} lists modules that do not exist: {sorted(listed)}"


def test_no_package_imports_one_above_it():
    found = [message for path, there, message in upward_imports()]
    assert not found, ("imports against the layer order of docs/design.md section 2 (move the code down, or "
                       "pass the object in from above):\n" + "\n".join(found))


def test_a_leaf_loads_only_leaves():
    """Importing a leaf runs its package's __init__ first, so that file may import only leaves too."""
    found = []
    for leaf in sorted(LEAVES):
        parents = leaf.split(".")[:-1]
        init = PACKAGE.joinpath(*parents, "__init__.py")
        if not parents:
            continue
        found += [f"{rel(init)}:{line}: imports {target}, so importing the leaf {leaf} loads it"
                  for line, target in imports(init) if unit(target) not in LEAVES]
    assert not found, "\n".join(found)



def import_graph() -> dict[str, set[str]]:
    """module -> the hybridflow modules importing it runs: each imported module, and each package __init__
    above it that the importer is not already inside (importing a.b.c runs a/__init__ and a/b/__init__)."""
    graph: dict[str, set[str]] = {}
    for path in sources():
        here = module_name(path)
        edges = graph.setdefault(here, set())
        for _, target in imports(path):
            while target and not is_module(target):
                target = target.rpartition(".")[0]
            parts = target.split(".")
            for n in range(1, len(parts) + 1):
                module = ".".join(parts[:n])
                if module != here and not here.startswith(module + ".") and is_module(module):
                    edges.add(module)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a, b, ..., a) through each strongly connected part of `graph` with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    parts: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while not part or w != v:
                w = stack.pop()
                part.add(w)
            if len(part) > 1:
                parts.append(part)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for part in parts:  # a shortest way back to the part's first module, by breadth-first search inside it
        start = min(part)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & part):
                if w == start:
                    circles.append(paths[v] + [start])
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return circles


def test_no_import_circle():
    """No two modules import each other, directly or around a longer circle, at module or function level:
    an import inside a function that only breaks a circle at run time counts as one."""
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
