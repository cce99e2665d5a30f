"""Names of TFDS catalog datasets (`dataset[/config][:version]`): what is wrong with one, and the
command that prepares one. Both environments import it: training's (tasks/catalog.py) and the
preparation one (tools/prepare_catalog.py, which has TensorFlow but not the project's other packages),
so it imports TFDS and the standard library alone."""

from __future__ import annotations

import difflib

import tensorflow_datasets as tfds


def prepare_command(name: str, data_dir: str) -> str:
    """The command that prepares catalog dataset `name` in `data_dir`, as errors name it."""
    return f"make prepare DATASET={name} DATA_DIR={data_dir}"


def name_problem(name: str) -> str | None:
    """What is wrong with catalog name `name` (`dataset[/config][:version]`), as one line naming the
    nearest known names; None for a name TFDS's catalog has. (Asked in both environments; in
    training's, a builder that imports TensorFlow cannot tell its configs.)"""
    dataset, _, config = name.split(":")[0].partition("/")
    known = tfds.list_builders(with_community_datasets=False)
    if dataset not in known:
        close = difflib.get_close_matches(dataset, known, n=3)
        return f"unknown TFDS catalog dataset {dataset!r}" + (f"; did you mean {', '.join(close)}?" if close else "")
    try:
        configs = [c.name for c in getattr(tfds.builder_cls(dataset), "BUILDER_CONFIGS", [])]
    except ImportError:
        # coco_captions's builder without TensorFlow
        return None
    if config and configs and config not in configs:
        return f"{dataset} has no config {config!r}; its configs: {', '.join(configs)}"
    return None
