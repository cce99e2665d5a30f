"""README.md and docs/ against the code: the README's size and its code map, every link and anchor,
and every command they show, read as written (the script and its flags exist, the make target
exists, a config file loads with its overrides, `python -c` code compiles and its imports resolve)."""

import ast
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_START = re.compile(r"^(?:srun [^p]*)?(?:\.venv(?:-prepare)?/bin/)?(python|make) ")
# Flags every absl script takes.
ABSL_FLAGS = {"flagfile", "help", "verbosity", "v", "logtostderr", "alsologtostderr"}
# The placeholders the pages write where the reader puts their own run, file or value.
PLACEHOLDER = re.compile(r"NAME|\.\.\.|<[^>]*>|\bFILE\b|\bDIR\b|\bRUN\b|\bSTEP\b|\bGRID\b")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def links(page: Path) -> list[tuple[str, str]]:
    """`(target path, anchor)` of every relative markdown link of `page`."""
    text = page.read_text()
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def commands(page: Path) -> list[str]:
    """The shell commands `page` shows: lines of its fenced blocks and inline code spans that start
    a python script or make, with continuation lines joined and trailing comments left out."""
    text = page.read_text()
    pieces = []
    for block in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        if block[0] not in ("", "sh", "bash", "shell"):
            continue
        joined = re.sub(r"\\\n\s*", "", block[1])
        pieces += joined.splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    pieces += re.findall(r"`([^`\n]+)`", re.sub(r"\n\s*", " ", prose))
    found = []
    for piece in pieces:
        piece = piece.strip()
        if COMMAND_START.match(piece):
            # a comment after the command, as the pages write them: two spaces or more, then #
            found.append(re.split(r"\s{2,}#", piece)[0].strip())
    return found


def defined_flags(script: Path) -> set[str]:
    """The flag names `script` defines: absl's `DEFINE_*`, argparse's `add_argument`."""
    tree = ast.parse(script.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith("DEFINE"):
            if node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
        # argparse's options (tools/prepare_catalog.py)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names |= {a.value[2:] for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
        # flags defined in a loop over their names: `for name in ("text", ...): DEFINE_string(name, ...)`
        if isinstance(node, ast.For) and "DEFINE" in ast.unparse(node) and isinstance(node.iter, (ast.Tuple, ast.List)):
            names |= {e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return names


def check_python_c(code: str) -> None:
    compile(code, "<-c>", "exec")
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                # a name the module defines, or a submodule of a package
                submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                assert hasattr(module, alias.name) or submodule, f"{node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert importlib.util.find_spec(alias.name) is not None, alias.name


def check_command(command: str) -> None:
    """Raises AssertionError saying what in `command` would not run as written."""
    # optional parts written in brackets are the reader's choice
    words = shlex.split(re.sub(r"\s\[[^\]]*\]", "", command))
    while words[0] in ("srun",) or words[0].startswith("--ntasks"):
        words = words[1:]
    program, *args = words
    # the interpreter's own options (`python -X importtime script.py`)
    while args and args[0] == "-X":
        args = args[2:]
    if program == "make":
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{re.escape(args[0])}:", makefile, flags=re.M), f"no make target {args[0]}"
        return
    if args[0] == "-c":
        check_python_c(args[1])
        return
    script = ROOT / args[0]
    assert script.is_file(), f"no script {args[0]}"
    flags = [a for a in args[1:] if a.startswith("--")]
    known = defined_flags(script) | ABSL_FLAGS
    if script.name == "inference.py":
        # a flag per input kind, named from the kinds' registry
        import inference

        known |= set(inference.FLAGS)
    for flag in flags:
        name = flag[2:].split("=")[0]
        if name.startswith("config."):
            continue
        assert name in known, f"{args[0]} defines no flag --{name}"
    if script.name not in ("train.py", "sweep.py"):
        return
    config = next((f.split("=", 1)[1] for f in flags if f.startswith("--config=")), "configs/default.py")
    if PLACEHOLDER.search(config):
        return
    from configs import base

    path, _, argument = config.partition(":")
    assert (ROOT / path).is_file(), f"no config file {path}"
    overrides = [f for f in flags if f.startswith("--config.") and not PLACEHOLDER.search(f)]
    # raises ConfigError naming a misspelt field, a wrong type or an unparsable value
    base.load(ROOT / config if not argument else f"{ROOT / path}:{argument}", overrides)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_and_anchor_resolves(page):
    broken = []
    for path, anchor in links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{path}#{anchor}: no such heading")
    assert broken == []


# The commands each page shows, about 80% of what it shows today: a page that lost most of its
# commands to a change in their formatting (or in the reading) fails.
LEAST_COMMANDS = {"README.md": 16, "usage.md": 13, "experiments.md": 9, "performance.md": 33}


def test_the_pages_show_commands_and_the_reading_sees_them():
    readme = commands(ROOT / "README.md")
    assert "make train" in readme and "make test" in readme
    assert any(c.startswith(".venv/bin/python train.py --config=configs/kjv_web_transformer.py") for c in readme)
    counts = {page.name: len(commands(page)) for page in PAGES}
    assert all(counts[name] >= least for name, least in LEAST_COMMANDS.items()), counts


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_compiles_and_its_imports_resolve(page):
    for block in python_blocks(page):
        check_python_c(block)


def test_the_command_check_catches_what_would_not_run():
    for wrong in (
        ".venv/bin/python train.py --config=configs/default.py --config.model.d_modl=3",
        ".venv/bin/python train.py --no_such_flag=1",
        ".venv/bin/python benchmarks/no_such_benchmark.py",
        "make no_such_target",
        ".venv/bin/python -c 'import no_such_module_here'",
    ):
        with pytest.raises((AssertionError, ConfigError)):
            check_command(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_runs_as_written(page):
    problems = []
    for command in commands(page):
        try:
            check_command(command)
        except Exception as error:
            problems.append(f"{command}: {error}")
    assert problems == []


def test_the_readme_is_a_map():
    """At most 400 lines; in its first 150, the two commands and a tree of every folder and root
    module, one line each."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400
    head = "\n".join(lines[:150])
    assert "make train" in head and "make test" in head
    tree = re.search(r"## Where everything lives\n.*?```\n(.*?)```", head, flags=re.S)
    assert tree, "no code map in the README's first 150 lines"
    lines = [line for line in tree.group(1).splitlines() if line.strip()]
    mapped = {line.split()[0].rstrip("/") for line in lines}
    ignored = {"runs", "__pycache__"}
    tracked = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") and (p.suffix == ".py" or p.is_dir())}
    assert mapped == tracked - ignored
    # every module a line names exists: a bare name in that line's folder (or the root), a path from the root
    for line in lines:
        entry, description = line.split(maxsplit=1)
        for name in re.findall(r"([\w/]+\.py)\b", description):
            places = [ROOT / name] if "/" in name else [ROOT / entry / name, ROOT / name]
            assert any(place.is_file() for place in places), f"{entry}: no {name}"
