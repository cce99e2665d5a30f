"""TFDS catalog translation datasets by name, e.g. `wmt14_translate/de-en`, `ted_hrlr_translate/pt_to_en`.

The data must already be prepared in `data_dir` (these machines have no
internet; on one that has, `tfds build NAME --data_dir=DIR --file_format=array_record`
or a first run with `task.download=True` prepares it). Records hold one text feature per
language; the source and target languages come from the config name
(`de-en`, `pt_to_en`) unless given, and `reverse=True` swaps them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import re

import tensorflow_datasets as tfds
import tensorflow_datasets.translate

from errors import ConfigError, DataError

SPLIT_NAMES = {"train": "train", "dev": "validation", "test": "test"}


@functools.cache
def register_translation_builders() -> None:
    """Imports TFDS's translation builders one module at a time.

    `import tensorflow_datasets` imports its `translate` package lazily and as a
    whole; without TensorFlow installed one module of it fails and none of the
    builders (wmt14_translate, ted_hrlr_translate, ...) get registered.
    """
    for module in pkgutil.iter_modules(tensorflow_datasets.translate.__path__):
        try:
            importlib.import_module(f"tensorflow_datasets.translate.{module.name}")
        except ImportError:  # builders that need TensorFlow itself
            pass


def languages_of(name: str) -> tuple[str, str]:
    """`'wmt14_translate/de-en'` -> `('de', 'en')`; `'ted_hrlr_translate/pt_to_en'` -> `('pt', 'en')`."""
    config = name.split("/", 1)[1] if "/" in name else ""
    match = re.fullmatch(r"([a-z]+)(?:-|_to_)([a-z]+)", config)
    if not match:
        raise ConfigError(
            f"task.name {name!r}: cannot tell the languages from the config name; "
            "set task.source_language and task.target_language"
        )
    return match.group(1), match.group(2)


@dataclasses.dataclass(frozen=True)
class CatalogConfig:
    """The parameters of a TFDS catalog task."""

    source_language: str = ""  # "" = from the config name (`de-en`: de)
    target_language: str = ""  # "" = from the config name (`de-en`: en)
    reverse: bool = False  # swap source and target (`wmt14_translate/de-en` with reverse: en -> de)
    download: bool = False  # let TFDS download and prepare the data (needs the internet)


def load_catalog(name: str, data_dir: str, config: CatalogConfig):
    """Returns `({split: random-access source}, source_key, target_key)`."""
    register_translation_builders()
    source_language, target_language = config.source_language, config.target_language
    if not (source_language and target_language):
        source_language, target_language = languages_of(name)
    if config.reverse:
        source_language, target_language = target_language, source_language
    try:
        sources = {
            split: tfds.data_source(name, split=tfds_split, data_dir=data_dir, download=config.download)
            for split, tfds_split in SPLIT_NAMES.items()
        }
    except Exception as error:  # TFDS raises several types for "not prepared" / "not in catalog"
        raise DataError(
            f"TFDS dataset {name!r} is not available as array_record in {data_dir}: {error}. Prepare it first "
            f"(`tfds build {name} --data_dir={data_dir} --file_format=array_record` where there is internet) "
            "or set task.download=True."
        ) from error
    features = sources["train"].dataset_info.features
    for language in (source_language, target_language):
        if language not in features:
            raise ConfigError(f"{name} has no language {language!r}; it has {', '.join(features.keys())}")
    return sources, source_language, target_language
