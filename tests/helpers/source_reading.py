"""Reading the project's source: what a module imports."""

import ast
from pathlib import Path


def imported(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names
