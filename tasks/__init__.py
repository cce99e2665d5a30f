"""The task registry: `config.task.name` -> the examples of every split.

`load_task(name, data_dir, **params)` returns a `Task`: random-access sources
of records per split (`train`, `dev`, `test`), the record keys of source and
target text, the task metric, and where the task knows them, the true
alignment spans of a record. Built data is cached under `data_dir`.

Each task's parameters, with their defaults and documentation, live in its
config dataclass (`parameters_of(name)` lists them); `configs/base.py` `task()`
starts from there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from errors import ConfigError
from tasks import base, catalog, dates, parallel_text, synthetic


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    splits: Mapping[str, Sequence[Mapping[str, Any]]]
    metric: str  # "exact_match" or "bleu"
    source_key: str = "source"
    target_key: str = "target"
    # record -> int32 [K, 4] spans `(target start, target end, source start, end)`, in characters:
    # the target characters [t0, t1) are produced from the source characters [s0, s1).
    # None: the task does not know its alignments.
    alignment: Callable[[Mapping[str, Any]], np.ndarray] | None = None

    def pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """The (source, target) texts of one record."""
        return base.text(record[self.source_key]), base.text(record[self.target_key])


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A registered task: how to build it, its parameters, its metric, its alignments."""

    prepare: Callable[..., tuple[dict, dict]]  # (data_dir=..., **params) -> (splits, build report)
    config_class: type  # the parameters' dataclass: their defaults and documentation
    metric: str
    alignment: Callable[[Mapping[str, Any]], np.ndarray] | None = None


TASKS = {
    "dates": TaskKind(functools.partial(base.prepare, dates.Dates), dates.DatesConfig, "exact_match", dates.alignment_spans),
    **{
        kind: TaskKind(functools.partial(base.prepare, synthetic.Synthetic, kind=kind), synthetic.SyntheticConfig, "exact_match")
        for kind in synthetic.KINDS
    },
    "parallel_text": TaskKind(parallel_text.prepare_parallel_text, parallel_text.ParallelTextConfig, "bleu"),
}


def parameters_of(name: str) -> dict[str, Any]:
    """The parameters of task `name` with their defaults (a TFDS catalog name: the catalog's)."""
    if name in TASKS:
        parameters = TASKS[name].config_class.defaults()
        if name in synthetic.KINDS:
            parameters.pop("kind")  # set by the name
        return parameters
    if "/" in name:
        return {f.name: f.default for f in dataclasses.fields(catalog.CatalogConfig)}
    raise ConfigError(
        f"unknown task.name {name!r}; valid: {', '.join(sorted(TASKS))}, "
        "or a TFDS catalog translation dataset such as 'wmt14_translate/de-en'"
    )


@contextlib.contextmanager
def build_lock(data_dir: str):
    """Serialises builds into `data_dir` between processes of one machine (sweep trials, parallel runs).

    TFDS writes a build to a temporary folder and renames it; two processes
    building the same dataset at once would race on that rename.
    """
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(data_dir) / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load_task(name: str, data_dir: str, **params) -> Task:
    """The task named `name`: a registered task or a TFDS catalog `dataset/config`."""
    with build_lock(data_dir):
        return _load_task(name, data_dir, **params)


def _load_task(name: str, data_dir: str, **params) -> Task:
    unknown = sorted(set(params) - set(parameters_of(name)))  # an unknown name stops here too
    if unknown:
        raise ConfigError(f"unknown task parameter(s) for {name}: {', '.join(unknown)}; valid: {', '.join(sorted(parameters_of(name)))}")
    if name in TASKS:
        kind = TASKS[name]
        splits, report = kind.prepare(data_dir=data_dir, **params)
        base.log_report(name, report)
        return Task(name, splits, kind.metric, alignment=kind.alignment)
    splits, source_key, target_key = catalog.load_catalog(name, data_dir, catalog.CatalogConfig(**params))
    return Task(name, splits, "bleu", source_key, target_key)
