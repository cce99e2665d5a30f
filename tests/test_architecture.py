"""The layout's rules, read from the source: what may import what, where a ConfigDict may be seen,
which modules name an input kind, one lock implementation, and root modules of a readable size."""

import ast
import importlib
import importlib.util
import itertools
from pathlib import Path

import pytest

from helpers.source_reading import imported

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train.py", "sweep.py", "inference.py"}
# Run, never imported (inference.py is also the Python API: train.py's predict mode uses it).
SCRIPTS = {"train", "sweep", "tools.prepare_catalog", "tools.compare_runs"}
# inference.load parses a run folder's config; configs/ and benchmarks/ are not read here.
MAY_IMPORT_ML_COLLECTIONS = ENTRY_POINTS
KIND_FREE = (
    "engine/training_loop.py",
    "engine/evaluation.py",
    "engine/restored_model.py",
    "inference.py",
    "input_pipeline.py",
    "scoring/decoding.py",
    "run_setup/run.py",
    "run_setup/preflight.py",
    "run_setup/cluster.py",
)
# The floors, bottom first: a module imports from its own floor or those below it, type-only
# imports included. A root module is a floor of its own; a folder is one floor.
FLOORS = [
    "utils",
    "models",
    "tasks",
    "configs",
    "scoring",
    "report",
    "run_setup",
    "input_pipeline",
    "engine",
    "inference",
    "train",
    "tuning",
    "sweep",
    "tools",
]
# What a model may import of the project: other model modules and the error types.
MODELS_MAY_IMPORT = {"utils", "utils.errors"}
BRIEF_NAMES = {"train.py", "input_pipeline.py", "inference.py", "sweep.py"}


def project_modules() -> list[Path]:
    """The project's modules: the root's and its folders' (configs/ too), not tests/, benchmarks/ or
    hidden folders (.venv, .venv-prepare)."""
    skipped = {"tests", "benchmarks"}
    folders = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".") and d.name not in skipped]
    return sorted([*ROOT.glob("*.py"), *(p for folder in folders for p in folder.rglob("*.py"))])


def module_name(path: Path) -> str:
    """`run_setup/run.py` -> `run_setup.run`; a package's `__init__.py` -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path, modules: set[str], *, typing_too: bool = False) -> set[str]:
    """The project modules `path` imports when it runs (with `typing_too`, also those under `if
    TYPE_CHECKING:`). `from package import module` imports that module: the package's `__init__`
    is not an edge of it."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    if not typing_too:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                typing_only |= {id(inner) for statement in node.body for inner in ast.walk(statement)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            names |= submodules if len(submodules) == len(node.names) else submodules | {node.module}
    own = module_name(path) if path.is_relative_to(ROOT) else None
    return names & modules - {own}


def floor_of(module: str) -> str:
    """`engine.evaluation` -> `engine`; a root module is its own floor."""
    return module.split(".")[0]


def import_graph(*, typing_too: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    paths = {module_name(p): p for p in project_modules()}
    return {name: project_imports(path, set(paths), typing_too=typing_too) for name, path in paths.items()}


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


def test_every_import_of_a_project_module_resolves():
    """A module moved or renamed with an importer left behind: the benchmarks, tools and test
    helpers are run by hand, not all by the tests (benchmarks/wmt_sized_corpus.py imported a module
    the move to folders had renamed)."""
    ours = {p.stem for p in ROOT.glob("*.py")} | {d.name for d in ROOT.iterdir() if (d / "__init__.py").exists()}
    scripts = [*project_modules(), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests" / "helpers").glob("*.py")]
    broken = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                wanted = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in wanted:
                if module.split(".")[0] not in ours:
                    continue
                if importlib.util.find_spec(module) is None:
                    broken.append(f"{path.relative_to(ROOT)}: no module {module}")
                elif name and not hasattr(importlib.import_module(module), name):
                    if importlib.util.find_spec(f"{module}.{name}") is None:
                        broken.append(f"{path.relative_to(ROOT)}: {module} has no {name}")
    assert not broken, broken


def test_import_cycle_finds_a_cycle_and_only_a_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d2"}, "d2": {"d"}}) == ["d", "d2", "d"]


def test_nothing_imports_upward():
    """Every import points down a floor or stays on its own: the module graph has no cycle, type-only
    imports included, and no module imports one of a floor above its own, or a script."""
    graph = import_graph(typing_too=True)
    assert import_cycle(graph) == []
    assert {floor_of(name) for name in graph} == set(FLOORS)
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if FLOORS.index(floor_of(target)) > FLOORS.index(floor_of(name))
    )
    assert upward == []
    assert {name: sorted(graph[name] & SCRIPTS) for name in graph if graph[name] & SCRIPTS} == {}
    # The reading sees imports, type-only ones included.
    assert graph["tasks.catalog"] >= {"utils.tfds_names"} and graph["models.transformer"] >= {"models.attention"}


def test_no_relative_imports():
    """Every import names its module from the root, so the floors' reading sees every edge."""
    relative = [
        str(path.relative_to(ROOT))
        for path in project_modules()
        if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(path.read_text())))
    ]
    assert relative == []


def test_the_floor_test_catches_an_upward_import(tmp_path):
    """The floors, checked on a hand-made module: an import of a floor above is seen, under
    TYPE_CHECKING too."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine import evaluation\n")
    known = {"engine", "engine.evaluation"}
    assert project_imports(module, known) == set()
    assert project_imports(module, known, typing_too=True) == {"engine.evaluation"}


def test_the_root_holds_the_brief_names_and_folders():
    modules = {p.name for p in ROOT.glob("*.py")}
    assert modules == BRIEF_NAMES
    for folder in sorted({floor_of(module_name(p)) for p in project_modules()} - {m[:-3] for m in modules}):
        init = ROOT / folder / "__init__.py"
        docstring = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        assert docstring and docstring.strip(), f"{folder}/__init__.py has no docstring"
        assert len(docstring.splitlines()) == 1 and docstring.endswith("."), f"{folder}/__init__.py: one line"


def test_no_two_module_names_read_alike():
    """No two project modules (benchmarks and helpers included) have the same name, or names of
    which one is the other with a short suffix (`report` / `reporting`); a package and the modules
    inside it are told apart by their path (`run_setup.run`). Experiment configs are named by their
    experiment and not counted."""
    paths = [*project_modules(), *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests" / "helpers").glob("*.py")]
    names = {}
    for path in paths:
        if path.parent.name == "configs" and path.stem not in {"base", "recurrent", "__init__"}:
            continue
        name = path.parent.name if path.name == "__init__.py" else path.stem
        if path.name == "__init__.py" and path.parent == ROOT:
            continue
        names.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    alike = [sorted(where) for name, where in names.items() if len(where) > 1]
    for short, long in itertools.permutations(names, 2):
        own_package = any(Path(p).parent.name == short for p in names[long]) or any(
            Path(p).parent.name == long for p in names[short]
        )
        if long.startswith(short) and len(long) - len(short) <= 6 and not own_package:
            alike.append(sorted(names[short] | names[long]))
    assert alike == []


def test_below_the_entry_points_nothing_imports_ml_collections():
    seeing = [str(p.relative_to(ROOT)) for p in project_modules() if "ml_collections" in imported(p)]
    seeing = [name for name in seeing if not name.startswith("configs/")]
    assert set(seeing) <= MAY_IMPORT_ML_COLLECTIONS, seeing


def test_models_import_nothing_of_training_or_data():
    graph = import_graph(typing_too=True)
    outside = {
        name: sorted(t for t in targets if floor_of(t) != "models" and t not in MODELS_MAY_IMPORT)
        for name, targets in graph.items()
        if floor_of(name) == "models"
    }
    assert {name: targets for name, targets in outside.items() if targets} == {}


@pytest.mark.parametrize("name", KIND_FREE)
def test_the_loop_the_pipeline_and_the_decoder_name_no_input_kind(name):
    literals = {node.value for node in ast.walk(ast.parse((ROOT / name).read_text())) if isinstance(node, ast.Constant)}
    assert not literals & {"image", "text", "pixels", "features"}, name


def test_one_lock_implementation():
    users = [str(p.relative_to(ROOT)) for p in project_modules() if {"fcntl", "filelock"} & imported(p)]
    assert users == ["utils/files.py"], users


def test_no_top_level_module_is_over_500_lines():
    long = {p.name: n for p in ROOT.glob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_readme_lists_the_registered_scores():
    from scoring import score_registry

    readme = (ROOT / "README.md").read_text()
    assert "\n".join("  " + line for line in score_registry.markdown_table().splitlines()) in readme


def test_train_py_starts_without_the_libraries_only_its_evaluations_use():
    """matplotlib (pictures) and sacrebleu (BLEU, chrF; it imports lxml) are imported by the functions
    that draw or score, not at start-up (`python -X importtime`, alone: 0.35 s and 0.08 s, the
    machine busy; inside train.py's imports sacrebleu measured 0.12 s)."""
    import subprocess
    import sys

    late = ("matplotlib", "sacrebleu", "lxml")
    script = f"import sys, train; print(sorted(m for m in {late!r} if m in sys.modules))"
    process = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert process.stdout.strip() == "[]", process.stdout + process.stderr
