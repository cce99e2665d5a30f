"""TFDS catalog datasets by name: translation, e.g. `wmt14_translate/de-en`, `ted_hrlr_translate/pt_to_en`,
and captioning, `coco_captions` (each image with its captions; resized to `task.height x task.width`).

The data must already be prepared as array_record, by `make prepare DATASET=NAME DATA_DIR=DIR`
(tools/prepare_catalog.py, in its own environment with TensorFlow: TFDS needs it to prepare, training
does not). A dataset is read from `data_dir`, or, where it is not prepared there, from
`$TFDS_DATA_DIR`, where the prepare command puts it by default. It is read from its files alone
(its dataset_info.json), so a builder that imports TensorFlow (coco_captions) reads without it.
Records hold one text feature per language; the source and target languages come from the
config name (`de-en`, `pt_to_en`) unless given, and `reverse=True` swaps them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import pkgutil
import re

import numpy as np
import tensorflow_datasets as tfds
import tensorflow_datasets.translate
from PIL import Image
from tensorflow_datasets.core import read_only_builder, registered

from tasks.image_captions import resized
from utils.errors import ConfigError, DataError
from utils.tfds_names import name_problem, prepare_command

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
        except ImportError:
            # builders that need TensorFlow itself
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


IMAGE_DATASETS = ("coco_captions",)
# Karpathy and Li's splits
CAPTION_SPLIT_NAMES = {"train": "train+restval", "dev": "val", "test": "test"}
# COCO has at least five per image; record i is caption i % 5 of image i // 5
CAPTIONS_PER_IMAGE = 5


def inputs_of(name: str) -> str:
    """ "image" for the catalog's captioning datasets, else "text"."""
    return "image" if name.split("/")[0] in IMAGE_DATASETS else "text"


@dataclasses.dataclass(frozen=True)
class CatalogConfig:
    """The parameters of a TFDS catalog task."""

    # "" = from the config name (`de-en`: de)
    source_language: str = ""
    # "" = from the config name (`de-en`: en)
    target_language: str = ""
    # swap source and target (`wmt14_translate/de-en` with reverse: en -> de)
    reverse: bool = False
    # let TFDS download and prepare here (internet, and TensorFlow for most: use make prepare)
    download: bool = False


def load_catalog(name: str, data_dir: str, config: CatalogConfig):
    """Returns `({split: random-access source}, source_key, target_key)`."""
    register_translation_builders()
    source_language, target_language = config.source_language, config.target_language
    if not (source_language and target_language):
        source_language, target_language = languages_of(name)
    if config.reverse:
        source_language, target_language = target_language, source_language
    sources = data_sources(name, data_dir, SPLIT_NAMES, config.download)
    features = sources["train"].dataset_info.features
    for language in (source_language, target_language):
        if language not in features:
            raise ConfigError(f"{name} has no language {language!r}; it has {', '.join(features.keys())}")
    return sources, source_language, target_language


@dataclasses.dataclass(frozen=True)
class CaptionCatalogConfig:
    """The parameters of a TFDS catalog captioning task."""

    # images are resized to height x width (RGB)
    height: int = 64
    width: int = 64
    # let TFDS download and prepare here (internet, and TensorFlow for most: use make prepare)
    download: bool = False


class CaptionRecords:
    """A TFDS captioning split as random-access records of one caption each,
    `{'image': [height, width, 3] uint8, 'caption': text, 'image_file': name}`: record i is caption
    `i % 5` of image `i // 5` (an image with fewer captions repeats them)."""

    def __init__(self, source, height: int, width: int):
        self.source, self.height, self.width = source, height, width

    def __len__(self) -> int:
        return len(self.source) * CAPTIONS_PER_IMAGE

    def references(self, index: int) -> list[str]:
        """Every caption of record `index`'s image."""
        return [
            text.decode() if isinstance(text, bytes) else str(text)
            for text in self.source[int(index) // CAPTIONS_PER_IMAGE]["captions"]["text"]
        ]

    def __getitem__(self, index: int) -> dict:
        record = self.source[int(index) // CAPTIONS_PER_IMAGE]
        texts = record["captions"]["text"]
        if len(texts) == 0:
            raise DataError(f"an image of the catalog has no caption: {record.get('image/filename')!r}")
        image = resized(Image.fromarray(np.asarray(record["image"], np.uint8)), self.height, self.width, 3)
        name = record.get("image/filename", str(int(index) // CAPTIONS_PER_IMAGE))
        caption = texts[int(index) % CAPTIONS_PER_IMAGE % len(texts)]
        return {
            "image": image,
            "caption": caption.decode() if isinstance(caption, bytes) else str(caption),
            "image_file": name.decode() if isinstance(name, bytes) else str(name),
        }


def load_caption_catalog(name: str, data_dir: str, config: CaptionCatalogConfig) -> dict:
    """`{split: CaptionRecords}` of a prepared TFDS captioning dataset."""
    sources = data_sources(name, data_dir, CAPTION_SPLIT_NAMES, config.download)
    return {split: CaptionRecords(source, config.height, config.width) for split, source in sources.items()}


def data_sources(name: str, data_dir: str, split_names: dict[str, str], download: bool) -> dict:
    """`{split: TFDS random-access source}` of a prepared catalog dataset, or an error saying how to prepare it."""
    check_catalog_name(name)
    # TFDS prepares it here, in this environment (most builders need TensorFlow for that)
    if download:
        return {
            split: tfds.data_source(name, split=tfds_split, data_dir=data_dir, download=True)
            for split, tfds_split in split_names.items()
        }
    builder = prepared_builder(name, data_dir)
    return {split: builder.as_data_source(split=tfds_split) for split, tfds_split in split_names.items()}


def catalog_data_dirs(data_dir: str) -> list[str]:
    """Where a prepared catalog dataset is looked for, in order: `data_dir`, then `$TFDS_DATA_DIR`."""
    environment = os.environ.get("TFDS_DATA_DIR", "")
    return [data_dir] + ([environment] if environment and environment != data_dir else [])


def prepared_builder(name: str, data_dir: str):
    """The read-only TFDS builder of `name` prepared as array_record in the first of
    `catalog_data_dirs(data_dir)` that has it; a DataError naming the command that prepares it."""
    for directory in catalog_data_dirs(data_dir):
        try:
            builder = read_only_builder.builder_from_files(name, data_dir=directory)
        except registered.DatasetNotFoundError:
            continue
        if builder.info.file_format != tfds.core.FileFormat.ARRAY_RECORD:
            raise DataError(
                f"TFDS dataset {name!r} in {builder.data_path} is prepared as {builder.info.file_format.value}, "
                "not array_record (random access needs it): "
                f"remove that folder and run {prepare_command(name, directory)}"
            )
        return builder
    raise DataError(
        f"TFDS dataset {name!r} is not prepared in {' nor '.join(catalog_data_dirs(data_dir))}; "
        f"prepare it with: {prepare_command(name, data_dir)}"
    )


def check_catalog_name(name: str) -> None:
    """A ConfigError naming a dataset or config that TFDS's catalog does not have, with the nearest names."""
    register_translation_builders()
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"task.name {name!r}: {problem}")
