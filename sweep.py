"""Hyperparameter sweeps over config fields, on Optuna.

    python sweep.py --config=configs/default.py --sweep=configs/sweeps/smoke.py --workdir=runs/smoke
    python sweep.py ... --parallel=2                           # two local workers on one study
    python sweep.py ... --storage=postgresql://user@host/db    # workers on several machines, one study

A sweep file (`configs/sweeps/NAME.py`, see `smoke.py`) declares the search
space over config fields, the method (grid, random or TPE), the number of
trials, the objective and its direction, and the budget: config overrides
every trial gets. Each trial is a `train.py` run in its own folder
`WORKDIR/trials/trial_<N>`, its output in `log.txt` there. The worker
follows the trial's `metrics.jsonl` and reports the objective at each
evaluation; a median pruner stops trials that lag (SIGTERM: train.py saves
and stops).

The study lives in `WORKDIR/study.journal` (Optuna's journal file, safe for
several processes on one machine) unless `--storage` names a database
(PostgreSQL, or SQLite for one machine). Run the same command again and the
sweep goes on where it stopped: finished trials are never rerun, trials cut
short are queued again and resume from their checkpoint, failed trials stay
recorded with their error.

The first process to open a study records the sweep in it and queues a
grid's points; this happens under a lock that every process opening the
study takes, so sweeps started at the same moment queue each grid point once
and a study made by another sweep is refused. With `--storage=postgresql://`
the lock is in the database (an advisory lock), so it holds between
machines with workdirs of their own; for SQLite it is a file beside the
database, for the journal file one in WORKDIR.

Devices: each of the `--parallel` workers runs one trial at a time, and on
a machine with NVIDIA GPUs (CUDA_VISIBLE_DEVICES, or those `nvidia-smi -L`
lists) with two or more workers, each worker gets a block of its own:
len(GPUs) // N GPUs in CUDA_VISIBLE_DEVICES (the rest stay idle, so every
trial shards alike), and XLA_PYTHON_CLIENT_PREALLOCATE=false unless it is
set; its trials inherit them. More workers than GPUs is refused: two trials on one GPU
contend for its memory and time. One worker, or a machine without GPUs
(or JAX_PLATFORMS without cuda), keeps the environment as it is. TPUs are
not split: run one worker per TPU host.

Results: `WORKDIR/results.md` and `results.csv` (trials by objective, with
overrides, steps, wall time, metrics, and the command that reproduces the
best), and `WORKDIR/objective_by_field.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_collections
import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

import files
from configs import base
from errors import ConfigError
from stopping import StopSignals

PROJECT_ROOT = Path(__file__).resolve().parent
METHODS = ("grid", "random", "tpe")
SPACE_KINDS = ("categorical", "uniform", "log_uniform", "int")
HEARTBEAT_S = 30  # a running trial's worker says it is alive this often
HEARTBEAT_GRACE_S = 300  # ... and is taken for dead after this long without
NOT_SHOWN = ("step", "decoded_examples")  # and per-module metrics (names with "/")
CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "JAX_COORDINATOR_")  # prefixes that make JAX join a cluster
SWEEP_KEYS = ("method", "space", "objective", "direction", "num_trials", "budget", "pruning", "seed")


class SweepError(ConfigError):
    """A bad sweep file, config or flag; the message names the culprit."""


# ---------------------------------------------------------------- the sweep file


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A validated sweep file: see configs/sweeps/smoke.py for the fields."""

    method: str
    space: dict[str, tuple]  # field -> ("categorical", [choices]) | ("uniform"|"log_uniform"|"int", low, high)
    objective: str  # "<split>/<metric>", e.g. "dev/exact_match"
    direction: str  # "maximize" or "minimize"
    num_trials: int
    budget: dict[str, Any]  # config overrides of every trial
    pruning: bool = True
    seed: int = 0

    @property
    def objective_split(self) -> str:
        return self.objective.split("/", 1)[0]

    @property
    def objective_metric(self) -> str:
        return self.objective.split("/", 1)[1]


def override_flags(overrides: dict[str, Any]) -> list[str]:
    """`{"model.d_model": 64}` -> `["--config.model.d_model=64"]`: how a trial's overrides reach train.py."""
    return [f"--config.{name}={format_value(value)}" for name, value in overrides.items()]


def with_overrides(config_path: str | Path, overrides: dict[str, Any], where: str) -> ml_collections.ConfigDict:
    """The config file with `overrides` applied exactly as train.py will apply them (`base.load`);
    an unknown field or a value the field cannot take names `where` and the field."""
    config = base.load(config_path)
    for name, value in overrides.items():  # one at a time, so the message names the field
        if not base.has_field(config, name):
            raise SweepError(f"{where}: unknown config field {name!r}")
        try:
            base.load(config_path, override_flags({name: value}))
        except ConfigError as error:
            raise SweepError(f"{where}: config field {name!r} cannot take {value!r} ({error})") from error
    return base.load(config_path, override_flags(overrides))


def space_values(path: str | Path, name: str, space: Any) -> list:
    """Checks one space and returns the values that stand for it (choices, or the bounds)."""
    where = f"sweep file {path}: space {name!r}"
    if not isinstance(space, (tuple, list)) or not space or space[0] not in SPACE_KINDS:
        raise SweepError(f"{where} must be (kind, ...) with kind one of {', '.join(SPACE_KINDS)}, got {space!r}")
    kind = space[0]
    if kind == "categorical":
        if len(space) != 2 or not isinstance(space[1], (tuple, list)) or not space[1]:
            raise SweepError(f"{where} is an empty space: ('categorical', [choices]) needs at least one choice")
        return list(space[1])
    if len(space) != 3 or not all(isinstance(x, (int, float)) for x in space[1:]):
        raise SweepError(f"{where} must be ({kind!r}, low, high), got {space!r}")
    low, high = space[1:]
    if not low < high:
        raise SweepError(f"{where} is an empty space: low {low} is not below high {high}")
    if kind == "log_uniform" and low <= 0:
        raise SweepError(f"{where}: log_uniform needs low > 0, got {low}")
    if kind == "int" and not (isinstance(low, int) and isinstance(high, int)):
        raise SweepError(f"{where}: int bounds must be integers, got {low!r}, {high!r}")
    return [low, high]


def load_sweep(path: str | Path, config_path: str | Path) -> Sweep:
    """Reads and checks a sweep file against the config it sweeps.

    Raises:
      SweepError: naming the file and the culprit (unknown key or field, empty space, bad method...).
    """
    fields = base.call_in_file(path, "get_sweep", "sweep")
    fields = fields.to_dict() if isinstance(fields, ml_collections.ConfigDict) else dict(fields)
    unknown = sorted(set(fields) - set(SWEEP_KEYS))
    if unknown:
        raise SweepError(f"sweep file {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(SWEEP_KEYS)}")
    missing = [k for k in ("method", "space", "objective") if k not in fields]
    if missing:
        raise SweepError(f"sweep file {path}: missing {', '.join(missing)}")
    if fields["method"] not in METHODS:
        raise SweepError(f"sweep file {path}: method {fields['method']!r}; valid: {', '.join(METHODS)}")
    space = {name: tuple(value) if isinstance(value, list) else value for name, value in dict(fields["space"]).items()}
    if not space:
        raise SweepError(f"sweep file {path}: the space is empty; name at least one config field")
    for name, value in space.items():
        for candidate in space_values(path, name, value):
            with_overrides(config_path, {name: candidate}, f"sweep file {path}")
    if fields["method"] == "grid" and any(s[0] != "categorical" for s in space.values()):
        raise SweepError(f"sweep file {path}: a grid sweeps categorical spaces only")
    budget = dict(fields.get("budget", {}))
    with_overrides(config_path, budget, f"sweep file {path} budget")
    objective = fields["objective"]
    if not isinstance(objective, str) or objective.count("/") != 1:
        raise SweepError(f"sweep file {path}: objective must be '<split>/<metric>' like 'dev/exact_match', got {objective!r}")
    direction = fields.get("direction", "minimize")
    if direction not in ("minimize", "maximize"):
        raise SweepError(f"sweep file {path}: direction must be minimize or maximize, got {direction!r}")
    grid_size = math.prod(len(s[1]) for s in space.values()) if fields["method"] == "grid" else None
    num_trials = int(fields.get("num_trials", grid_size or 0))
    if num_trials < 1:
        raise SweepError(f"sweep file {path}: num_trials must be at least 1")
    return Sweep(fields["method"], space, objective, direction, grid_size or num_trials, budget,
                 bool(fields.get("pruning", True)), int(fields.get("seed", 0)))  # fmt: skip


def distributions(sweep: Sweep) -> dict[str, optuna.distributions.BaseDistribution]:
    def one(space):
        kind, *args = space
        if kind == "categorical":
            return CategoricalDistribution(list(args[0]))
        if kind == "int":
            return IntDistribution(*args)
        return FloatDistribution(*args, log=kind == "log_uniform")

    return {name: one(space) for name, space in sweep.space.items()}


def grid_points(sweep: Sweep) -> list[dict]:
    points = [{}]
    for name, (_, choices) in sweep.space.items():
        points = [{**point, name: choice} for point in points for choice in choices]
    return points


# ---------------------------------------------------------------- the study


def open_study(args, sweep: Sweep) -> optuna.Study:
    """Creates or loads the study; the first process to open it records the sweep and queues the grid.

    All of it happens under `queue_lock`, so processes opening one study at the
    same moment (on one machine or several) create the database's tables once
    and queue each grid point once. The sweep is recorded after its grid: a
    process killed while queueing leaves no record, and the next one queues
    the points still missing.
    """
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    worker_seed = sweep.seed + (args.worker_index or 0)  # workers must not draw the same random points
    sampler = optuna.samplers.TPESampler(seed=worker_seed) if sweep.method == "tpe" else optuna.samplers.RandomSampler(seed=worker_seed)
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if sweep.pruning else optuna.pruners.NopPruner()
    description = json.loads(json.dumps({"config": str(args.config), "sweep": dataclasses.asdict(sweep)}))
    study_name = args.study_name or workdir.name
    with queue_lock(args.storage, workdir):
        study = optuna.create_study(
            storage=open_storage(args.storage, workdir), sampler=sampler, pruner=pruner, study_name=study_name,
            direction=sweep.direction, load_if_exists=True,
        )  # fmt: skip
        recorded = study.user_attrs.get("description")
        if recorded is None:
            if sweep.method == "grid":
                for point in grid_points(sweep):  # skipping the points queued before a kill
                    study.enqueue_trial(point, user_attrs={"queued": True}, skip_if_exists=True)
            study.set_user_attr("description", description)
        elif recorded != description:
            raise SweepError(
                f"study {study.study_name!r} in {args.storage or workdir} was made by another sweep "
                f"({recorded}); use another --workdir or --study_name"
            )
    return study


def open_storage(storage: str, workdir: Path) -> optuna.storages.BaseStorage:
    """The database `storage` names, or without one the journal file in `workdir`."""
    if not storage:
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(workdir / "study.journal")))
    try:
        return optuna.storages.RDBStorage(storage)
    except Exception as error:  # SQLAlchemy and the drivers raise many types
        raise cannot_open(storage, error) from error


def cannot_open(storage: str, error: Exception) -> SweepError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return SweepError(f"--storage {storage}: cannot open the database ({reason})")


@contextlib.contextmanager
def queue_lock(storage: str, workdir: Path):
    """Serialises opening studies in `storage` (or the journal in `workdir`) between every process that does.

    PostgreSQL: a transaction-level advisory lock in the database itself, so it
    holds between machines (each with its own workdir); it ends with the
    transaction, or with the connection if the process dies. One lock for the
    whole database, as a fresh one gets its tables from the first opening.
    SQLite (one machine): a file lock beside the database file. The journal
    file (one machine): a file lock in the workdir, beside the journal.

    Raises:
      SweepError: a database other than PostgreSQL or SQLite, or one that cannot be reached.
    """
    if not storage:
        with files.exclusive(workdir / ".init.lock"):
            yield
        return
    import sqlalchemy  # only here: the journal file does without it

    try:
        url = sqlalchemy.engine.make_url(storage)
    except Exception as error:  # a malformed URL
        raise cannot_open(storage, error) from error
    backend = url.get_backend_name()
    if backend == "postgresql":
        key = int.from_bytes(hashlib.sha256(b"attend sweep.py queue_lock").digest()[:8], "big", signed=True)  # its name
        with contextlib.ExitStack() as stack:
            try:
                engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
                stack.callback(engine.dispose)
                connection = stack.enter_context(engine.begin())
                connection.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
            except Exception as error:  # no driver, no server, no access
                raise cannot_open(storage, error) from error
            yield
    elif backend == "sqlite":
        database = url.database
        if database in (None, "", ":memory:"):  # a database in memory has only this process
            yield
            return
        with files.exclusive(Path(database).with_name(Path(database).name + ".sweep.lock")):
            yield
    else:
        raise SweepError(f"--storage {storage}: sweeps share a study in PostgreSQL (or SQLite on one machine), not {backend}")


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial | optuna.Trial) -> None:
    """Queues the params of a trial cut short again, in the same folder (it resumes from its checkpoint)."""
    attrs = {k: trial.user_attrs[k] for k in ("workdir",) if k in trial.user_attrs}
    study.enqueue_trial(trial.params, user_attrs={**attrs, "queued": True, "retry_of": trial.number})


def counted(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The trials that count toward num_trials: not those cut short and queued again, nor surplus ones."""
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return [t for t in trials if t.number not in retried and not t.user_attrs.get("surplus")]


def recover_dead_trials(study: optuna.Study) -> None:
    """Trials left RUNNING by a worker that died (killed, or its machine lost): failed, then queued again.

    A worker is dead when it ran on this machine and its process is gone, or
    when its heartbeat (refreshed while its trial runs) is older than `HEARTBEAT_GRACE_S`.
    """
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = trial.user_attrs.get("worker", "").rpartition(":")
        gone = worker_host == host and pid and not pid_alive(int(pid))
        silent = time.time() - trial.user_attrs.get("heartbeat", time.time()) > HEARTBEAT_GRACE_S
        if not (gone or silent):
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except (RuntimeError, ValueError):  # another worker got there first
            continue
        requeue(study, trial)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- one trial


def trial_command(args, workdir: Path, overrides: dict[str, Any]) -> list[str]:
    return [sys.executable, str(args.train_script), f"--config={args.config}", f"--workdir={workdir}", *override_flags(overrides)]


def format_value(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value) if isinstance(value, float) else str(value)


class MetricsFollower:
    """A run's `metrics.jsonl` as train.py writes it: each `poll` reads only the new complete lines.

    train.py truncates the file to its checkpoint's step when it resumes; the
    follower then reads it again from the start.
    """

    def __init__(self, workdir: Path):
        self.path = workdir / "metrics.jsonl"
        self.offset = 0
        self.rows: list[dict] = []

    def poll(self) -> list[dict]:
        """The rows written since the last poll."""
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:
            self.offset, self.rows = 0, []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        new = [json.loads(line) for line in complete.decode().splitlines() if line.strip()]
        self.rows.extend(new)
        return new


def last_lines(path: Path, count: int = 3) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return " | ".join((errors or lines)[-count:])[-1000:] or "no output"


def run_trial(study: optuna.Study, trial: optuna.Trial, args, sweep: Sweep, stop: StopSignals) -> None:
    """Runs train.py for the trial, reports the objective, prunes, and tells the study the outcome.
    A stop request (SIGTERM/SIGINT) stops the trial, which saves its checkpoint."""
    workdir = Path(trial.user_attrs.get("workdir") or Path(args.workdir) / "trials" / f"trial_{trial.number:04d}")
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = {**sweep.budget, **trial.params}
    num_train_steps = with_overrides(args.config, overrides, f"trial {trial.number}").num_train_steps
    command = trial_command(args, workdir, overrides)
    trial.set_user_attr("workdir", str(workdir))
    trial.set_user_attr("command", shlex.join(command))
    trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    reported: set[int] = set()
    metrics = MetricsFollower(workdir)
    outcome, heartbeat = None, 0.0
    with open(workdir / "log.txt", "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(), start_new_session=True)
        while True:
            running = process.poll() is None
            for row in metrics.poll():
                value = row.get(sweep.objective_metric)
                if row.get("split") == sweep.objective_split and value is not None and row["step"] not in reported:
                    reported.add(row["step"])
                    trial.report(float(value), row["step"])
                    if running and row["step"] < num_train_steps and trial.should_prune():
                        outcome = "pruned"
            if not running:
                break
            if outcome or stop.requested:
                process.send_signal(signal.SIGTERM)  # train.py saves a checkpoint and stops
                process.wait()
                continue  # read the rows it wrote on the way out
            if time.time() - heartbeat > HEARTBEAT_S:
                heartbeat = time.time()
                trial.set_user_attr("heartbeat", heartbeat)
            time.sleep(0.2)
    rows = metrics.rows
    final = [r for r in rows if r.get("split") == sweep.objective_split and r["step"] == num_train_steps]
    trial.set_user_attr("steps", max((r["step"] for r in rows), default=0))
    if final:
        trial.set_user_attr("metrics", {k: v for k, v in final[-1].items() if isinstance(v, (int, float))})
    if outcome == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
    elif stop.requested and not final:
        trial.set_user_attr("error", "interrupted; queued again, to resume from its checkpoint")
        study.tell(trial, state=TrialState.FAIL)
        requeue(study, trial)
    elif process.returncode != 0 or not final or sweep.objective_metric not in final[-1]:
        have = sorted(k for k in (final[-1] if final else {}) if k not in ("step", "split"))
        error = (
            f"train.py exited with {process.returncode}: {last_lines(workdir / 'log.txt')}" if process.returncode
            else f"no {sweep.objective} at step {num_train_steps} in {workdir / 'metrics.jsonl'} (have: {', '.join(have) or 'nothing'})"
        )  # fmt: skip
        trial.set_user_attr("error", error)
        study.tell(trial, state=TrialState.FAIL)
    else:
        value = float(final[-1][sweep.objective_metric])
        if not math.isfinite(value):
            trial.set_user_attr("error", f"objective {sweep.objective} is {value}")
            study.tell(trial, state=TrialState.FAIL)
        else:
            study.tell(trial, value)


def work(args, sweep: Sweep) -> None:
    """One worker: takes queued or new trials until the sweep's trials are all done or taken."""
    with StopSignals() as stop:
        work_until_done(args, sweep, stop)


def work_until_done(args, sweep: Sweep, stop: StopSignals) -> None:
    study = open_study(args, sweep)
    space = distributions(sweep)
    while not stop.requested:
        recover_dead_trials(study)
        trials = study.get_trials(deepcopy=False)
        waiting = any(t.state == TrialState.WAITING for t in trials)
        if not waiting and (sweep.method == "grid" or len(counted(trials)) >= sweep.num_trials):
            break
        trial = study.ask(space)
        earlier = counted([t for t in study.get_trials(deepcopy=False) if t.number < trial.number])
        if not trial.user_attrs.get("queued") and (sweep.method == "grid" or len(earlier) >= sweep.num_trials):
            trial.set_user_attr("surplus", True)  # another worker took the last one meanwhile
            study.tell(trial, state=TrialState.FAIL)
            continue
        run_trial(study, trial, args, sweep, stop)


# ---------------------------------------------------------------- results


def result_rows(study: optuna.Study, sweep: Sweep) -> list[dict]:
    """The counted trials, best first: finished by objective, then pruned, then failed or running."""
    sign = -1.0 if sweep.direction == "maximize" else 1.0
    order = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1}
    trials = [t for t in counted(study.get_trials(deepcopy=False)) if t.state != TrialState.WAITING]
    trials.sort(key=lambda t: (order.get(t.state, 2), sign * t.value if t.value is not None else 0.0, t.number))
    rows = []
    for trial in trials:
        row = {"trial": trial.number, "state": trial.state.name.lower(), sweep.objective: trial.value}
        row.update(trial.params)
        row.update(steps=trial.user_attrs.get("steps"), wall_s=round(trial.duration.total_seconds(), 1) if trial.duration else None)
        metrics = trial.user_attrs.get("metrics", {})
        row.update({f"{sweep.objective_split}/{k}": v for k, v in metrics.items() if k not in NOT_SHOWN and "/" not in k})
        row.update(error=trial.user_attrs.get("error", ""), workdir=trial.user_attrs.get("workdir", ""))
        rows.append(row)
    return rows


def write_results(study: optuna.Study, sweep: Sweep, args) -> Path:
    workdir = Path(args.workdir)
    rows = result_rows(study, sweep)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(workdir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# Sweep {study.study_name}", "",
        f"config `{args.config}`, sweep `{args.sweep}`: {sweep.method}, {sweep.num_trials} trials, "
        f"objective {sweep.objective} ({sweep.direction}); budget {sweep.budget}", "",
    ]  # fmt: skip
    if any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        best = study.best_trial
        command = shlex.split(best.user_attrs["command"])
        command = [f"--workdir={workdir / 'best'}" if part.startswith("--workdir=") else part for part in command]
        command[:2] = ["python", os.path.relpath(command[1])]
        lines += [f"Best: trial {best.number}, {sweep.objective} = {best.value:.4g}. To reproduce it:", "",
                  "```", shlex.join(command), "```", ""]  # fmt: skip
    shown = [c for c in columns if c not in ("workdir",)]
    lines.append("| " + " | ".join(shown) + " |")
    lines.append("|" + "---|" * len(shown))
    for row in rows:
        lines.append("| " + " | ".join(format_cell(row.get(c)) for c in shown) + " |")
    (workdir / "results.md").write_text("\n".join(lines) + "\n")
    plot_objective(rows, sweep, workdir / "objective_by_field.png")
    return workdir / "results.md"


def format_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def plot_objective(rows: list[dict], sweep: Sweep, path: Path) -> None:
    """The objective of each finished trial against each swept field."""
    import visualize

    done = [r for r in rows if r["state"] == "complete"]
    figure = visualize.new_figure(figsize=(4.5 * len(sweep.space), 3.6))
    axes = figure.subplots(1, len(sweep.space), squeeze=False)
    for axis, (name, space) in zip(axes[0], sweep.space.items()):
        values = [r[name] for r in done]
        if space[0] == "categorical":
            labels = [str(c) for c in space[1]]
            values = [labels.index(str(v)) for v in values]
            axis.set_xticks(range(len(labels)), labels)
        elif space[0] == "log_uniform":
            axis.set_xscale("log")
        axis.scatter(values, [r[sweep.objective] for r in done])
        axis.set_xlabel(name)
        axis.set_ylabel(sweep.objective)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the experiment config file train.py runs")
    parser.add_argument("--sweep", required=True, help="the sweep file (configs/sweeps/NAME.py)")
    parser.add_argument("--workdir", required=True, help="the sweep folder: study, trials, results")
    parser.add_argument("--parallel", type=int, default=1, help="worker processes on this machine")
    parser.add_argument("--storage", default="", help="database URL of a shared study, e.g. postgresql://user@host/db")
    parser.add_argument("--study_name", default="", help="the study's name in the storage (default: the workdir's name)")
    parser.add_argument("--train_script", default=str(PROJECT_ROOT / "train.py"), help="what runs a trial (train.py's flags)")
    parser.add_argument("--worker_index", type=int, default=None, help=argparse.SUPPRESS)  # set for worker processes
    args = parser.parse_args(argv)
    if args.parallel < 1:
        raise SweepError(f"--parallel must be at least 1, got {args.parallel}")
    return args


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The NVIDIA GPUs a trial could use, named as CUDA_VISIBLE_DEVICES names them: that variable's list
    when it is set (indices, GPU- or MIG- UUIDs), else the indices `nvidia-smi -L` lists; none when
    JAX_PLATFORMS leaves CUDA out or there is no nvidia-smi (a CPU-only machine)."""
    platforms = {p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()}
    if platforms and not platforms & {"cuda", "gpu"}:
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        names = [name.strip() for name in environ["CUDA_VISIBLE_DEVICES"].split(",")]
        return list(itertools.takewhile(lambda name: name and not name.startswith("-"), names))  # as CUDA reads it
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True, env=dict(environ)).stdout
    except (OSError, subprocess.SubprocessError):  # no nvidia-smi, no driver
        return []
    return re.findall(r"^GPU (\d+):", listing, flags=re.MULTILINE)


def worker_environment(index: int, parallel: int, environ: Mapping[str, str], gpus: list[str]) -> dict[str, str]:
    """The environment of worker `index` of `parallel`, which its trials (train.py) inherit.

    With two or more workers and `gpus` (see `visible_gpus`), worker i gets the
    i-th contiguous block of len(gpus) // parallel of them as CUDA_VISIBLE_DEVICES
    (the remainder stay idle, so every trial has as many devices and shards its
    batch alike) and XLA_PYTHON_CLIENT_PREALLOCATE=false unless `environ` sets
    it. Without GPUs, or with one worker, `environ` as it is. Either way without the variables of
    a cluster launcher (`CLUSTER_VARIABLES`): each trial trains alone.

    Raises:
      SweepError: fewer GPUs than workers; two trials would contend for one GPU.
    """
    # A trial is one process: under srun or mpirun the cluster's variables would make every trial
    # join the others as one distributed run (run_setup.cluster.setup_distributed).
    environment = {k: v for k, v in environ.items() if not k.startswith(CLUSTER_VARIABLES)}
    if not gpus or parallel == 1:
        return environment
    if len(gpus) < parallel:
        raise SweepError(
            f"--parallel={parallel} but this machine has {len(gpus)} GPU(s) ({','.join(gpus)}), and two trials "
            f"would contend for one; use --parallel={len(gpus)} or fewer"
        )
    size = len(gpus) // parallel
    environment["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * size : (index + 1) * size])
    environment.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return environment


def launch_workers(argv: list[str], environments: list[dict[str, str]]) -> int:
    """Starts a worker process per environment and waits; SIGTERM/SIGINT are passed on to them."""
    workers = [
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, f"--worker_index={index}"], env=environment)
        for index, environment in enumerate(environments)
    ]

    def forward(signum: int) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)

    with StopSignals(on_signal=forward):
        return max(worker.wait() for worker in workers)


def main(argv: list[str]) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        args = parse_args(argv)
        base.load(args.config)  # a config file that does not load stops here, named
        sweep = load_sweep(args.sweep, args.config)
        if args.worker_index is not None:
            work(args, sweep)
            return 0
        gpus = visible_gpus(os.environ)
        environments = [worker_environment(index, args.parallel, os.environ, gpus) for index in range(args.parallel)]
        if gpus and args.parallel > 1:
            print("GPUs by worker: " + "; ".join(f"{i}: {e['CUDA_VISIBLE_DEVICES']}" for i, e in enumerate(environments)), flush=True)
        study = open_study(args, sweep)  # creates the study (and queues the grid) once, before the workers
        status = launch_workers(argv, environments)
        results = write_results(study, sweep, args)
    except ConfigError as error:
        print(f"sweep.py: error: {error}", file=sys.stderr)
        return 2
    states = [t.state.name.lower() for t in counted(study.get_trials(deepcopy=False))]
    print(f"{len(states)} trials: " + ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)))
    print(f"results: {results}, {results.with_suffix('.csv')}, {results.parent / 'objective_by_field.png'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
