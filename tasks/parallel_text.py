"""`parallel_text`: a local parallel corpus.

Each of `train`, `dev`, `test` is either a `.tsv` file (`source<TAB>target` per
line) or a path prefix of two line-aligned files `PREFIX.<source_suffix>` and
`PREFIX.<target_suffix>` (the Moses convention: `train.de`, `train.en`). When
`dev` or `test` is empty, it is split off `train` deterministically by a hash
of the line (`dev_fraction`, `test_fraction`).

Lines end at `\n` (a `\r\n` ending is accepted; a stray `\r` inside a line does
not end it, so line-aligned files stay aligned). Malformed lines (blank, invalid
UTF-8, a wrong field count, an empty side) are skipped, counted by reason, and
reported with `file:line` examples at build time and whenever the data is
loaded. A missing file or an empty split stops the build with a message naming
it. The files' contents are part of the config's identity: editing a file
rebuilds the data, and every run reads the files (to find its built copy), so a
file deleted or moved after the build stops the run until it is restored or
`task.*` points to its new place.

Relative paths are looked up from the working directory, then from the
project root (so the shipped `data/kjv_web` works from anywhere).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import tensorflow_datasets as tfds

from tasks import task_builder
from tasks.task_builder import DIGESTS_MEMO, SPLITS, TaskConfig, TextPairBuilder, prepare
from utils import files, progress
from utils.errors import ConfigError, DataError

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# per reason
MAX_REPORTED_LINES = 5


@dataclasses.dataclass(eq=False)
class ParallelTextConfig(TaskConfig):
    train: str = "data/kjv_web/train.tsv"
    dev: str = "data/kjv_web/dev.tsv"
    test: str = "data/kjv_web/test.tsv"
    source_suffix: str = ""
    target_suffix: str = ""
    dev_fraction: float = 0.02
    test_fraction: float = 0.02
    # filled in by `with_digest`: content hash of every file read
    files_digest: str = ""

    @classmethod
    def defaults(cls) -> dict:
        # not a user's parameter
        return {k: v for k, v in super().defaults().items() if k != "files_digest"}


def resolve(path: str, field: str) -> Path:
    """`path` (given as config field `field`, e.g. `task.train`) from the working directory, else
    from the project root; a clear error if neither."""
    candidates = [Path(path)] if Path(path).is_absolute() else [Path.cwd() / path, PROJECT_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DataError(
        f"{field}: file not found: {path} (looked in {', '.join(map(str, candidates))}); restore it or set {field} "
        "to where it is now (its contents identify the built data, so it is needed even after the build)"
    )


def files_of(config: ParallelTextConfig, split: str) -> list[Path]:
    """The one `.tsv` or the two line-aligned files of a split (empty if it is split off train)."""
    spec = getattr(config, split)
    if not spec:
        if split == "train":
            raise ConfigError("parallel_text: task.train is empty; give a .tsv file or a path prefix")
        return []
    if spec.endswith(".tsv"):
        return [resolve(spec, f"task.{split}")]
    if not (config.source_suffix and config.target_suffix):
        raise ConfigError(
            f"parallel_text: {split} file {spec!r} is not a .tsv; for line-aligned files set "
            "task.source_suffix and task.target_suffix"
        )
    return [resolve(f"{spec}.{suffix}", f"task.{split}") for suffix in (config.source_suffix, config.target_suffix)]


def with_digest(config: ParallelTextConfig, memo: Path) -> dict:
    """The config's parameters plus a digest of the files' contents (so edits trigger a rebuild),
    remembered in `memo` while the files are unchanged (`files.remembered`)."""
    by_split = {split: files_of(config, split) for split in SPLITS}
    paths = [path for split in SPLITS for path in by_split[split]]

    def digest() -> str:
        running = hashlib.sha256()
        for split in SPLITS:
            for index, path in enumerate(by_split[split]):
                # each file's part and length, not its place: the same corpus elsewhere (a fresh clone)
                # finds its built copy
                running.update(f"{split} {index} {path.stat().st_size}\n".encode())
                # in pieces: a corpus may be gigabytes
                files.feed(running, path)
        return running.hexdigest()[:16]

    return {**config.parameters(), "files_digest": files.remembered(memo, paths, digest)}


class Skipped:
    """Counts of skipped lines by reason, with the first few `file:line` of each."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def add(self, reason: str, path: Path, line_number: int) -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < MAX_REPORTED_LINES:
            self.examples[reason].append(f"{path}:{line_number}")

    def messages(self) -> list[str]:
        return [
            f"skipped {count} line(s) with {reason}, e.g. {', '.join(self.examples[reason])}"
            for reason, count in sorted(self.counts.items())
        ]

    def summary(self) -> str:
        """The messages on one line (for the error of a split left empty)."""
        return "; ".join(self.messages()) or "no lines"


def numbered_lines(path: Path, offset: int = 0, number: int = 1) -> Iterator[tuple[int, int, bytes]]:
    """`(byte offset, line number, line)` of a file's lines from byte `offset` (which starts line
    `number`), read as a stream: split at `\n` only, a `\r` before it dropped (CRLF files)."""
    with open(path, "rb") as file:
        file.seek(offset)
        # a binary file's lines end at b"\n" alone
        for line in file:
            start, offset = offset, offset + len(line)
            line = line[:-1] if line.endswith(b"\n") else line
            yield start, number, line[:-1] if line.endswith(b"\r") else line
            number += 1


def tsv_rows(path: Path) -> list[tuple[int, list[bytes]]]:
    """`(line number, tab-separated fields)` of every line of a `.tsv`."""
    return [(number, line.split(b"\t")) for _, number, line in numbered_lines(path)]


def valid_texts(number: int, fields: list[bytes], path: Path, skipped: Skipped) -> tuple[str, str] | None:
    """The two stripped texts of a row of exactly two UTF-8 fields, else None with the row counted in
    `skipped` under its reason (each line is decoded on its own)."""
    try:
        texts = [field.decode("utf-8").strip() for field in fields]
    except UnicodeDecodeError:
        skipped.add("invalid UTF-8", path, number)
        return None
    if texts == [""]:
        skipped.add("a blank line", path, number)
    elif len(texts) != 2:
        skipped.add(f"{len(texts)} tab-separated fields instead of 2", path, number)
    else:
        return texts[0], texts[1]
    return None


def two_texts(rows: Iterable[tuple[int, list[bytes]]], path: Path, skipped: Skipped) -> Iterator[tuple[int, str, str]]:
    """`(line number, first, second)`, stripped, of the rows of exactly two UTF-8 fields; the other
    rows are counted in `skipped` under their reason."""
    for number, fields in rows:
        texts = valid_texts(number, fields, path, skipped)
        if texts is not None:
            yield number, *texts


def rows_from(
    paths: list[Path], offsets: tuple[int, ...] = (0, 0), number: int = 1
) -> Iterator[tuple[tuple[int, ...], int, list[bytes]]]:
    """`(byte offsets, line number, fields)` of the rows of one `.tsv` or two line-aligned files, from
    `offsets` (which start line `number`), read as a stream. Raises DataError, once the shorter of two
    files ends, when they do not have as many lines."""
    if len(paths) == 1:
        for offset, line_number, line in numbered_lines(paths[0], offsets[0], number):
            yield (offset,), line_number, line.split(b"\t")
        return
    streams = [numbered_lines(path, offset, number) for path, offset in zip(paths, offsets)]
    for first, second in itertools.zip_longest(*streams):
        if first is None or second is None:
            # the first line one file lacks
            number = (first or second)[1]
            counts = [
                number - 1 if row is None else number + sum(1 for _ in stream)
                for row, stream in zip((first, second), streams)
            ]
            raise DataError(f"parallel_text: {paths[0]} has {counts[0]} lines but {paths[1]} has {counts[1]}")
        yield (first[0], second[0]), first[1], [first[2], second[2]]


def pair_of(number: int, fields: list[bytes], path: Path, skipped: Skipped) -> tuple[str, str] | None:
    """The `(source, target)` of a row, or None (counted in `skipped`) for a malformed one."""
    texts = valid_texts(number, fields, path, skipped)
    if texts is not None and not all(texts):
        skipped.add("an empty side", path, number)
        return None
    return texts


def read_pairs(paths: list[Path], skipped: Skipped) -> list[dict]:
    """Valid `{'source', 'target', 'origin'}` pairs of one `.tsv` or two line-aligned files."""
    pairs = ((number, pair_of(number, fields, paths[0], skipped)) for _, number, fields in rows_from(paths))
    return [example(pair, paths[0], number) for number, pair in pairs if pair is not None]


def example(pair: tuple[str, str], path: Path, number: int) -> dict:
    """A record: the pair and where it comes from (`file:line`, for error reports and analysis)."""
    return {"source": pair[0], "target": pair[1], "origin": f"{path.name}:{number}"}


def held_out_split(pair: tuple[str, str], dev_fraction: float, test_fraction: float) -> str:
    """Deterministic split of a pair by a hash of its text."""
    bucket = int(hashlib.sha256(f"{pair[0]}\t{pair[1]}".encode()).hexdigest()[:8], 16) / 2**32
    if bucket < test_fraction:
        return "test"
    return "dev" if bucket < test_fraction + dev_fraction else "train"


def derived_splits(config: ParallelTextConfig) -> tuple[str, ...]:
    """The splits split off train by `held_out_split` (those given no files of their own)."""
    return tuple(split for split in ("dev", "test") if not getattr(config, split))


def split_of(pair: tuple[str, str], read_for: str, config: ParallelTextConfig) -> str:
    """The split of a pair read from the files of split `read_for`: train's own lines may go to a derived split."""
    if read_for != "train" or not derived_splits(config):
        return read_for
    split = held_out_split(pair, config.dev_fraction, config.test_fraction)
    return split if split in derived_splits(config) else "train"


@dataclasses.dataclass
class Survey:
    """One streaming pass over the files: each split's size and where each of its shards starts."""

    counts: dict[str, int]
    # per split, per shard: (byte offsets, line number)
    starts: dict[str, list[tuple[tuple[int, ...], int]]]
    skipped: Skipped


def survey_corpus(config: ParallelTextConfig, shard_examples: int) -> Survey:
    """Reads every file once, row by row, counting each split's pairs and noting where every
    `shard_examples`-th starts; a DataError names an empty split."""
    found = Survey({split: 0 for split in SPLITS}, {split: [] for split in SPLITS}, Skipped())
    for read_for in (split for split in SPLITS if getattr(config, split)):
        paths = files_of(config, read_for)
        with progress.phase(f"reading {paths[0].name}", unit="lines") as shown:
            for offsets, number, fields in rows_from(paths):
                shown.advance()
                pair = pair_of(number, fields, paths[0], found.skipped)
                if pair is None:
                    continue
                split = split_of(pair, read_for, config)
                if found.counts[split] % shard_examples == 0:
                    found.starts[split].append((offsets, number))
                found.counts[split] += 1
    for split, count in found.counts.items():
        if not count:
            origin = getattr(config, split) or f"the {split}_fraction of {config.train}"
            raise DataError(f"parallel_text: the {split} split is empty (from {origin}): {found.skipped.summary()}")
    return found


def shard_examples(
    config: ParallelTextConfig, split: str, start: tuple[tuple[int, ...], int], count: int
) -> Iterator[dict]:
    """The `count` examples of `split` from `start` (byte offsets, line number), read as a stream."""
    read_for = split if getattr(config, split) else "train"
    paths, made = files_of(config, read_for), 0
    for _, number, fields in rows_from(paths, *start):
        # counted once, by the survey
        pair = pair_of(number, fields, paths[0], Skipped())
        if pair is not None and split_of(pair, read_for, config) == split:
            yield example(pair, paths[0], number)
            made += 1
            if made == count:
                return


class ParallelText(TextPairBuilder):
    """A local parallel corpus (TSV or line-aligned files), read as a stream: a survey pass counts
    the splits and marks where each shard starts, then each shard is read from its mark and
    written; memory holds a shard, whatever the corpus's size."""

    # 1.0.1: lines end at \n only (a lone \r stays inside its line)
    VERSION = tfds.core.Version("1.0.1")
    BUILDER_CONFIG_CLASS = ParallelTextConfig
    # file:line, for error reports and analysis
    EXTRA_FEATURES = {"origin": tfds.features.Text()}

    def _split_shards(self):
        config, size = self.builder_config, task_builder.SHARD_EXAMPLES
        found = survey_corpus(config, size)
        self.build_report = {"skipped": dict(found.skipped.counts), "messages": found.skipped.messages()}
        self.split_sizes = found.counts
        return {
            split: [
                functools.partial(shard_examples, config, split, start, min(size, found.counts[split] - k * size))
                for k, start in enumerate(found.starts[split])
            ]
            for split in SPLITS
        }


def prepare_parallel_text(data_dir: str, **params):
    """Builds (or reuses) the corpus; the file digest makes a changed file a new build."""
    config = ParallelTextConfig.create(**params)
    return prepare(ParallelText, data_dir, **with_digest(config, Path(data_dir) / DIGESTS_MEMO))
