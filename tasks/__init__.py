"""The datasets: generated tasks, corpora, TFDS catalog, images; their builders, token cache, vocabularies."""

# The task registry: `config.task.name` -> the examples of every split.
#
# `load_task(name, data_dir, **params)` returns a `Task`: random-access sources
# of records per split (`train`, `dev`, `test`), the record keys of source and
# target, what the source is (text, or an image), the task metric, and where the
# task knows them, the true alignment spans of a record (translation) or the
# boxes of its caption's words (captioning). Built data is cached under `data_dir`.
#
# Each task's parameters, with their defaults and documentation, live in its
# config dataclass (`parameters_of(name)` lists them); `configs/base.py` `task()`
# starts from there.

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tasks import catalog, dates, digit_strips, image_captions, parallel_text, synthetic, task_builder
from utils import files
from utils.errors import ConfigError

INPUTS = ("text", "image")


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    splits: Mapping[str, Sequence[Mapping[str, Any]]]
    # "exact_match", "bleu" or "caption"
    metric: str
    source_key: str = "source"
    target_key: str = "target"
    # record -> int32 [K, 4] spans `(target start, target end, source start, end)`, in characters:
    # the target characters [t0, t1) are produced from the source characters [s0, s1).
    # None: the task does not know its alignments.
    alignment: Callable[[Mapping[str, Any]], np.ndarray] | None = None
    # "text", or "image": the source is a uint8 image [H, W] or [H, W, C].
    inputs: str = "text"
    # Captioning: record -> int32 [K, 4] boxes `(x0, y0, x1, y1)` in pixels (end exclusive) of the
    # objects the caption's words name, in word order, padded with -1 rows. None: unknown.
    boxes: Callable[[Mapping[str, Any]], np.ndarray] | None = None
    # Captioning: the record key naming the image, when an image has several captions (records):
    # a generated caption is scored against all of them. None: a record's own caption only.
    group_key: str | None = None

    def references(self, split: str, indices: Sequence[int]) -> list[list[str]]:
        """The reference texts of each record: its target, or every target of its group."""
        records = self.splits[split]
        if self.group_key is None:
            return [[self.pair(records[i])[1]] for i in indices]
        # a catalog split that knows each image's captions
        if hasattr(records, "references"):
            return [records.references(i) for i in indices]
        groups: dict[str, list[str]] = {}
        for i in range(len(records)):
            groups.setdefault(task_builder.text(records[i][self.group_key]), []).append(self.pair(records[i])[1])
        return [groups[task_builder.text(records[i][self.group_key])] for i in indices]

    def pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """The (source, target) texts of one record; an image task's source text is empty."""
        source = "" if self.inputs == "image" else task_builder.text(record[self.source_key])
        return source, task_builder.text(record[self.target_key])

    def image(self, record: Mapping[str, Any]) -> np.ndarray:
        """An image task's source: a uint8 image as `[H, W, C]` (or a float feature grid as it is)."""
        return with_channels(np.asarray(record[self.source_key]))


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A registered task: how to build it, its parameters, its metric, its alignments."""

    prepare: Callable[..., tuple[dict, dict]]  # (data_dir=..., **params) -> (splits, build report)
    # the parameters' dataclass: their defaults and documentation
    config_class: type
    metric: str
    alignment: Callable[[Mapping[str, Any]], np.ndarray] | None = None
    inputs: str = "text"
    keys: tuple[str, str] = ("source", "target")
    boxes: Callable[[Mapping[str, Any]], np.ndarray] | None = None
    group_key: str | None = None


TASKS = {
    "dates": TaskKind(
        functools.partial(task_builder.prepare, dates.Dates), dates.DatesConfig, "exact_match", dates.alignment_spans
    ),
    **{
        kind: TaskKind(
            functools.partial(task_builder.prepare, synthetic.Synthetic, kind=kind),
            synthetic.SyntheticConfig,
            "exact_match",
        )
        for kind in synthetic.KINDS
    },
    "parallel_text": TaskKind(parallel_text.prepare_parallel_text, parallel_text.ParallelTextConfig, "bleu"),
    "digit_strips": TaskKind(
        functools.partial(task_builder.prepare, digit_strips.DigitStrips),
        digit_strips.DigitStripsConfig,
        "caption",
        inputs="image",
        keys=("image", "caption"),
        boxes=digit_strips.word_boxes,
    ),
    "image_captions": TaskKind(
        image_captions.prepare_image_captions,
        image_captions.ImageCaptionsConfig,
        "caption",
        inputs="image",
        keys=("image", "caption"),
        group_key="image_file",
    ),
}


def with_channels(image: np.ndarray) -> np.ndarray:
    """A grey uint8 image `[H, W]` as `[H, W, 1]`; anything else (colour, a float feature grid) as it is."""
    return image[..., None] if image.ndim == 2 and image.dtype == np.uint8 else image


def inputs_of(name: str) -> str:
    """What task `name`'s sources are: "text" or "image" (an unknown name stops here)."""
    parameters_of(name)
    if name in TASKS:
        return TASKS[name].inputs
    return catalog.inputs_of(name)


def scoring_of(name: str) -> tuple[str, bool, bool]:
    """How task `name` is scored, known before it is built: its metric ("exact_match", "bleu" or
    "caption"), and whether it knows its alignments and its caption words' boxes."""
    # an unknown name stops here
    parameters_of(name)
    if name in TASKS:
        kind = TASKS[name]
        return kind.metric, kind.alignment is not None, kind.boxes is not None
    return ("caption" if catalog.inputs_of(name) == "image" else "bleu"), False, False


def parameters_of(name: str) -> dict[str, Any]:
    """The parameters of task `name` with their defaults (a TFDS catalog name: the catalog's)."""
    if name in TASKS:
        parameters = TASKS[name].config_class.defaults()
        if name in synthetic.KINDS:
            # set by the name
            parameters.pop("kind")
        return parameters
    if catalog.inputs_of(name) == "image":
        return {f.name: f.default for f in dataclasses.fields(catalog.CaptionCatalogConfig)}
    if "/" in name:
        return {f.name: f.default for f in dataclasses.fields(catalog.CatalogConfig)}
    raise ConfigError(
        f"unknown task.name {name!r}; valid: {', '.join(sorted(TASKS))}, a TFDS catalog translation "
        "dataset such as 'wmt14_translate/de-en', or 'coco_captions'"
    )


@contextlib.contextmanager
def build_lock(data_dir: str):
    """Serialises builds into `data_dir` between processes of one machine (sweep trials, parallel runs).

    TFDS writes a build to a temporary folder and renames it; two processes
    building the same dataset at once would race on that rename.
    """
    with files.exclusive(Path(data_dir) / ".build.lock"):
        yield


def check_parameters(name: str, **params) -> None:
    """Raises `ConfigError` naming an unknown parameter of task `name` or one whose value cannot work,
    without building or reading anything."""
    # an unknown name stops here too
    unknown = sorted(set(params) - set(parameters_of(name)))
    if unknown:
        raise ConfigError(
            f"unknown task parameter(s) for {name}: {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(parameters_of(name)))}"
        )
    if name in TASKS:
        TASKS[name].config_class.create(**params, **({"kind": name} if name in synthetic.KINDS else {}))


def load_task(name: str, data_dir: str, **params) -> Task:
    """The task named `name`: a registered task or a TFDS catalog `dataset/config`."""
    with build_lock(data_dir):
        return _load_task(name, data_dir, **params)


def _load_task(name: str, data_dir: str, **params) -> Task:
    check_parameters(name, **params)
    if name in TASKS:
        kind = TASKS[name]
        splits, report = kind.prepare(data_dir=data_dir, **params)
        task_builder.log_report(name, report)
        return Task(
            name,
            splits,
            kind.metric,
            *kind.keys,
            alignment=kind.alignment,
            inputs=kind.inputs,
            boxes=kind.boxes,
            group_key=kind.group_key,
        )
    if catalog.inputs_of(name) == "image":
        splits = catalog.load_caption_catalog(name, data_dir, catalog.CaptionCatalogConfig(**params))
        return Task(name, splits, "caption", "image", "caption", inputs="image", group_key="image_file")
    splits, source_key, target_key = catalog.load_catalog(name, data_dir, catalog.CatalogConfig(**params))
    return Task(name, splits, "bleu", source_key, target_key)
