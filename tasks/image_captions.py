"""`image_captions`: a local captioning dataset in the Flickr8k layout.

A folder of images (`task.images`) and, per split, a `.tsv` of `image_file<TAB>caption`
lines (`task.train`, `task.dev`, `task.test`); an image may have several captions, one
per line, and each line is an example. Images are read with Pillow, converted to grey
(`task.channels=1`) or RGB (3) and resized to `task.height x task.width` at build time.
The TSVs are read as `parallel_text` reads its own: blank lines, lines with the wrong
field count, an empty caption or invalid UTF-8, and images that are missing or unreadable,
are skipped, counted by reason and reported with `file:line`. The TSVs' and the images'
contents are part of the build's identity.
At evaluation, a generated caption is scored against every caption of its image.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image, UnidentifiedImageError

from tasks.parallel_text import Skipped, resolve, tsv_rows, two_texts
from tasks.task_builder import DIGESTS_MEMO, SPLITS, TaskConfig, TextPairBuilder, prepare
from utils import files
from utils.errors import ConfigError, DataError


@dataclasses.dataclass(eq=False)
class ImageCaptionsConfig(TaskConfig):
    # the folder the TSVs' image files are read from
    images: str = ""
    # image_file<TAB>caption per line
    train: str = ""
    dev: str = ""
    test: str = ""
    # images are resized to height x width
    height: int = 64
    width: int = 64
    # 1: grey, 3: RGB
    channels: int = 3
    # filled in by `with_digest`: content hash of every file read
    files_digest: str = ""

    @classmethod
    def defaults(cls) -> dict:
        # not a user's parameter
        return {k: v for k, v in super().defaults().items() if k != "files_digest"}

    def __post_init__(self):
        if self.channels not in (1, 3):
            raise ConfigError(f"image_captions: task.channels must be 1 (grey) or 3 (RGB), got {self.channels}")
        if self.height < 1 or self.width < 1:
            raise ConfigError(
                f"image_captions: task.height and task.width must be positive, got {self.height}x{self.width}"
            )


def folder(config: ImageCaptionsConfig) -> Path:
    path = Path(config.images)
    if not config.images or not path.is_dir():
        raise DataError(f"image_captions: task.images must be the folder of the images, got {config.images!r}")
    return path


def tsv_of(config: ImageCaptionsConfig, split: str) -> Path:
    if not getattr(config, split):
        raise ConfigError(f"image_captions: task.{split} is empty; give the split's image_file<TAB>caption .tsv")
    return resolve(getattr(config, split), f"task.{split}")


def read_lines(path: Path, skipped: Skipped) -> list[tuple[int, str, str]]:
    """`(line number, image file, caption)` of the well-formed lines of one TSV."""
    lines = []
    for number, image_file, caption in two_texts(tsv_rows(path), path, skipped):
        if not caption:
            skipped.add("an empty caption", path, number)
            continue
        lines.append((number, image_file, caption))
    return lines


def resized(image: Image.Image, height: int, width: int, channels: int) -> np.ndarray:
    """`image` as `[height, width, channels]` uint8: grey (1) or RGB (3), resized bilinearly (as
    every image task and inference read their images)."""
    image = image.convert("L" if channels == 1 else "RGB").resize((width, height), Image.BILINEAR)
    array = np.asarray(image, np.uint8)
    return array[..., None] if array.ndim == 2 else array


def load_image(path: Path, config: ImageCaptionsConfig) -> np.ndarray:
    """`[height, width, channels]` uint8; raises OSError for a missing or unreadable file."""
    with Image.open(path) as image:
        return resized(image, config.height, config.width, config.channels)


def read_split(config: ImageCaptionsConfig, split: str, skipped: Skipped) -> list[dict]:
    path, images = tsv_of(config, split), folder(config)
    examples, cache = [], {}
    for number, image_file, caption in read_lines(path, skipped):
        if image_file not in cache:
            try:
                cache[image_file] = load_image(images / image_file, config)
            except (OSError, UnidentifiedImageError, ValueError):
                cache[image_file] = None
        if cache[image_file] is None:
            skipped.add("a missing or unreadable image", path, number)
            continue
        examples.append({"image": cache[image_file], "caption": caption, "image_file": image_file})
    if not examples:
        raise DataError(f"image_captions: the {split} split ({path}) has no usable line: {skipped.summary()}")
    return examples


def with_digest(config: ImageCaptionsConfig, memo: Path) -> dict:
    """The parameters plus a digest of the TSVs and the images they name (edits rebuild the data),
    remembered in `memo` while those files are unchanged (`files.remembered`)."""
    images = folder(config)
    tsvs = [tsv_of(config, split) for split in SPLITS]
    named = {tsv: [image_file for _, image_file, _ in read_lines(tsv, Skipped())] for tsv in tsvs}

    def digest() -> str:
        running = hashlib.sha256()
        for tsv in tsvs:
            files.feed(running, tsv)
            for image_file in named[tsv]:
                candidate = images / image_file
                running.update(image_file.encode())
                if candidate.is_file():
                    files.feed(running, candidate)
                else:
                    running.update(b"(missing)")
        return running.hexdigest()[:16]

    paths = tsvs + [images / image_file for tsv in tsvs for image_file in named[tsv]]
    return {**config.parameters(), "files_digest": files.remembered(memo, paths, digest)}


class ImageCaptions(TextPairBuilder):
    """Local images with captions (the Flickr8k layout)."""

    # 1.0.1: lines end at \n only (a lone \r stays inside its line)
    VERSION = tfds.core.Version("1.0.1")
    BUILDER_CONFIG_CLASS = ImageCaptionsConfig

    def _features(self):
        config = self.builder_config
        return {
            "image": tfds.features.Tensor(shape=(config.height, config.width, config.channels), dtype=np.uint8),
            "caption": tfds.features.Text(),
            "image_file": tfds.features.Text(),
        }

    def _split_examples(self):
        skipped = Skipped()
        splits = {split: read_split(self.builder_config, split, skipped) for split in SPLITS}
        self.build_report = {"skipped": dict(skipped.counts), "messages": skipped.messages()}
        return splits


def prepare_image_captions(data_dir: str, **params):
    """Builds (or reuses) the dataset; the files' digest makes a changed file a new build."""
    config = ImageCaptionsConfig.create(**params)
    return prepare(ImageCaptions, data_dir, **with_digest(config, Path(data_dir) / DIGESTS_MEMO))
