"""The sweep file and the study: reading and checking a sweep file (spaces, distributions, the
grid), and opening the study it runs in, its storage and the lock that serialises opening it."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from configs import base
from utils import files
from utils.errors import ConfigError, UserError

METHODS = ("grid", "random", "tpe")
SPACE_KINDS = ("categorical", "uniform", "log_uniform", "int")
SWEEP_KEYS = ("method", "space", "objective", "direction", "num_trials", "budget", "pruning", "seed")


class SweepError(ConfigError):
    """A bad sweep file, config or flag; the message names the culprit."""


# ---------------------------------------------------------------- the sweep file


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A validated sweep file: see configs/sweeps/smoke.py for the fields."""

    method: str
    # field -> ("categorical", [choices]) | ("uniform"|"log_uniform"|"int", low, high)
    space: dict[str, tuple]
    # "<split>/<metric>", e.g. "dev/exact_match"
    objective: str
    # "maximize" or "minimize"
    direction: str
    num_trials: int
    # config overrides of every trial
    budget: dict[str, Any]
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


def format_value(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(format_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value) if isinstance(value, float) else str(value)


def with_overrides(config_path: str | Path, overrides: dict[str, Any], where: str):
    """The config file with `overrides` applied exactly as train.py will apply them (`base.load`);
    an unknown field or a value the field cannot take names `where` and the field."""
    config = base.load(config_path)
    # one at a time, so the message names the field
    for name, value in overrides.items():
        if not base.has_field(config, name):
            raise SweepError(f"{where}: unknown config field {name!r}")
        try:
            base.load(config_path, override_flags({name: value}))
        except ConfigError as error:
            raise SweepError(f"{where}: config field {name!r} cannot take {value!r} ({error})") from error
    return base.load(config_path, override_flags(overrides))


def trials_start_from(config_path: str | Path, sweep: Sweep) -> dict[str, Any] | None:
    """The config every trial of `sweep` starts from today (the config file and the budget, before
    its params) as JSON holds it, or None for a config that is not attend's (another
    `--train_script`). Not checked as a whole: some fields fit together only with a trial's params
    (a budget's `decode.num_hypotheses` beside a swept `decode.beam_size`)."""
    config = with_overrides(config_path, sweep.budget, "the sweep's budget")
    return as_json(config.to_dict()) if base.has_field(config, "task.name") else None


def as_the_sweep_began(study: optuna.Study, args, sweep: Sweep) -> dict[str, Any]:
    """The overrides that make a resumed sweep's new trials run as its first ones did, where today's
    code changed a default that a resumed run keeps (`compatibility.KEPT_ON_RESUME`: the
    Transformer's attention biases, say): `{"model.name": its family, "model.use_bias": True}`, or
    `{}`. They are the config file's model family's (`run_trial` gives them to its trials only).

    What the sweep began with is the config its study recorded when it was made (`open_study`);
    for a study made before it recorded one, the config.json of its first trial of the config
    file's model and task with a readable run folder on this machine, recorded then for the
    machines without one. It is compared with the config every trial starts from today: a model,
    task, vocabulary, data, seed or optimization field that differs, but the swept ones and those
    kept, stops the sweep; other changes (intervals, decoding, logging) go on, logged. A config
    that is not attend's, or an old study without such a folder here, gives `{}`.

    Raises:
      SweepError: naming the fields that differ from what the sweep began with.
    """
    start = trials_start_from(args.config, sweep)
    if start is None:
        return {}
    from run_setup import compatibility
    from run_setup.settings import OptimizationSettings

    today = saved_config(start, "today's config")
    recorded, source = study.user_attrs.get("config"), "the study's record"
    if recorded is None:
        recorded, source = first_trial_config(study, Path(args.workdir), today)
        if recorded is None:
            return {}
        study.set_user_attr("config", recorded)
    began = saved_config(recorded, f"the config the sweep began with ({source})")
    kept = compatibility.kept_fields(today, began)
    for field, value in kept.items():
        today_value = today["model"][field]
        logging.info("model.%s: %r, as the sweep began (today's %r is for new sweeps)", field, value, today_value)
    # what a trial's steps compute, not how the loop runs them or how often it logs
    optimization = {field.name for field in dataclasses.fields(OptimizationSettings)} - {
        "grad_accum_unroll",
        "log_every_steps",
    }
    identity = (*compatibility.RUN_IDENTITY, *sorted(optimization))
    left_alone = {*sweep.space, *(f"model.{field}" for field in kept)}
    changes = lambda groups: [  # noqa: E731
        change
        for change in compatibility.field_differences(began, today, groups)
        if change.split(":")[0] not in left_alone
    ]
    if changed := changes(identity):
        raise SweepError(
            f"the sweep began with another config ({source}): {'; '.join(changed)}. Its trials differ only in "
            "the swept fields: undo the change, or start the sweep afresh in another --workdir (with --storage, "
            "under a --study_name not used before)"
        )
    for change in changes([group for group in today if group not in identity]):
        logging.info("the sweep goes on with a changed field, %s", change)
    if not kept:
        return {}
    return {"model.name": today["model"]["name"], **{f"model.{field}": value for field, value in kept.items()}}


def kept_for(kept: dict[str, Any], family: str | None) -> dict[str, Any]:
    """The overrides of `kept` (`as_the_sweep_began`) for a trial of the model `family`: none for a
    family other than the config file's, whose fields they are not."""
    if not kept or family != kept["model.name"]:
        return {}
    return {name: value for name, value in kept.items() if name != "model.name"}


def saved_config(fields: dict[str, Any], what: str) -> dict[str, Any]:
    """A config as JSON held it, read back as a run's config.json is (`base.from_saved`: a field it
    lacks at its default, an old value under its new name), as a nested dict.

    Raises:
      SweepError: it does not fit today's fields, naming `what`.
    """
    try:
        return base.from_saved(fields).to_dict()
    except (ConfigError, TypeError, ValueError) as error:
        raise SweepError(f"{what} no longer reads: {error}") from error


def first_trial_config(study: optuna.Study, workdir: Path, today: dict[str, Any]) -> tuple[dict | None, str]:
    """`(config, where)` of the study's first trial of `today`'s model and task whose run folder here
    holds a readable config.json, as JSON holds it; `(None, "")` without one. An unreadable one is
    passed over with a warning."""
    for trial in sorted(study.get_trials(deepcopy=False), key=lambda trial: trial.number):
        folder = trial_folder(trial.user_attrs.get("workdir", ""), workdir)
        try:
            config = base.read_run_config(folder) if folder else None
        except UserError as error:
            logging.warning("sweep: trial %d's run folder passed over: %s", trial.number, error)
            continue
        if config is not None and all(config[group].name == today[group]["name"] for group in ("model", "task")):
            return as_json(config.to_dict()), f"trial {trial.number}'s {Path(folder) / 'config.json'}"
    return None, ""


def trial_folder(recorded: str, workdir: Path) -> str:
    """Where a trial's folder is: the folder of its name in this sweep's `trials/` where it is there
    (the study records absolute paths, which a sweep folder moved or copied since no longer has;
    trial folders are named by the study's trial numbers, so one of that name is that trial's),
    else the path the study recorded (a trial another machine ran)."""
    if not recorded:
        return recorded
    here = workdir / "trials" / Path(recorded).name
    return str(here.absolute()) if here.is_dir() else recorded


def as_json(tree: Any) -> Any:
    """`tree` as JSON reads it back (tuples as lists): what a study's user attribute holds."""
    return json.loads(json.dumps(tree, default=list))


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


def objective_direction(path: str | Path, config, metric: str, given: str | None) -> str:
    """The objective's direction: the score registry's (scoring/score_registry.py), for an objective the config's task
    writes. A config that is not attend's (another `--train_script`) states it, or minimizes."""
    if not base.has_field(config, "task.name"):
        return given or "minimize"
    # JAX, through scoring/metrics.py: only for attend's own configs (see configs/base.py)
    import tasks
    from scoring import score_registry

    task_metric, alignment, boxes = tasks.scoring_of(config.task.name)
    try:
        score = score_registry.check_best_metric(
            metric, task_metric, alignment=alignment, boxes=boxes, field="objective"
        )
    except ConfigError as error:
        raise SweepError(f"sweep file {path}: {error}") from error
    if given not in (None, score.direction):
        raise SweepError(
            f"sweep file {path}: direction {given!r} contradicts {metric!r}, "
            f"which is better {'larger' if score.larger_is_better else 'smaller'}; "
            f"leave direction out or set {score.direction!r}"
        )
    return score.direction


def load_sweep(path: str | Path, config_path: str | Path) -> Sweep:
    """Reads and checks a sweep file against the config it sweeps.

    Raises:
      SweepError: naming the file and the culprit (unknown key or field, empty space, bad method...).
    """
    fields = base.call_in_file(path, "get_sweep", "sweep")
    # a dict, or a ConfigDict
    fields = dict(fields) if isinstance(fields, Mapping) else fields.to_dict()
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
        raise SweepError(
            f"sweep file {path}: objective must be '<split>/<metric>' like 'dev/exact_match', got {objective!r}"
        )
    direction = fields.get("direction")
    if direction not in (None, "minimize", "maximize"):
        raise SweepError(f"sweep file {path}: direction must be minimize or maximize, got {direction!r}")
    direction = objective_direction(path, base.load(config_path), objective.split("/", 1)[1], direction)
    grid_size = math.prod(len(s[1]) for s in space.values()) if fields["method"] == "grid" else None
    num_trials = int(fields.get("num_trials", grid_size or 0))
    if num_trials < 1:
        raise SweepError(f"sweep file {path}: num_trials must be at least 1")
    return Sweep(
        fields["method"],
        space,
        objective,
        direction,
        grid_size or num_trials,
        budget,
        bool(fields.get("pruning", True)),
        int(fields.get("seed", 0)),
    )


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
    # workers must not draw the same random points
    worker_seed = sweep.seed + (args.worker_index or 0)
    sampler = (
        optuna.samplers.TPESampler(seed=worker_seed)
        if sweep.method == "tpe"
        else optuna.samplers.RandomSampler(seed=worker_seed)
    )
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2) if sweep.pruning else optuna.pruners.NopPruner()
    description = json.loads(json.dumps({"config": str(args.config), "sweep": dataclasses.asdict(sweep)}))
    study_name = args.study_name or workdir.name
    with queue_lock(args.storage, workdir):
        study = optuna.create_study(
            storage=open_storage(args.storage, workdir),
            sampler=sampler,
            pruner=pruner,
            study_name=study_name,
            direction=sweep.direction,
            load_if_exists=True,
        )
        recorded = study.user_attrs.get("description")
        if recorded is None:
            if sweep.method == "grid":
                # skipping the points queued before a kill
                for point in grid_points(sweep):
                    study.enqueue_trial(point, user_attrs={"queued": True}, skip_if_exists=True)
            # what the trials start from, against which a resumed sweep checks today's (`as_the_sweep_began`)
            start = trials_start_from(args.config, sweep)
            if start is not None:
                study.set_user_attr("config", start)
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
        return optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(workdir / "study.journal"))
        )
    try:
        return optuna.storages.RDBStorage(storage)
    except Exception as error:
        # SQLAlchemy and the drivers raise many types
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
    # only here: the journal file does without it
    import sqlalchemy

    try:
        url = sqlalchemy.engine.make_url(storage)
    except Exception as error:
        # a malformed URL
        raise cannot_open(storage, error) from error
    backend = url.get_backend_name()
    if backend == "postgresql":
        # The lock's name is the one sweep.py's queue_lock has always used, so that sweeps started by older code
        # exclude these.
        key = int.from_bytes(hashlib.sha256(b"attend sweep.py queue_lock").digest()[:8], "big", signed=True)
        with contextlib.ExitStack() as stack:
            try:
                engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
                stack.callback(engine.dispose)
                connection = stack.enter_context(engine.begin())
                connection.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
            except Exception as error:
                # no driver, no server, no access
                raise cannot_open(storage, error) from error
            yield
    elif backend == "sqlite":
        database = url.database
        # a database in memory has only this process
        if database in (None, "", ":memory:"):
            yield
            return
        with files.exclusive(Path(database).with_name(Path(database).name + ".sweep.lock")):
            yield
    else:
        raise SweepError(
            f"--storage {storage}: sweeps share a study in PostgreSQL (or SQLite on one machine), not {backend}"
        )


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial | optuna.Trial) -> None:
    """Queues the params of a trial cut short again, in the same folder (it resumes from its checkpoint)."""
    attrs = {k: trial.user_attrs[k] for k in ("workdir",) if k in trial.user_attrs}
    study.enqueue_trial(trial.params, user_attrs={**attrs, "queued": True, "retry_of": trial.number})


def trials_toward_the_count(trials: list[optuna.trial.FrozenTrial]) -> list[optuna.trial.FrozenTrial]:
    """The trials that count toward num_trials: not those cut short and queued again, nor surplus ones."""
    retried = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return [t for t in trials if t.number not in retried and not t.user_attrs.get("surplus")]
