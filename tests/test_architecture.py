"""The layout's rules, read from the source: what may import what, where a ConfigDict may be seen,
which modules name an input kind, one lock implementation, and modules of a readable size."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train.py", "sweep.py", "inference.py"}  # inference.load parses a run folder's config
SCRIPTS = {"train", "sweep", "prepare_catalog"}  # run, never imported (inference is also the Python API: train.py's predict mode uses it)
MAY_IMPORT_ML_COLLECTIONS = ENTRY_POINTS  # and configs/, benchmarks/ (not read here)
KIND_FREE = ("trainer.py", "evaluation.py", "inference.py", "translator.py", "input_pipeline.py", "decoding.py", "run_setup/run.py",
             "run_setup/preflight.py", "run_setup/cluster.py")  # fmt: skip
TRAINING_AND_DATA = {"trainer", "evaluation", "inference", "input_pipeline", "run_setup", "settings", "sources", "tasks",
                     "vocabularies", "checkpoints", "files", "reporting", "train", "sweep", "sweeps", "configs"}  # fmt: skip


def project_modules() -> list[Path]:
    """The project's modules: the root's and its folders', not hidden folders' (.venv, .venv-prepare)."""
    folders = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in {"tests", "benchmarks", "configs"}]
    return sorted([*ROOT.glob("*.py"), *(p for folder in folders for p in folder.rglob("*.py"))])


def imported(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, anywhere in it."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def module_name(path: Path) -> str:
    """`run_setup/run.py` -> `run_setup.run`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports when it runs (not under `if TYPE_CHECKING:`). `from
    package import module` imports that module: the package's `__init__` is not an edge of it."""
    tree = ast.parse(path.read_text())
    typing_only = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for statement in node.body for inner in ast.walk(statement)}  # fmt: skip
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            names |= submodules if len(submodules) == len(node.names) else submodules | {node.module}
    return names & modules - {module_name(path)}


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (module -> the modules it imports) as a path that ends where it starts, or []."""
    done, path = set(), []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for imported_module in sorted(graph[module]):
            if cycle := visit(imported_module):
                return cycle
        done.add(path.pop())
        return []

    return next((cycle for module in sorted(graph) if (cycle := visit(module))), [])


def test_import_cycle_finds_a_cycle_and_only_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d2"}, "d2": {"d"}}) == ["d", "d2", "d"]


def test_nothing_imports_upward():
    """Every import points down a floor: the project's imports have no cycle (so its modules
    stack in floors), and no module imports a script (train.py, sweep.py, prepare_catalog.py)."""
    paths = {module_name(p): p for p in project_modules()}
    graph = {name: project_imports(path, set(paths)) for name, path in paths.items()}
    assert import_cycle(graph) == []
    assert {name: sorted(graph[name] & SCRIPTS) for name in graph if graph[name] & SCRIPTS} == {}
    assert graph["tasks.catalog"] >= {"catalog_names"} and graph["models.transformer"] >= {"models.attention"}  # the reading sees imports


def test_below_the_entry_points_nothing_imports_ml_collections():
    seeing = [str(p.relative_to(ROOT)) for p in project_modules() if "ml_collections" in imported(p)]
    assert set(seeing) <= MAY_IMPORT_ML_COLLECTIONS, seeing


def test_models_import_nothing_of_training_or_data():
    for path in (ROOT / "models").glob("*.py"):
        assert not imported(path) & TRAINING_AND_DATA, (path.name, imported(path) & TRAINING_AND_DATA)


@pytest.mark.parametrize("name", KIND_FREE)
def test_the_loop_the_pipeline_and_the_decoder_name_no_input_kind(name):
    literals = {node.value for node in ast.walk(ast.parse((ROOT / name).read_text())) if isinstance(node, ast.Constant)}
    assert not literals & {"image", "text", "pixels", "features"}, name


def test_one_lock_implementation():
    users = [str(p.relative_to(ROOT)) for p in project_modules() if {"fcntl", "filelock"} & imported(p)]
    assert users == ["files.py"], users


def test_no_top_level_module_is_over_500_lines():
    long = {p.name: n for p in ROOT.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_readme_lists_the_registered_scores():
    import scores

    readme = (ROOT / "README.md").read_text()
    assert "\n".join("  " + line for line in scores.markdown_table().splitlines()) in readme
