"""The task registry: `config.task.name` -> the examples of every split.

`load_task(name, data_dir, **params)` returns a `Task`: random-access sources
of records per split (`train`, `dev`, `test`), the record keys of source and
target text, and the task metric. Built data is cached under `data_dir`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
from pathlib import Path
from typing import Any, Mapping, Sequence

from tasks import base, catalog, dates, parallel_text, synthetic


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    splits: Mapping[str, Sequence[Mapping[str, Any]]]
    metric: str  # "exact_match" or "bleu"
    source_key: str = "source"
    target_key: str = "target"

    def pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """The (source, target) texts of one record."""
        return base.text(record[self.source_key]), base.text(record[self.target_key])


# name -> (prepare(data_dir=..., **params) -> (splits, build report), metric)
TASKS = {
    "dates": (functools.partial(base.prepare, dates.Dates), "exact_match"),
    **{
        kind: (functools.partial(base.prepare, synthetic.Synthetic, kind=kind), "exact_match")
        for kind in synthetic.KINDS
    },
    "parallel_text": (parallel_text.prepare_parallel_text, "bleu"),
}


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
    if name in TASKS:
        prepare, metric = TASKS[name]
        splits, report = prepare(data_dir=data_dir, **params)
        base.log_report(name, report)
        return Task(name, splits, metric)
    if "/" in name:
        splits, source_key, target_key = catalog.load_catalog(name, data_dir, **params)
        return Task(name, splits, "bleu", source_key, target_key)
    raise ValueError(
        f"unknown task.name {name!r}; valid: {', '.join(sorted(TASKS))}, "
        "or a TFDS catalog translation dataset such as 'wmt14_translate/de-en'"
    )
