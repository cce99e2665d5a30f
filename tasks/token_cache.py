"""The token ids of a text split, tokenized once per (built data, vocabulary) and kept beside the data.

    <built data>/tokenized/<vocabulary digest>-spm<version>/<split>/
        source.ids, target.ids          int32, every example's ids (no eos) one after another
        source.starts, target.starts    int64 [N + 1]: example i is ids[starts[i]:starts[i + 1]]
        format.json                     {"version", "examples", ...}, the folder's last file

Every later run with the same data and vocabulary, on this machine or any sharing the
filesystem, reads the files instead of tokenizing: the starts memory-mapped, each example's ids
read when it is (`IdsFile`), so a split of any size costs this process no memory beyond them.
The folder is written whole or not at all (`files.write_whole`)
by one process while the others wait on its lock (`files.exclusive`); a folder written by
another `FORMAT_VERSION`, or for another number of examples, is made again, never misread.

Tokenizing streams: the records are read in chunks of `CHUNK_EXAMPLES` straight from their
array_record shards (the tf.train.Example protos parsed for the two text features, about
twenty times faster than TFDS's decoding), each chunk is encoded by a pool of processes over
all cores (SentencePiece holds the GIL, so threads would not help) and appended to the files,
so memory holds a few chunks whatever the corpus. Splits under `PARALLEL_FROM` examples are
tokenized in this process (a pool's start costs more than they do); data without shard files
(records in a list) is tokenized in memory and not kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece as spm

from tasks.task_builder import rebuild_fix
from tasks.vocabularies import EOS_ID, Tokenizers
from utils import progress, stop_signals
from utils.errors import DataError
from utils.files import exclusive, write_whole

# 1: one .npz per split, read whole into memory
FORMAT_VERSION = 2
CHUNK_EXAMPLES = 20_000
# examples; smaller splits are tokenized in this process
PARALLEL_FROM = 100_000
FIELDS = ("source", "target")


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """A text split's token ids (no eos), flat: example i's source is `source[source_starts[i]:source_starts[i + 1]]`,
    its target likewise. The ids may be `IdsFile`s, the starts memory-mapped files."""

    source: np.ndarray | IdsFile
    source_starts: np.ndarray
    target: np.ndarray | IdsFile
    target_starts: np.ndarray

    @classmethod
    def of(cls, source_texts: Sequence[Sequence[int]], target_texts: Sequence[Sequence[int]]) -> TokenIds:
        def flat(sequences):
            sequences = list(sequences)
            starts = np.cumsum([0, *map(len, sequences)], dtype=np.int64)
            return (np.concatenate(sequences).astype(np.int32) if sequences else np.zeros(0, np.int32)), starts

        return cls(*flat(source_texts), *flat(target_texts))

    def __len__(self) -> int:
        return len(self.source_starts) - 1

    def lengths(self) -> np.ndarray:
        """`[N, 2]` source and target lengths in tokens, eos included."""
        return np.stack([np.diff(self.source_starts), np.diff(self.target_starts)], axis=1) + 1

    def example(self, index: int, max_source_length: int, max_target_length: int) -> dict[str, np.ndarray]:
        """`{'inputs', 'targets'}` of example `index`: int32 ids ending in eos, trimmed to the limits."""

        def ids(flat, starts, limit):
            start = starts[index]
            return np.append(flat[start : min(starts[index + 1], start + limit - 1)], EOS_ID).astype(np.int32)

        return {
            "inputs": ids(self.source, self.source_starts, max_source_length),
            "targets": ids(self.target, self.target_starts, max_target_length),
        }


# ----------------------------------------------------------------------------- reading texts in chunks


@dataclasses.dataclass(frozen=True)
class ShardRange:
    """Records `[skip, skip + take)` of the array_record file `path`: a piece of a split."""

    path: str
    skip: int
    take: int


def shard_ranges(records: Any) -> list[ShardRange] | None:
    """The array_record pieces a split's records are read from, in record order: a task's built data
    (`tasks.task_builder.Records`) or a TFDS catalog data source; None for records without files (a list)."""
    # tasks.task_builder.Records wraps a TFDS data source
    source = getattr(records, "source", records)
    info, split = getattr(source, "dataset_info", None), getattr(source, "split", None)
    if info is None or split is None or getattr(info.file_format, "value", info.file_format) != "array_record":
        return None
    pieces = [ShardRange(str(piece.filename), piece.skip, piece.take) for piece in info.splits[split].file_instructions]
    # else e.g. TFDS's mock data
    return pieces if pieces and all(Path(piece.path).is_file() for piece in pieces) else None


def read_texts(pieces: Sequence[ShardRange], keys: tuple[str, str], start: int, stop: int) -> list[tuple[str, str]]:
    """The `(source, target)` texts of records `[start, stop)`, read straight from their shards: each
    record a tf.train.Example whose `keys` features hold one UTF-8 string each."""
    from array_record.python import array_record_module
    from tensorflow_datasets.proto import tf_example_pb2

    texts, first = [], 0
    for piece in pieces:
        low, high = max(start, first), min(stop, first + piece.take)
        if low < high:
            reader = array_record_module.ArrayRecordReader(piece.path, "readahead_buffer_size:0")
            try:
                for raw in read_records(reader, piece, piece.skip + low - first, piece.skip + high - first):
                    feature = tf_example_pb2.Example.FromString(raw).features.feature
                    texts.append(tuple(feature[key].bytes_list.value[0].decode("utf-8") for key in keys))
            finally:
                reader.close()
        first += piece.take
    return texts


def read_records(reader: Any, piece: ShardRange, start: int, stop: int) -> list[bytes]:
    """Records `[start, stop)` of an open array_record file; a record that cannot be read (a chunk whose
    hash does not match: bytes overwritten since the build) stops with a DataError naming it and the fix."""
    try:
        return reader.read(start, stop)
    except RuntimeError:
        # find the record, for the message
        for index in range(start, stop):
            try:
                reader.read([index])
            except RuntimeError as error:
                folder = Path(piece.path).parent
                raise DataError(
                    f"corrupt built data: record {index} in {piece.path} cannot be read "
                    f"({str(error).split(';')[0]}); {rebuild_fix(folder)}"
                ) from None
        raise


def encoded(tokenizers: Tokenizers, texts: Sequence[tuple[str, str]]) -> tuple[np.ndarray, ...]:
    """`(source ids, source lengths, target ids, target lengths)` of a chunk of pairs: the ids flat int32."""
    arrays = []
    for side, tokenizer in enumerate((tokenizers.source, tokenizers.target)):
        side_texts = [pair[side] for pair in texts]
        # SentencePiece's: one call for the chunk
        batch = getattr(tokenizer, "encode_batch", None)
        ids = batch(side_texts) if batch else [tokenizer.encode(text) for text in side_texts]
        lengths = np.array([len(i) for i in ids], np.int64)
        arrays += [np.fromiter(itertools.chain.from_iterable(ids), np.int32, count=int(lengths.sum())), lengths]
    return tuple(arrays)


# a pool process's pieces, keys and tokenizers, set once by `_start_worker`
_WORKER: dict[str, Any] = {}


def _start_worker(pieces: Sequence[ShardRange], keys: tuple[str, str], tokenizers: Tokenizers) -> None:
    _WORKER.update(pieces=pieces, keys=keys, tokenizers=tokenizers)


def _encode_chunk(bounds: tuple[int, int]) -> tuple[np.ndarray, ...]:
    return encoded(_WORKER["tokenizers"], read_texts(_WORKER["pieces"], _WORKER["keys"], *bounds))


def chunk_bounds(count: int, size: int | None = None) -> list[tuple[int, int]]:
    """`[start, stop)` of consecutive chunks of at most `size` (`CHUNK_EXAMPLES`) covering `count` examples."""
    size = size or CHUNK_EXAMPLES
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def chunk_texts(
    task: Any, pieces: Sequence[ShardRange] | None, split: str, start: int, stop: int
) -> list[tuple[str, str]]:
    """The `(source, target)` texts of records `[start, stop)`: from `pieces` (the split's shards), or
    where there are none through `task.pair`."""
    if pieces is None:
        return [task.pair(task.splits[split][i]) for i in range(start, stop)]
    return read_texts(pieces, (task.source_key, task.target_key), start, stop)


def pairs(task: Any, split: str) -> Iterator[tuple[str, str]]:
    """The `(source, target)` texts of a split in order, read as a stream in chunks: straight from the
    shards for text tasks with built data, else through `task.pair` (an image task's source is "")."""
    pieces = shard_ranges(task.splits[split]) if task.inputs == "text" else None
    for start, stop in chunk_bounds(len(task.splits[split])):
        yield from chunk_texts(task, pieces, split, start, stop)


def encoded_chunks(task: Any, split: str, tokenizers: Tokenizers) -> Iterator[tuple[np.ndarray, ...]]:
    """The split's `encoded` chunks in order: from its shards by a pool over all cores when it is
    large, else in this process (through `task.pair` for records without files)."""
    records = task.splits[split]
    pieces, bounds = shard_ranges(records), chunk_bounds(len(records))
    keys = (task.source_key, task.target_key)
    workers = min(os.cpu_count() or 1, len(bounds))
    if pieces is None or len(records) < PARALLEL_FROM or workers < 2:
        for start, stop in bounds:
            yield encoded(tokenizers, chunk_texts(task, pieces, split, start, stop))
    else:
        # spawn: the parent may hold JAX's threads, which a fork would copy mid-flight
        with stop_signals.children_leave_ctrl_c_to_us():
            pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (pieces, keys, tokenizers))
        with pool:
            yield from pool.imap(_encode_chunk, bounds)


# ----------------------------------------------------------------------------- the cache on disk


def write_split(
    folder: Path, chunks: Iterator[tuple[np.ndarray, ...]], count: int, meta: Mapping[str, Any], shown: progress.Phase
) -> None:
    """Writes the files of one split into `folder` (which does not exist) chunk by chunk."""
    folder.mkdir(parents=True)
    files = {name: open(folder / name, "wb") for name in ("source.ids", "source.starts", "target.ids", "target.starts")}
    try:
        ends = {"source": 0, "target": 0}
        for name in FIELDS:
            np.zeros(1, np.int64).tofile(files[f"{name}.starts"])
        written = 0
        for chunk in chunks:
            for name, ids, lengths in zip(FIELDS, chunk[0::2], chunk[1::2]):
                ids.astype("<i4").tofile(files[f"{name}.ids"])
                (ends[name] + np.cumsum(lengths)).astype("<i8").tofile(files[f"{name}.starts"])
                ends[name] += int(lengths.sum())
            written += len(chunk[1])
            shown.advance(len(chunk[1]))
    finally:
        for file in files.values():
            file.close()
    if written != count:
        # the records changed under us: keep nothing
        raise OSError(f"tokenized {written} examples of {count}")
    summary = {
        "version": FORMAT_VERSION,
        "examples": count,
        "source_tokens": ends["source"],
        "target_tokens": ends["target"],
        **meta,
    }
    (folder / "format.json").write_text(json.dumps(summary))


class IdsFile:
    """The int32 ids of a `.ids` file, read slice by slice with `os.pread`: `ids[start:stop]` is an
    array of its own. Memory-mapping the file instead made every page that a random-order batch
    touched resident in this process, and the kernel maps the cached pages around each fault, so
    within a dozen steps a WMT-sized split's 1.09 GiB counted in the run's resident memory; read
    this way, the file stays in the page cache, which the kernel shares and reclaims."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = Path(path), size
        self.descriptor = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.descriptor)
        held = os.fstat(self.descriptor).st_size // 4
        if held * 4 != 4 * size:
            raise ValueError(f"{self.path} holds {held} values, not {size}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, part: slice) -> np.ndarray:
        start, stop, step = part.indices(self.size)
        if step != 1:
            raise IndexError("IdsFile reads contiguous slices only")
        count = max(0, stop - start)
        data = os.pread(self.descriptor, 4 * count, 4 * start)
        # the file shrank under the run
        if len(data) != 4 * count:
            raise DataError(f"{self.path} ends before value {stop}: {rebuild_fix(self.path.parent)}")
        return np.frombuffer(data, "<i4")

    # a process it is sent to opens the file again
    def __reduce__(self):
        return IdsFile, (self.path, self.size)


def read_split(folder: Path, count: int) -> TokenIds | None:
    """The token ids kept in `folder` (the ids read by `IdsFile`, the starts memory-mapped); None where there are none,
    or they were written by another format version, for another number of examples, or are unreadable (then they are
    made again)."""
    try:
        meta = json.loads((folder / "format.json").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logging.warning("tokenizing again: %s is unreadable (%s)", folder / "format.json", error)
        return None
    if meta.get("version") != FORMAT_VERSION or meta.get("examples") != count:
        logging.warning(
            "tokenizing again: the token ids in %s are of format %s for %s examples, not %d for %d",
            folder,
            meta.get("version"),
            meta.get("examples"),
            FORMAT_VERSION,
            count,
        )
        return None

    def mapped(name: str, dtype: str, size: int) -> np.ndarray:
        if size == 0:
            return np.zeros(0, dtype)
        array = np.memmap(folder / name, dtype=dtype, mode="r")
        if len(array) != size:
            raise ValueError(f"{folder / name} holds {len(array)} values, not {size}")
        return array

    def ids(name: str, size: int) -> IdsFile | np.ndarray:
        return IdsFile(folder / name, size) if size else np.zeros(0, "<i4")

    try:
        return TokenIds(
            ids("source.ids", meta["source_tokens"]),
            mapped("source.starts", "<i8", count + 1),
            ids("target.ids", meta["target_tokens"]),
            mapped("target.starts", "<i8", count + 1),
        )
    except (OSError, ValueError, KeyError) as error:
        logging.warning("tokenizing again: the token ids in %s are unreadable (%s)", folder, error)
        return None


def cache_folder(pieces: Sequence[ShardRange], split: str, tokenizers: Tokenizers) -> Path:
    """Where the token ids of `split` with `tokenizers` are kept: beside the split's first shard,
    named by the vocabulary and the SentencePiece release (another encoder may give other ids)."""
    return Path(pieces[0].path).parent / "tokenized" / f"{tokenizers.digest}-spm{spm.__version__}" / split


# records -> {vocabulary digest: TokenIds}
_TOKEN_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_ids(task: Any, split: str, tokenizers: Tokenizers) -> TokenIds:
    """The token ids of a text split of `task` (a `tasks.Task`), tokenized once (see the module
    docstring) and remembered by this process."""
    records = task.splits[split]
    try:
        remembered = _TOKEN_IDS.setdefault(records, {})
    except TypeError:
        # a plain list of records (tests, small tasks) cannot be a weak key: no memory
        remembered = {}
    if tokenizers.digest not in remembered:
        remembered[tokenizers.digest] = kept_or_made(task, split, tokenizers)
    return remembered[tokenizers.digest]


def kept_or_made(task: Any, split: str, tokenizers: Tokenizers) -> TokenIds:
    """The split's kept token ids, or new ones tokenized and kept (in memory where they cannot be kept)."""
    records = task.splits[split]
    pieces = shard_ranges(records)
    what = f"tokenizing {task.name} {split}"
    if pieces is None:
        return in_memory(task, split, tokenizers, what)
    folder = cache_folder(pieces, split, tokenizers)
    try:
        # one process tokenizes, the others wait and read
        with exclusive(folder.parent / f".{split}.lock"):
            ids = read_split(folder, len(records))
            if ids is None:
                shutil.rmtree(folder, ignore_errors=True)
                meta = {"task": task.name, "split": split, "vocabulary": tokenizers.digest}
                with progress.phase(what, total=len(records), unit="pairs") as shown:
                    write_whole(
                        folder,
                        lambda temporary: write_split(
                            temporary, encoded_chunks(task, split, tokenizers), len(records), meta, shown
                        ),
                    )
                ids = read_split(folder, len(records))
    except OSError as error:
        # data prepared by someone else, read-only: tokenize at every start
        logging.warning(
            "cannot keep the token ids of %s %s beside its data (%s); tokenizing in memory", task.name, split, error
        )
        return in_memory(task, split, tokenizers, what)
    if ids is None:
        raise OSError(f"the token ids just written to {folder} cannot be read back")
    return ids


def in_memory(task: Any, split: str, tokenizers: Tokenizers, what: str) -> TokenIds:
    """Token ids tokenized into memory (records without files, or data that cannot be written beside)."""
    chunks = []
    with progress.phase(what, total=len(task.splits[split]), unit="pairs") as shown:
        for chunk in encoded_chunks(task, split, tokenizers):
            chunks.append(chunk)
            shown.advance(len(chunk[1]))
    if not chunks:
        return TokenIds.of([], [])

    def flat(ids: list[np.ndarray], lengths: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(ids), np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)

    return TokenIds(
        *flat([c[0] for c in chunks], [c[1] for c in chunks]), *flat([c[2] for c in chunks], [c[3] for c in chunks])
    )
