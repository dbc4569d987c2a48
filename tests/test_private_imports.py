"""No module imports another module's private name (docs/conventions.md, STYLE rule 16).

A name two modules share is public: `from hybridflow.x import _helper` in any module but `hybridflow.x`
fails, naming the file, the line and the name. Walks every module under hybridflow/ with `ast`, imports
at any depth included (inside functions, under TYPE_CHECKING).
"""
from __future__ import annotations

import ast

from tests.test_layers import module_name, rel, sources


def private_imports() -> list[str]:
    found = []
    for path in sources():
        here = module_name(path)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:  # relative: resolved against the importing file's package
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base != here and (base == "hybridflow" or base.startswith("hybridflow.")):
                found += [f"{rel(path)}:{node.lineno}: imports {alias.name} from {base}"
                          for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_no_module_imports_another_modules_private_name():
    found = private_imports()
    assert not found, ("private names imported from another module (drop the underscore, or move the helper "
                       "where both belong):\n" + "\n".join(found))
