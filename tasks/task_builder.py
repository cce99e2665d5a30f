"""What every task builder shares: text-pair features, parameter-named configs, build-or-reuse.

A task is a TFDS builder whose examples are `{'source': text, 'target': text}`
(plus task-specific extras such as the dates' alignment spans), written once to
array_record files under `data_dir` and read back with random access. The
builder config's name is made from its parameters, so changing a parameter (or
the builder's VERSION) builds a new copy instead of reusing a stale one.

Built data that was damaged after the build stops the run with a DataError naming
the shard and the fix (delete the dataset's folder; the next run rebuilds it):
at load time, a shard that is missing, not of the size the build wrote (a
truncated or appended-to file), or whose index is unreadable or does not hold the
records TFDS counted (cheap: a stat and the file's footer per shard); when a
record is read, a record whose bytes were overwritten (ArrayRecord keeps a hash of
every chunk; the input pipeline reads every record of a split before its first
batch, so a training run stops before its first step). Not detected: bytes
overwritten in a shard's padding after its last chunk (harmless: no record lies
there), and a shard replaced by another complete, valid one of the same size.
Data built before shard sizes were recorded gets every check but the size.
"""

from __future__ import annotations

import bisect
import collections.abc
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import multiprocessing
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import tensorflow_datasets as tfds
from array_record.python import array_record_module
from google.protobuf import json_format

from utils import files, progress, stop_signals
from utils.errors import ConfigError, DataError

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
    """Base of the task parameters; subclasses add fields. The name is derived from them."""

    def parameters(self) -> dict[str, Any]:
        base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in base}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every parameter with its default (what `configs/base.py` `task()` starts from)."""
        base = {f.name for f in dataclasses.fields(tfds.core.BuilderConfig)}
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name not in base}

    def check_sizes(self) -> None:
        """Every `*_size` parameter (a split's or the vocabulary's) is a positive number of examples:
        an empty split would stop the run later, after the data was built."""
        for name, value in self.parameters().items():
            if name.endswith("_size") and isinstance(value, int) and value < 1:
                raise ConfigError(f"task.{name} must be at least 1, got {value}")

    @classmethod
    def create(cls, **params) -> TaskConfig:
        """A config whose name is a digest of its parameters, e.g. `p3f9c2a1b0d4e`."""
        known = {f.name for f in dataclasses.fields(cls)} - {
            f.name for f in dataclasses.fields(tfds.core.BuilderConfig)
        }
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"unknown task parameter(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        config = cls(name="pending", **params)
        config.check_sizes()
        digest = hashlib.sha256(json.dumps(config.parameters(), sort_keys=True, default=str).encode()).hexdigest()
        config.name = "p" + digest[:12]
        config.description = json.dumps(config.parameters(), sort_keys=True, default=str)
        return config


# examples per array_record shard: a writing process holds at most one shard's
SHARD_EXAMPLES = 100_000


class TextPairBuilder(tfds.core.ShardBasedBuilder):
    """A builder of `{'source', 'target'}` text pairs.

    Subclasses set `VERSION` and `BUILDER_CONFIG_CLASS`, may add `EXTRA_FEATURES`,
    and implement `_split_examples() -> {split: list of examples}`, or, for data too large
    for memory, `_split_shards() -> {split: [callable -> iterator of examples, one per shard]}`.
    They may record a build report (e.g. skipped lines) in `self.build_report`;
    it is stored with the data and logged whenever the data is loaded.

    Each shard is written as its examples come, in order, as `tfds.core.ShardBasedBuilder` does
    (in a pool over all cores when a split has several): TFDS's `GeneratorBasedBuilder` would
    first gather every example of a split in its shuffler, which holds them all in memory and past
    1 GB spills them through `tf.io.gfile` (TensorFlow, absent here): a corpus of WMT's size could
    not be built. The shard callables go to other processes: they must pickle.
    """

    EXTRA_FEATURES: ClassVar[Mapping[str, tfds.features.FeatureConnector]] = {}

    def __init__(self, *, config: TaskConfig, data_dir: str):
        self.build_report: dict[str, Any] = {}
        # examples per split where known before the build (for progress)
        self.split_sizes: dict[str, int] = {}
        super().__init__(config=config, data_dir=data_dir, file_format="array_record")

    def _features(self) -> dict[str, tfds.features.FeatureConnector]:
        """An example's features (image tasks replace the text pair)."""
        return {"source": tfds.features.Text(), "target": tfds.features.Text(), **self.EXTRA_FEATURES}

    def _info(self) -> tfds.core.DatasetInfo:
        features = self._features()
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict(features),
            metadata=tfds.core.MetadataDict(),
            # keep generation order: index i is the i-th example
            disable_shuffling=True,
        )

    # required by TFDS; our _download_and_prepare writes the shards
    def _shard_iterators_per_split(self, dl_manager):
        raise NotImplementedError

    def _split_shards(self) -> dict[str, list[Callable[[], Iterator[dict[str, Any]]]]]:
        """`{split: one callable per shard, giving its examples}`: by default `_split_examples` cut in shards."""
        return {split: list_shards(examples) for split, examples in self._split_examples().items()}

    def _split_examples(self) -> dict[str, Sequence[dict[str, Any]]]:
        raise NotImplementedError

    def _download_and_prepare(self, dl_manager, download_config=None):
        """`ShardBasedBuilder`'s, with the shards written by a pool of processes over all cores when a
        split has more than one (TFDS's encoding and writing take one core, about 19,000 examples/s)."""
        # everything is generated or read locally
        del dl_manager, download_config
        shards = self._split_shards()
        templates = {split: self._get_filename_template(split) for split in shards}
        jobs = [
            (
                self.info.features.to_json(),
                self.info.file_format,
                templates[split].sharded_filepath(shard_index=index, num_shards=len(made)),
                shard,
            )
            for split, made in shards.items()
            for index, shard in enumerate(made)
        ]
        total = sum(self.split_sizes.values()) if set(self.split_sizes) >= set(shards) else None
        with progress.phase(f"building {self.name}", total=total, unit="examples") as shown:
            # a split of several shards: worth a pool's start
            if len(jobs) > len(shards):
                with stop_signals.children_leave_ctrl_c_to_us():
                    pool = multiprocessing.get_context("spawn").Pool(min(os.cpu_count() or 1, len(jobs)))
                with pool:
                    counts = [shown.advance(count) or count for count in pool.imap(write_shard, jobs)]
            else:
                counts = [shown.advance(count) or count for count in map(write_shard, jobs)]
        infos, first = [], 0
        for split, made in shards.items():
            paths = [job[2] for job in jobs[first : first + len(made)]]
            infos.append(
                tfds.core.SplitInfo(
                    name=split,
                    shard_lengths=counts[first : first + len(made)],
                    num_bytes=sum(path.stat().length for path in paths),
                    filename_template=templates[split],
                )
            )
            first += len(made)
        self.info.set_splits(tfds.core.SplitDict(infos))
        self.info.metadata["build_report"] = self.build_report
        self.info.metadata["shard_bytes"] = {shard.name: shard.stat().st_size for shard, _ in shards_of(self.info)}


def write_shard(job: tuple) -> int:
    """Writes one shard: `(features as JSON, file format, path, callable giving its examples)` -> its
    number of examples. Encoded and serialized as TFDS's own shard writer does."""
    from tensorflow_datasets.core import example_serializer, writer

    features_json, file_format, path, shard = job
    features = tfds.features.FeatureConnector.from_json(features_json)
    serializer = example_serializer.ExampleSerializer(features.get_serialized_info())
    serialize = text_serializer(features) or (
        lambda example: serializer.serialize_example(features.encode_example(example))
    )
    count = 0

    def serialized() -> Iterator[tuple[int, bytes]]:
        nonlocal count
        for count, example in enumerate(shard(), start=1):
            yield count, serialize(example)

    writer.ExampleWriter(file_format).write(path, serialized())
    return count


def text_serializer(features: tfds.features.FeaturesDict) -> Callable[[Mapping[str, str]], bytes] | None:
    """Where every feature is a Text (a corpus's pairs and origins), an example's tf.train.Example
    bytes made directly: each text one UTF-8 value of a bytes_list, the message TFDS's serializer writes,
    about eight times faster (its serializer was two thirds of a build's time). None for other features."""
    from tensorflow_datasets.proto import tf_example_pb2

    if not all(type(feature) is tfds.features.Text for feature in features.values()):
        return None

    def serialize(example: Mapping[str, str]) -> bytes:
        proto = tf_example_pb2.Example()
        for key, value in example.items():
            proto.features.feature[key].bytes_list.value.append(
                value.encode("utf-8") if isinstance(value, str) else value
            )
        return proto.SerializeToString()

    return serialize


def list_shards(
    examples: Sequence[dict[str, Any]], size: int | None = None
) -> list[Callable[[], Iterator[dict[str, Any]]]]:
    """Callables giving the examples of each shard of `size` (`SHARD_EXAMPLES`) of a list, in order."""
    size = size or SHARD_EXAMPLES
    return [functools.partial(iter, examples[start : start + size]) for start in range(0, max(len(examples), 1), size)]


def shards_of(info: tfds.core.DatasetInfo) -> list[tuple[Path, int]]:
    """`(path, records)` of every array_record shard of every split."""
    return [
        (Path(shard.filename), shard.examples_in_shard)
        for split in info.splits.values()
        for shard in split.file_instructions
    ]


def rebuild_fix(folder: os.PathLike) -> str:
    """What to do about damaged built data."""
    return f"delete the folder {folder} and run again to rebuild it"


def records_in(path: Path) -> int | None:
    """The records an array_record file's footer says it holds; None if the file or its footer is unreadable."""
    try:
        reader = array_record_module.ArrayRecordReader(os.fspath(path))
        count = reader.num_records() if reader.ok() else None
        # raises for a file that failed to open
        reader.close()
    except RuntimeError:
        return None
    return count


def shard_problem(path: Path, records: int, size: int | None) -> str | None:
    """What is wrong with a shard the build wrote with `records` records in `size` bytes (None: not
    recorded, an older build), or None."""
    if not path.is_file():
        return "is missing"
    if size is not None and path.stat().st_size != size:
        return f"has {path.stat().st_size} bytes, but the build wrote {size} (truncated or overwritten)"
    found = records_in(path)
    if found is None:
        return "is not a readable array_record file (truncated or overwritten)"
    if found != records:
        return f"holds {found} records, but the build wrote {records} (truncated or overwritten)"
    return None


def check_shards(info: tfds.core.DatasetInfo, fix: str, memo: Path) -> None:
    """Stops at the first shard that is missing, of the wrong size or with an unreadable footer.

    A check passed is remembered in `memo` under the shards' sizes, modification times
    and inodes (`utils.files.remembered`), and not repeated while none of them changes: reading the
    footers of a WMT-sized build's 46 shards took 0.5 s of every start."""
    sizes = info.metadata.get("shard_bytes", {})
    shards = shards_of(info)

    def check() -> str:
        for path, records in shards:
            problem = shard_problem(path, records, sizes.get(path.name))
            if problem:
                raise DataError(f"corrupt built data: {path} {problem}; {fix}")
        return "whole"

    files.remembered(memo, [path for path, _ in shards], check)


class Records(collections.abc.Sequence):
    """One split's records with random access (TFDS's data source); a record that cannot be read
    stops with a DataError naming its shard and `fix` instead of ArrayRecord's RuntimeError."""

    def __init__(self, source, fix: str):
        self.source, self.fix = source, fix
        instructions = source.dataset_info.splits[source.split].file_instructions
        self.shards = [shard.filename for shard in instructions]
        # first record past each shard
        self.ends = list(itertools.accumulate(shard.take for shard in instructions))

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index):
        index = operator.index(index)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        try:
            return self.source[index]
        except RuntimeError as error:
            # ArrayRecord/Riegeli: a hash mismatch, a chunk cut short
            shard = self.shards[bisect.bisect_right(self.ends, index)]
            raise DataError(
                f"corrupt built data: record {index} in {shard} cannot be read ({str(error).split(';')[0]}); {self.fix}"
            ) from error


def built_builder(builder_class: type[TextPairBuilder], config: TaskConfig, data_dir: str) -> TextPairBuilder:
    """The builder of `config` in `data_dir`; a DataError if its recorded dataset_info.json is unreadable."""
    try:
        return builder_class(config=config, data_dir=data_dir)
    except json_format.ParseError as error:
        folder = Path(data_dir) / builder_class.name / config.name / str(builder_class.VERSION)
        raise DataError(
            f"corrupt built data: {folder / 'dataset_info.json'} ({error}); {rebuild_fix(folder)}"
        ) from error


# In a data_dir: the digests of the task files it was built from (`utils.files.remembered`).
DIGESTS_MEMO = "file_digests.json"
# In a built dataset's folder: its shards' facts when they last passed `check_shards`.
SHARDS_CHECKED_MEMO = "shards_checked.json"


def prepare(builder_class: type[TextPairBuilder], data_dir: str, **params) -> tuple[dict[str, Records], dict]:
    """Builds the task's data unless a copy with the same version and parameters exists, and checks
    its shards (`check_shards`).

    Returns:
      `({split: random-access records}, build report)`.
    """
    builder = built_builder(builder_class, builder_class.BUILDER_CONFIG_CLASS.create(**params), data_dir)
    builder.download_and_prepare()
    fix = rebuild_fix(builder.data_path)
    check_shards(builder.info, fix, Path(builder.data_path) / SHARDS_CHECKED_MEMO)
    report = dict(builder.info.metadata.get("build_report", {}))
    return {split: Records(source, fix) for split, source in builder.as_data_source().items()}, report


def text(value: bytes | str) -> str:
    """TFDS returns Text features as bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def log_report(name: str, report: Mapping[str, Any]) -> None:
    for line in report.get("messages", []):
        logging.warning("task %s: %s", name, line)
