"""Test set-up shared by every test module.

Eight host devices are forced before JAX is imported anywhere, so multi-device
tests (data parallelism over a Mesh) run on this CPU-only machine.
"""

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

# One compilation cache for the session, shared with the train.py and sweep.py processes the
# tests start and with the other pytest-xdist workers (they inherit the first process's
# environment): the many tiny runs compile the same programs, and a cache hit halves a run.
# Fresh per session, so every run of the suite does the same work.
# the first process: pytest itself, or xdist's controller
if "ATTEND_TEST_COMPILATION_CACHE" not in os.environ:
    os.environ["ATTEND_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="attend_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["ATTEND_TEST_COMPILATION_CACHE"], ignore_errors=True)
os.environ.update(
    JAX_COMPILATION_CACHE_DIR=os.environ["ATTEND_TEST_COMPILATION_CACHE"],
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
)
from helpers.tiny import first_devices_mesh, tiny_config, xla_flags  # noqa: E402,F401  (re-exported for the tests)

# The project's modules byte-compiled once, by the first process: where PYTHONDONTWRITEBYTECODE is
# set (as on the CI machine) no process writes them, so each of the suite's ~100 Python processes
# compiled the project's sources again on import (0.1 s of a train.py process's 1.7 s of imports).
# compileall writes them whatever that variable says, and Python reads them either way.
if "PYTEST_XDIST_WORKER" not in os.environ:
    import compileall
    import re

    root = Path(__file__).resolve().parents[1]
    # not the virtual environments (pip compiled them), the data or the runs
    compileall.compile_dir(root, quiet=1, rx=re.compile(re.escape(str(root)) + r"[\\/](\.venv|data|runs)"))

# xdist's workers inherit it from the controller
if xla_flags(8) not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS on purpose)

# The data-parallel tests compare 8 devices with 1; without the forced devices they would
# test nothing. (Fails if JAX was imported before this file, e.g. by a plugin.)
assert jax.device_count() == 8, f"expected 8 forced host devices, got {jax.device_count()}: is XLA_FLAGS set too late?"

# The NumPy references are float64; JAX code under test stays float32 unless a
# test asks otherwise.
jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

from run_setup.settings import parse


def pytest_collection_modifyitems(items):
    """The slow tests first (a stable sort: otherwise in their order). Two workers share the work
    (`--dist worksteal`); a 40-second test that started last kept one of them busy alone at the
    end of the run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_configure(config):
    from utils import allocator

    # as train.py's processes do: the tests trace hundreds of programs
    allocator.collect_garbage_less_often()
    config.addinivalue_line(
        "markers", "all_devices: the test's in-process runs use all 8 forced devices (default: one)"
    )
    config.addinivalue_line("markers", "curves: the test's in-process runs draw curves.png (default: not)")
    config.addinivalue_line(
        "markers", "slow: starts several processes or trains to a result (over ~10 s); -m 'not slow' leaves them out"
    )


@pytest.fixture(autouse=True)
def one_device_unless_marked(request, monkeypatch):
    """In-process runs (`prepare_run` without `devices`) train on one of the 8 forced devices unless the
    test is marked `all_devices`: eight host devices on two cores make a tiny run's step about twice as
    slow, and only the tests of data parallelism and sharding are about the device count. (Fixtures of a
    wider scope are set up before this one: `finished_run` applies the same patch itself.)"""
    if request.node.get_closest_marker("all_devices") is None:
        from run_setup import run

        monkeypatch.setattr(run, "make_mesh", first_devices_mesh(1))


@pytest.fixture(autouse=True)
def no_curves_unless_marked(request, monkeypatch):
    """In-process runs draw no `curves.png` unless the test is marked `curves`: drawing it is about
    a third of a tiny run's final evaluation, and only the tests of the picture look at it. The page
    (`report.html`) is still written. Runs in subprocesses are told so by their config
    (`--config.curves_png=false`: helpers/subprocess_runs.py's `TINY_FLAGS`, helpers/tiny.py's
    `two_process_config`), except where a test looks at the picture and the README's commands, which
    run as users' do.
    (`finished_run`, set up before this, draws it.)"""
    if request.node.get_closest_marker("curves") is None:
        from report import pages

        monkeypatch.setattr(pages, "write_curves", lambda rows, path: None)


@pytest.fixture(scope="session")
def shared_data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


def session_folder(tmp_path_factory) -> Path:
    """The test session's base folder, which both xdist workers share (a worker's own base folder
    is one of its subfolders)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A tiny Transformer trained 20 steps on dates, evaluated at 10 and 20, with pictures:
    `(config, workdir, final eval results)`. Tests that change the folder work on a copy. Made once
    for the whole session, both xdist workers included (the first to ask makes it under a lock in
    their shared folder, its data beside it; the final results kept as JSON for the other)."""
    import filelock

    from engine import training_loop
    from run_setup import run

    folder = session_folder(tmp_path_factory) / "finished_run"
    workdir, results = folder / "run", folder / "final.json"
    config = tiny_config(folder / "tfds", visualize_examples=3)
    with filelock.FileLock(str(folder.parent / "finished_run.lock")):
        if not results.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            # one device, as the tests that use it evaluate it
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(run, "make_mesh", first_devices_mesh(1))
                final = training_loop.train_and_evaluate(parse(config), workdir)
            results.write_text(json.dumps(final))
    return config, workdir, json.loads(results.read_text())


@pytest.fixture(scope="session")
def whole_tiny_run(tmp_path_factory):
    """train.py on the tiny flags and `WHOLE_RUN_FLAGS` (60 steps, checkpoints every 20, evaluations at
    30 and 60), uninterrupted, in a subprocess: the run folder that runs cut by a kill or a stop are
    compared with. Read only. Made once for the whole session, both xdist workers included (the first
    to ask makes it under a lock, in their shared base folder, with its data beside it: `.parent / "data"`)."""
    import filelock

    from helpers.subprocess_runs import WHOLE_RUN_FLAGS, run_train_py

    shared = session_folder(tmp_path_factory)
    workdir = shared / "whole_tiny_run" / "run"
    with filelock.FileLock(str(shared / "whole_tiny_run.lock")):
        if not (workdir / "eval" / "step_60.json").exists():
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.parent.mkdir(exist_ok=True)
            process = run_train_py(workdir, workdir.parent / "data", *WHOLE_RUN_FLAGS)
            output = process.communicate(timeout=300)[0]
            assert process.returncode == 0, output
    return workdir
