"""The input pipeline: task records -> Grain -> batches of token ids.

Training batches come from small named steps:

    records (random access) --select by length-->
      -> per epoch, a seeded plan of global batches over all example indices: shuffle, then
         first-fit packing into rows   or   buckets of similar length (what is left of the
         buckets in shared batches with padding rows)
      -> this process's block of rows of each global batch
      -> batch i of the plans: read, encode (token ids tokenized once, add eos), pack or pad (reader threads)
      -> prefetch in a background thread

Every process plans the same global batches and takes its own rows of each, so with any
number of processes every training example is seen exactly once per epoch, and all
processes' batches have one shape at each step.

Everything is deterministic given the seed, and the iterator's state
(`get_state`/`set_state`) restores exactly: after a restore the next batches
equal those of an uninterrupted run. Examples over the length limits are
dropped or trimmed (`length_policy`), and the counts are logged, never silent.

Batches are dicts of int32 numpy arrays: `inputs [B, S]`, `targets [B, T]`,
with packing also `inputs_segment_ids`, `inputs_positions`,
`targets_segment_ids`, `targets_positions`; eval batches also carry `index`
(the record index, -1 for padding rows) and, where the task has them, its
`alignment` spans (see `tasks.Task.alignment`) or its caption's `boxes`.
`B` is the per-process batch. What `inputs` hold, and whether they pack, is the
source kind's (`run_setup/input_kinds.py`): an image task's are its images, uint8 `[B, H, W, C]`,
bucketed by caption length.
"""

from __future__ import annotations

import bisect
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import grain
import numpy as np

from run_setup.input_kinds import SourceKind
from run_setup.settings import PipelineSettings
from tasks import Task
from tasks.vocabularies import Tokenizers
from utils.errors import ConfigError, DataError

Batch = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- steps


def select(lengths: np.ndarray, settings: PipelineSettings, policy: str, what: str) -> tuple[np.ndarray, dict]:
    """Indices of the examples kept under `policy`, and a report of what was dropped or trimmed."""
    too_long = (lengths[:, 0] > settings.max_source_length) | (lengths[:, 1] > settings.max_target_length)
    indices = np.flatnonzero(~too_long) if policy == "drop" else np.arange(len(lengths))
    report = {"examples": len(lengths), "over_length": int(too_long.sum()), "policy": policy}
    if too_long.any():
        logging.warning(
            "%s: %d of %d examples are longer than max_source_length=%d / max_target_length=%d: %s",
            what,
            too_long.sum(),
            len(lengths),
            settings.max_source_length,
            settings.max_target_length,
            "dropped" if policy == "drop" else "trimmed",
        )
    return indices, report


def eval_batch_records(number: int, rows: int, process_index: int, process_count: int, total: int) -> range:
    """The records of eval batch `number` that process `process_index` reads: its `rows` consecutive
    ones of the batch's `rows * process_count`, so that the processes' rows side by side (the first
    process's first, as a global batch lays them out where the mesh lists each process's devices
    together, as `cluster.make_mesh` does over `jax.devices()` on CPU and GPU) are the batch one
    process would read: on as many devices, each device sums the rows it would in one process,
    in the same order. The block is `process_rows`', as training's batches split; past `total`, nothing."""
    batch = rows * process_count
    block = process_rows(range(number * batch, (number + 1) * batch), process_index, process_count)
    return range(min(block.start, total), min(block.stop, total))


def pad_batch(examples: Sequence[Batch], lengths: Mapping[str, int], batch_size: int) -> Batch:
    """Stacks examples into `[batch_size, length]` arrays, zero-padded in length and in rows."""
    batch = {}
    for key in examples[0]:
        first = np.asarray(examples[0][key])
        if key in lengths:
            array = np.zeros((batch_size, lengths[key]), first.dtype)
            for row, example in enumerate(examples):
                array[row, : len(example[key])] = example[key]
        else:
            # fixed-shape extras (index, alignment)
            array = np.zeros((batch_size,) + first.shape, first.dtype)
            array[: len(examples)] = [example[key] for example in examples]
        batch[key] = array
    return batch


# examples whose lengths are read into Python at a time while packing
PACK_CHUNK = 8192


def microbatches(batch: Batch, count: int) -> Batch:
    """Each array `[B, ...]` of `batch` as `[count, B / count, ...]`, row i in microbatch i % count:
    the train step's microbatches, and the evaluation loss's (inside `jit` too). Interleaved, not
    consecutive rows: the rows are sharded over the devices in blocks, and with consecutive ones a
    microbatch would sit on a few devices (XLA gathers it, and each device computes every microbatch
    whole); interleaved, each device holds its share of every microbatch."""
    return {name: value.reshape(-1, count, *value.shape[1:]).swapaxes(0, 1) for name, value in batch.items()}


def pack_batches(
    order: np.ndarray, lengths: np.ndarray, rows: int, limits: tuple[int, int]
) -> Iterator[list[list[int]]]:
    """First-fit packing of examples (in `order`) into batches of `rows` rows of `limits` tokens,
    made as they are asked for: a corpus of millions packs no further than training has read.

    Each example goes into the first row of the open batch with room for both its
    source and target; when none has room, the batch is closed and a new one
    opened (as Grain's first-fit packer does with `rows` bins). Works on lengths only.

    Yields:
      batches, each a list of `rows` rows, each the list of its example indices.
    """
    rows_of_batch, room = [[] for _ in range(rows)], [list(limits) for _ in range(rows)]
    for start in range(0, len(order), PACK_CHUNK):
        chunk = order[start : start + PACK_CHUNK]
        for index, (source, target) in zip(chunk.tolist(), lengths[chunk].tolist()):
            row = next((r for r in range(rows) if room[r][0] >= source and room[r][1] >= target), None)
            if row is None:
                yield rows_of_batch
                rows_of_batch, room, row = [[] for _ in range(rows)], [list(limits) for _ in range(rows)], 0
            rows_of_batch[row].append(index)
            room[row][0] -= source
            room[row][1] -= target
    if any(rows_of_batch):
        yield rows_of_batch


def pack_plan(order: np.ndarray, lengths: np.ndarray, rows: int, limits: tuple[int, int]) -> list[list[list[int]]]:
    """Every batch of `pack_batches`, as a list."""
    return list(pack_batches(order, lengths, rows, limits))


def packed_batch(rows: Sequence[Sequence[Batch]], limits: Mapping[str, int]) -> Batch:
    """Rows of examples -> `[rows, length]` ids, segment ids (1, 2, ... per example) and positions."""
    batch = {}
    for key, length in limits.items():
        ids, segments, positions = (np.zeros((len(rows), length), np.int32) for _ in range(3))
        for r, examples in enumerate(rows):
            start = 0
            for segment, example in enumerate(examples, start=1):
                end = start + len(example[key])
                ids[r, start:end] = example[key]
                segments[r, start:end] = segment
                positions[r, start:end] = np.arange(end - start)
                start = end
        batch.update({key: ids, f"{key}_segment_ids": segments, f"{key}_positions": positions})
    return batch


class LazyPlan:
    """One epoch's plan, made as far as it is read: items from an iterator, kept once made."""

    def __init__(self, items: Iterable):
        self._made, self._rest = [], iter(items)

    def reaches(self, index: int) -> bool:
        """Whether the plan has an item `index` (making the items up to it)."""
        while len(self._made) <= index:
            item = next(self._rest, _END)
            if item is _END:
                return False
            self._made.append(item)
        return True

    def __getitem__(self, index: int):
        return self._made[index]

    def __len__(self) -> int:
        # makes them all
        self.reaches(sys.maxsize)
        return len(self._made)


_END = object()


class EpochPlans(grain.MapDataset):
    """Endless items from deterministic per-epoch plans: item `i` is the `i`-th of the
    concatenated plans of epochs 0, 1, 2, ... Random access, so an iterator's state is
    just its position; epochs may differ in length (packing depends on the order), and an
    epoch's plan is made only as far as it is read (`LazyPlan`)."""

    def __init__(self, plan: Callable[[int], Iterable]):
        super().__init__()
        self._plan = functools.lru_cache(maxsize=4)(lambda epoch: LazyPlan(plan(epoch)))
        # first item of each epoch whose predecessors are wholly planned
        self._epoch_starts = [0]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sys.maxsize

    def __str__(self) -> str:
        return "EpochPlans"

    def __getitem__(self, index: int):
        with self._lock:
            epoch = bisect.bisect_right(self._epoch_starts, index) - 1
            # `index` is past this epoch
            while not self._plan(epoch).reaches(index - self._epoch_starts[epoch]):
                if epoch + 1 == len(self._epoch_starts):
                    self._epoch_starts.append(self._epoch_starts[epoch] + len(self._plan(epoch)))
                epoch += 1
            return self._plan(epoch)[index - self._epoch_starts[epoch]]


def bucket_plan(
    indices: np.ndarray, lengths: np.ndarray, rows: int | Sequence[int], boundaries: Sequence[int], seed: int
) -> Callable[[int], list]:
    """Epoch -> batches `(padded length, indices)` of examples of similar length, every example once.

    Examples fall into the bucket of the smallest boundary >= their longer side; each
    epoch shuffles every bucket and cuts it into full batches of its `rows` (one number
    for all buckets, or one per boundary, not growing with the length); what is left of
    every bucket goes into shared batches (`shared_remainders`), and the batch order is
    shuffled. An index of -1 is a padding row.
    """
    rows = [rows] * len(boundaries) if isinstance(rows, int) else list(rows)
    longest = lengths.max(axis=1)  # [N]
    if longest.max(initial=0) > boundaries[-1]:
        raise ConfigError(f"data.bucket_boundaries end at {boundaries[-1]}, below an example of {longest.max()} tokens")
    # first boundary >= length
    bucket_of = np.searchsorted(boundaries, longest)
    buckets = [(boundaries[b], rows[b], indices[bucket_of == b]) for b in range(len(boundaries))]

    def plan(epoch: int) -> list[tuple[int, np.ndarray]]:
        rng = np.random.default_rng([seed, epoch])
        batches, remainders = [], []
        for bucket, (length, size, members) in enumerate(buckets):
            shuffled = rng.permutation(members)
            whole = len(shuffled) // size * size
            batches += [(length, chunk) for chunk in shuffled[:whole].reshape(-1, size)]
            remainders += [(bucket, index) for index in shuffled[whole:]]
        batches += shared_remainders(remainders, [(length, size) for length, size, _ in buckets])
        return [batches[i] for i in rng.permutation(len(batches))]

    return plan


def shared_remainders(
    remainders: Sequence[tuple[int, int]], shapes: Sequence[tuple[int, int]]
) -> list[tuple[int, np.ndarray]]:
    """The examples left over by the buckets' full batches, `(bucket, index)` in bucket order, in
    batches of the existing shapes (no new compilation): each batch takes the shape `(length, rows)`
    of its longest member's bucket, as many members as those rows hold, and padding rows (-1) after them.
    """
    batches, current = [], []

    def close() -> None:
        length, size = shapes[current[-1][0]]
        members = np.full(size, -1, np.int64)
        members[: len(current)] = [index for _, index in current]
        batches.append((length, members))

    for bucket, index in remainders:
        if current and len(current) + 1 > shapes[bucket][1]:
            close()
            current = []
        current.append((bucket, index))
    if current:
        close()
    return batches


def process_rows(rows: Sequence, process_index: int, process_count: int) -> Sequence:
    """This process's rows of a global batch: the `process_index`-th of `process_count` equal blocks.

    Every process plans the same global batches over all examples (same seed), so the processes'
    shares are disjoint, together hold every planned example once, and have one shape at each step.
    """
    size = len(rows) // process_count
    return rows[process_index * size : (process_index + 1) * size]


# ----------------------------------------------------------------------------- datasets


def read_options(settings: PipelineSettings) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=settings.num_threads, prefetch_buffer_size=settings.prefetch_batches)


def train_dataset(
    task: Task,
    tokenizers: Tokenizers,
    settings: PipelineSettings,
    kind: SourceKind,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[grain.IterDataset, dict]:
    """The endless, shuffled training batches of this process, and the length report.

    Iterate with `iter(dataset)`; the iterator's `get_state()`/`set_state()` checkpoint it.
    """
    if settings.batch_size % process_count:
        raise ConfigError(f"batch_size {settings.batch_size} is not divisible by {process_count} processes")
    records = task.splits["train"]
    if len(records) == 0:
        raise DataError(f"task {task.name}: the train split is empty")
    lengths = kind.lengths(task, "train", tokenizers)
    kept, report = select(lengths, settings, settings.length_policy, f"{task.name} train")
    if len(kept) == 0:
        raise DataError(
            f"task {task.name}: no train example fits max_source_length={settings.max_source_length} / "
            f"max_target_length={settings.max_target_length}"
        )
    encode = kind.encoder(task, "train", tokenizers, settings.max_source_length, settings.max_target_length)
    # a padding row
    blank = {"inputs": kind.blank(task, "train"), "targets": np.zeros(0, np.int32)}
    # after trimming
    lengths = np.minimum(lengths, [[settings.max_source_length, settings.max_target_length]])
    limits = kind.padded_keys(settings.max_source_length, settings.max_target_length)
    if settings.batching == "pack" and not kind.packs:
        raise ConfigError(f"task {task.name} reads {kind.name} sources, which do not pack; set data.batching='bucket'")
    # Every process plans the global batches over all examples and takes its rows (`process_rows`).
    if settings.batching == "pack":

        def plan(epoch: int) -> Iterator:
            order = np.random.default_rng([settings.seed, epoch]).permutation(kept)
            packed = pack_batches(
                order, lengths, settings.batch_size, (settings.max_source_length, settings.max_target_length)
            )
            return (process_rows(batch, process_index, process_count) for batch in packed)

        def make_batch(rows_of_indices: list[list[int]]) -> Batch:
            return packed_batch([[encode(i) for i in row] for row in rows_of_indices], limits)

    else:
        boundaries = settings.bucket_boundaries
        bucket_rows = [settings.bucket_rows(settings.padded_length(b)) for b in boundaries]
        global_plan = bucket_plan(kept, lengths[kept], bucket_rows, boundaries, settings.seed)

        def plan(epoch: int) -> list:
            return [
                (length, process_rows(members, process_index, process_count)) for length, members in global_plan(epoch)
            ]

        def make_batch(item: tuple[int, np.ndarray]) -> Batch:
            length, members = item
            bucket_limits = {key: min(length, limit) for key, limit in limits.items()}
            return pad_batch([encode(i) if i >= 0 else blank for i in members], bucket_limits, len(members))

    batches = EpochPlans(plan).map(make_batch).to_iter_dataset(read_options(settings))
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=settings.prefetch_batches), report


def eval_batches(
    task: Task,
    tokenizers: Tokenizers,
    split: str,
    settings: PipelineSettings,
    kind: SourceKind,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[grain.IterDataset, dict]:
    """Every example of `split` once, in order, in global batches padded to the maximum lengths
    (`settings.eval_rows()` rows: with token batching, as many as fit), of which this process
    reads its block (`eval_batch_records`).

    Every process gets the same number of batches (rows past the end are
    padding with `index` -1), as collective eval steps need.
    """
    if settings.eval_rows() % process_count:
        raise ConfigError(f"an eval batch's {settings.eval_rows()} rows are not divisible by {process_count} processes")
    records = task.splits[split]
    if len(records) == 0:
        raise DataError(f"task {task.name}: the {split} split is empty")
    rows = settings.eval_rows() // process_count
    _, report = select(kind.lengths(task, split, tokenizers), settings, "trim", f"{task.name} {split}")
    num_batches = -(-len(records) // settings.eval_rows())
    encode = kind.encoder(task, split, tokenizers, settings.max_source_length, settings.max_target_length)
    limits = kind.padded_keys(settings.max_source_length, settings.max_target_length)
    extras = {name: get for name, get in (("alignment", task.alignment), ("boxes", task.boxes)) if get is not None}
    blank = {"inputs": kind.blank(task, split), "targets": np.zeros(0, np.int32), "index": np.int32(-1)}
    # alignment spans [K, 4], boxes [K, 4]: a padding row's score nothing
    for name, get in extras.items():
        blank[name] = np.full_like(get(records[0]), 0 if name == "alignment" else -1)

    def example(index: int) -> Batch:
        found = {name: get(records[index]) for name, get in extras.items()}
        return {**encode(index), "index": np.int32(index), **found}

    def batch(number: int) -> Batch:
        examples = [example(i) for i in eval_batch_records(number, rows, process_index, process_count, len(records))]
        return pad_batch(examples + [blank] * (rows - len(examples)), limits, rows)

    dataset = grain.MapDataset.range(num_batches).map(batch).to_iter_dataset(read_options(settings))
    return dataset, report
