"""The layout's rules, read from the source: what may import what, where a ConfigDict may be seen,
which modules name an input kind, one lock implementation, and modules of a readable size."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train.py", "sweep.py", "inference.py"}  # inference.load parses a run folder's config
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
