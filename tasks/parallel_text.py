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
import hashlib
from pathlib import Path
from typing import Iterable, Iterator

import tensorflow_datasets as tfds

from errors import ConfigError, DataError

from tasks.base import SPLITS, TaskConfig, TextPairBuilder, prepare

PROJECT_ROOT = Path(__file__).resolve().parents[1]
MAX_REPORTED_LINES = 5  # per reason


@dataclasses.dataclass(eq=False)
class ParallelTextConfig(TaskConfig):
    train: str = "data/kjv_web/train.tsv"
    dev: str = "data/kjv_web/dev.tsv"
    test: str = "data/kjv_web/test.tsv"
    source_suffix: str = ""
    target_suffix: str = ""
    dev_fraction: float = 0.02
    test_fraction: float = 0.02
    files_digest: str = ""  # filled in by `with_digest`: content hash of every file read

    @classmethod
    def defaults(cls) -> dict:
        return {k: v for k, v in super().defaults().items() if k != "files_digest"}  # not a user's parameter


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


def with_digest(config: ParallelTextConfig) -> dict:
    """The config's parameters plus a digest of the files' contents (so edits trigger a rebuild)."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for path in files_of(config, split):
            digest.update(str(path).encode())
            digest.update(path.read_bytes())
    params = config.parameters()
    params["files_digest"] = digest.hexdigest()[:16]
    return params


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


def lines_of(path: Path) -> list[bytes]:
    """A file's lines as bytes: split at `\n` only, a `\r` before it dropped (CRLF files)."""
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":  # after the last newline, or an empty file
        lines.pop()
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def tsv_rows(path: Path) -> list[tuple[int, list[bytes]]]:
    """`(line number, tab-separated fields)` of every line of a `.tsv`."""
    return [(number, line.split(b"\t")) for number, line in enumerate(lines_of(path), start=1)]


def two_texts(rows: Iterable[tuple[int, list[bytes]]], path: Path, skipped: Skipped) -> Iterator[tuple[int, str, str]]:
    """`(line number, first, second)`, stripped, of the rows of exactly two UTF-8 fields; the other
    rows are counted in `skipped` under their reason (each line is decoded on its own)."""
    for number, fields in rows:
        try:
            texts = [field.decode("utf-8").strip() for field in fields]
        except UnicodeDecodeError:
            skipped.add("invalid UTF-8", path, number)
            continue
        if texts == [""]:
            skipped.add("a blank line", path, number)
        elif len(texts) != 2:
            skipped.add(f"{len(texts)} tab-separated fields instead of 2", path, number)
        else:
            yield number, texts[0], texts[1]


def read_pairs(paths: list[Path], skipped: Skipped) -> list[dict]:
    """Valid `{'source', 'target', 'origin'}` pairs of one `.tsv` or two line-aligned files."""
    if len(paths) == 1:
        rows = tsv_rows(paths[0])
    else:
        source_lines, target_lines = (lines_of(p) for p in paths)
        if len(source_lines) != len(target_lines):
            raise DataError(
                f"parallel_text: {paths[0]} has {len(source_lines)} lines but {paths[1]} has {len(target_lines)}"
            )
        rows = [(n, list(pair)) for n, pair in enumerate(zip(source_lines, target_lines), start=1)]
    pairs = []
    for line_number, source, target in two_texts(rows, paths[0], skipped):
        if not source or not target:
            skipped.add("an empty side", paths[0], line_number)
            continue
        pairs.append({"source": source, "target": target, "origin": f"{paths[0].name}:{line_number}"})
    return pairs


def held_out_split(pair: dict, dev_fraction: float, test_fraction: float) -> str:
    """Deterministic split of a pair by a hash of its text."""
    bucket = int(hashlib.sha256(f"{pair['source']}\t{pair['target']}".encode()).hexdigest()[:8], 16) / 2**32
    if bucket < test_fraction:
        return "test"
    return "dev" if bucket < test_fraction + dev_fraction else "train"


def read_splits(config: ParallelTextConfig, skipped: Skipped) -> dict[str, list[dict]]:
    splits = {split: read_pairs(files_of(config, split), skipped) if getattr(config, split) else [] for split in SPLITS}
    derived = [split for split in ("dev", "test") if not getattr(config, split)]
    if derived:
        kept = []
        for pair in splits["train"]:
            split = held_out_split(pair, config.dev_fraction, config.test_fraction)
            (splits[split] if split in derived else kept).append(pair)
        splits["train"] = kept
    for split, pairs in splits.items():
        if not pairs:
            origin = getattr(config, split) or f"the {split}_fraction of {config.train}"
            raise DataError(f"parallel_text: the {split} split is empty (from {origin}): {skipped.summary()}")
    return splits


class ParallelText(TextPairBuilder):
    """A local parallel corpus (TSV or line-aligned files)."""

    VERSION = tfds.core.Version("1.0.1")  # 1.0.1: lines end at \n only (a lone \r stays inside its line)
    BUILDER_CONFIG_CLASS = ParallelTextConfig
    EXTRA_FEATURES = {"origin": tfds.features.Text()}  # file:line, for error reports and analysis

    def _split_examples(self):
        skipped = Skipped()
        splits = read_splits(self.builder_config, skipped)
        self.build_report = {"skipped": dict(skipped.counts), "messages": skipped.messages()}
        return splits


def prepare_parallel_text(data_dir: str, **params):
    """Builds (or reuses) the corpus; the file digest makes a changed file a new build."""
    return prepare(ParallelText, data_dir, **with_digest(ParallelTextConfig.create(**params)))
