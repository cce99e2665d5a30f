"""Prepares TFDS catalog datasets as array_record in a data_dir, for tasks/catalog.py to read.

    make prepare DATASET=wmt14_translate/de-en [DATA_DIR=dir] [MANUAL_DIR=dir]
    .venv-prepare/bin/python tools/prepare_catalog.py NAME [NAME ...] [--data_dir=DIR] [--manual_dir=DIR]

It runs in the preparation environment `.venv-prepare` (requirements-prepare.txt), not in the
training one: TFDS's download manager extracts archives with `tf.io.gfile` and some builders
(coco_captions) import TensorFlow, while training stays free of TensorFlow. Of the project it
imports utils/tfds_names.py alone (TFDS and the standard library), so it runs with that
environment's packages.

`--data_dir` defaults to `$TFDS_DATA_DIR`, else `data/tfds` (training's default `config.data_dir`).
Downloads are kept in `DATA_DIR/downloads` (delete them once prepared). A dataset already prepared
there is left as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import tensorflow_datasets as tfds

# Run as a file from any folder: the project's root on the path, for utils/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from utils.tfds_names import name_problem  # noqa: E402

# what tfds.data_source (and so Grain) reads with random access
FILE_FORMAT = "array_record"


class PrepareError(Exception):
    """Input the user got wrong (a name, a missing manual download): shown as one line."""


def default_data_dir() -> str:
    """`$TFDS_DATA_DIR` where set (TFDS's own convention), else training's default `data/tfds`."""
    return os.environ.get("TFDS_DATA_DIR") or "data/tfds"


def builder_of(name: str, data_dir: str):
    """The registered TFDS builder `name` (`dataset[/config][:version]`) writing to `data_dir`."""
    problem = name_problem(name)
    if problem:
        raise PrepareError(problem)
    return tfds.builder(name, data_dir=data_dir, file_format=FILE_FORMAT)


def prepare(name: str, data_dir: str, manual_dir: str | None = None) -> Path:
    """Downloads, extracts and writes `name` as array_record under `data_dir`; returns its folder.

    `manual_dir` holds the files a builder cannot download itself (e.g. WMT's CzEng for cs-en);
    TFDS's default is `data_dir/downloads/manual`.
    """
    builder = builder_of(name, data_dir)
    config = tfds.download.DownloadConfig(manual_dir=manual_dir)
    try:
        builder.download_and_prepare(download_config=config, file_format=FILE_FORMAT)
    except AssertionError as error:
        # TFDS's builders report a missing manual download this way
        if "manual" not in str(error).lower():
            raise
        raise PrepareError(
            f"{name}: {' '.join(str(error).split())} (give that folder with --manual_dir=DIR)"
        ) from error
    return Path(builder.data_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", help="e.g. wmt14_translate/de-en, coco_captions")
    parser.add_argument("--data_dir", default=default_data_dir(), help="default: $TFDS_DATA_DIR, else data/tfds")
    parser.add_argument("--manual_dir", default=None, help="the folder of manually downloaded files")
    args = parser.parse_args(argv)
    for name in args.names:
        try:
            folder = prepare(name, args.data_dir, args.manual_dir)
        except PrepareError as error:
            print(f"prepare_catalog: {error}", file=sys.stderr)
            return 2
        print(f"prepared {name} in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
