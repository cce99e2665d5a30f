"""The input pipeline: task records -> Grain -> batches of token ids.

Training batches come from small named steps:

    records (random access) --select by length--> shard per process
      -> shuffle(seed) -> repeat -> encode (tokenize, add eos)
      -> pack rows (segment ids, positions)   or   bucket by length and pad
      -> batch -> prefetch in a background thread

Everything is deterministic given the seed, and the iterator's state
(`get_state`/`set_state`) restores exactly: after a restore the next batches
equal those of an uninterrupted run. Examples over the length limits are
dropped or trimmed (`length_policy`), and the counts are logged, never silent.

Batches are dicts of int32 numpy arrays: `inputs [B, S]`, `targets [B, T]`,
with packing also `inputs_segment_ids`, `inputs_positions`,
`targets_segment_ids`, `targets_positions`; eval batches also carry `index`
(the record index, -1 for padding rows) and any fixed-shape extras of the task
(the dates' `alignment`). `B` is the per-process batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from tasks import Task
from tokenizers import EOS_ID, Tokenizers

Batch = dict[str, np.ndarray]
BATCHINGS = ("pack", "bucket")
LENGTH_POLICIES = ("drop", "trim")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    batch_size: int  # global: the sum over processes
    max_source_length: int = 128  # tokens, eos included
    max_target_length: int = 128
    length_policy: str = "drop"  # train examples over the limits: "drop" or "trim" (eval always trims)
    batching: str = "pack"  # "pack" rows of several examples, or "bucket" by length and pad
    bucket_boundaries: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)  # padded lengths for "bucket"
    seed: int = 0
    num_threads: int = 2  # Grain reader threads (tokenization)
    prefetch_batches: int = 4  # batches prepared ahead in a background thread

    def __post_init__(self):
        if self.batching not in BATCHINGS:
            raise ValueError(f"data.batching must be one of {', '.join(BATCHINGS)}, got {self.batching!r}")
        if self.length_policy not in LENGTH_POLICIES:
            raise ValueError(f"data.length_policy must be one of {', '.join(LENGTH_POLICIES)}, got {self.length_policy!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")


# ----------------------------------------------------------------------------- steps


def encoder(task: Task, tokenizers: Tokenizers, max_source_length: int, max_target_length: int) -> Callable:
    """record -> `{'inputs', 'targets'}` int32 ids ending in eos, trimmed to the limits."""

    def encode(record: Mapping[str, Any]) -> Batch:
        source, target = task.pair(record)
        inputs = tokenizers.source.encode(source)[: max_source_length - 1]
        targets = tokenizers.target.encode(target)[: max_target_length - 1]
        return {"inputs": np.append(inputs, EOS_ID).astype(np.int32), "targets": np.append(targets, EOS_ID).astype(np.int32)}

    return encode


def example_lengths(task: Task, split: str, tokenizers: Tokenizers) -> np.ndarray:
    """`[N, 2]` source and target lengths in tokens, eos included (one tokenizing pass)."""
    records = task.splits[split]
    lengths = np.zeros((len(records), 2), np.int64)
    for i in range(len(records)):
        source, target = task.pair(records[i])
        lengths[i] = len(tokenizers.source.encode(source)) + 1, len(tokenizers.target.encode(target)) + 1
    return lengths


def select(lengths: np.ndarray, settings: PipelineSettings, policy: str, what: str) -> tuple[np.ndarray, dict]:
    """Indices of the examples kept under `policy`, and a report of what was dropped or trimmed."""
    too_long = (lengths[:, 0] > settings.max_source_length) | (lengths[:, 1] > settings.max_target_length)
    indices = np.flatnonzero(~too_long) if policy == "drop" else np.arange(len(lengths))
    report = {"examples": len(lengths), "over_length": int(too_long.sum()), "policy": policy}
    if too_long.any():
        logging.warning(
            "%s: %d of %d examples are longer than max_source_length=%d / max_target_length=%d: %s",
            what, too_long.sum(), len(lengths), settings.max_source_length, settings.max_target_length,
            "dropped" if policy == "drop" else "trimmed",
        )  # fmt: skip
    return indices, report


def shard(indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's share: every `process_count`-th index from `process_index` (disjoint, covering)."""
    return indices[process_index::process_count]


def pad_batch(examples: Sequence[Batch], lengths: Mapping[str, int], batch_size: int) -> Batch:
    """Stacks examples into `[batch_size, length]` arrays, zero-padded in length and in rows."""
    batch = {}
    for key in examples[0]:
        first = np.asarray(examples[0][key])
        if key in lengths:
            array = np.zeros((batch_size, lengths[key]), first.dtype)
            for row, example in enumerate(examples):
                array[row, : len(example[key])] = example[key]
        else:  # fixed-shape extras (index, alignment)
            array = np.zeros((batch_size,) + first.shape, first.dtype)
            array[: len(examples)] = [example[key] for example in examples]
        batch[key] = array
    return batch


def pack(dataset: grain.IterDataset, settings: PipelineSettings, rows: int) -> grain.IterDataset:
    """Packs examples into rows of `max_*_length` tokens with segment ids and positions, then batches."""
    packed = grain.experimental.FirstFitPackIterDataset(
        dataset,
        length_struct={"inputs": settings.max_source_length, "targets": settings.max_target_length},
        num_packing_bins=rows,
        seed=settings.seed,
        shuffle_bins=True,
    )
    return packed.batch(rows, drop_remainder=True)


class BucketedBatches(grain.MapDataset):
    """Infinite batches of example indices of similar length, re-planned (shuffled) every epoch.

    Examples fall into the bucket of the smallest boundary >= their longer side;
    each epoch shuffles every bucket, cuts it into full batches and shuffles the
    batch order. Every epoch has the same number of batches, so item `i` is
    batch `i % per_epoch` of epoch `i // per_epoch`: random access, and an
    iterator state that is just a position.

    Items: `(padded_length, indices)`.
    """

    def __init__(self, indices: np.ndarray, lengths: np.ndarray, batch_size: int, boundaries, seed: int):
        super().__init__()
        longest = lengths.max(axis=1)  # [N]
        if longest.max(initial=0) > boundaries[-1]:
            raise ValueError(f"data.bucket_boundaries end at {boundaries[-1]}, below an example of {longest.max()} tokens")
        bucket_of = np.searchsorted(boundaries, longest)  # first boundary >= length
        self._buckets = [(boundaries[b], indices[bucket_of == b]) for b in range(len(boundaries))]
        self._batch_size, self._seed = batch_size, seed
        self._per_epoch = sum(len(members) // batch_size for _, members in self._buckets)
        if self._per_epoch == 0:
            raise ValueError(f"no length bucket holds a full batch of {batch_size} examples; lower the batch size")

    def __len__(self) -> int:
        return sys.maxsize

    def __str__(self) -> str:
        return f"BucketedBatches(batch_size={self._batch_size}, per_epoch={self._per_epoch})"

    @functools.lru_cache(maxsize=2)
    def plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        rng = np.random.default_rng([self._seed, epoch])
        batches = []
        for length, members in self._buckets:
            shuffled = rng.permutation(members)
            whole = len(shuffled) // self._batch_size * self._batch_size  # the remainder waits for another epoch
            batches += [(length, chunk) for chunk in shuffled[:whole].reshape(-1, self._batch_size)]
        order = rng.permutation(len(batches))
        return [batches[i] for i in order]

    def __getitem__(self, index: int) -> tuple[int, np.ndarray]:
        epoch, position = divmod(index, self._per_epoch)
        return self.plan(epoch)[position]


# ----------------------------------------------------------------------------- datasets


def read_options(settings: PipelineSettings) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=settings.num_threads, prefetch_buffer_size=4 * settings.batch_size)


def train_dataset(
    task: Task,
    tokenizers: Tokenizers,
    settings: PipelineSettings,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[grain.IterDataset, dict]:
    """The endless, shuffled training batches of this process, and the length report.

    Iterate with `iter(dataset)`; the iterator's `get_state()`/`set_state()` checkpoint it.
    """
    if settings.batch_size % process_count:
        raise ValueError(f"batch_size {settings.batch_size} is not divisible by {process_count} processes")
    rows = settings.batch_size // process_count
    records = task.splits["train"]
    if len(records) == 0:
        raise ValueError(f"task {task.name}: the train split is empty")
    lengths = example_lengths(task, "train", tokenizers)
    kept, report = select(lengths, settings, settings.length_policy, f"{task.name} train")
    indices = shard(kept, process_index, process_count)
    if len(indices) == 0:
        raise ValueError(
            f"task {task.name}: no train example fits max_source_length={settings.max_source_length} / "
            f"max_target_length={settings.max_target_length}"
        )
    encode = encoder(task, tokenizers, settings.max_source_length, settings.max_target_length)
    if settings.batching == "pack":
        examples = grain.MapDataset.source(indices).shuffle(seed=settings.seed).repeat().map(lambda i: encode(records[i]))
        batches = pack(examples.to_iter_dataset(read_options(settings)), settings, rows)
    else:

        def padded(item: tuple[int, np.ndarray]) -> Batch:
            length, members = item
            limits = {"inputs": min(length, settings.max_source_length), "targets": min(length, settings.max_target_length)}
            return pad_batch([encode(records[i]) for i in members], limits, rows)

        plan = BucketedBatches(indices, np.minimum(lengths[indices], [[settings.max_source_length, settings.max_target_length]]), rows, settings.bucket_boundaries, settings.seed)
        batches = plan.map(padded).to_iter_dataset(read_options(settings))
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=settings.prefetch_batches), report


def eval_batches(
    task: Task,
    tokenizers: Tokenizers,
    split: str,
    settings: PipelineSettings,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[grain.IterDataset, dict]:
    """Every example of `split` once, in order, in batches padded to the maximum lengths.

    Every process gets the same number of batches (rows past the end are
    padding with `index` -1), as collective eval steps need.
    """
    records = task.splits[split]
    if len(records) == 0:
        raise ValueError(f"task {task.name}: the {split} split is empty")
    rows = settings.batch_size // process_count
    _, report = select(example_lengths(task, split, tokenizers), settings, "trim", f"{task.name} {split}")
    indices = shard(np.arange(len(records)), process_index, process_count)
    num_batches = -(-len(records) // settings.batch_size)
    encode = encoder(task, tokenizers, settings.max_source_length, settings.max_target_length)
    extras = [k for k, v in records[0].items() if isinstance(v, np.ndarray) and k not in (task.source_key, task.target_key)]
    limits = {"inputs": settings.max_source_length, "targets": settings.max_target_length}
    empty = np.zeros(0, np.int32)
    blank = {"inputs": empty, "targets": empty, "index": np.int32(-1), **{k: np.zeros_like(records[0][k]) for k in extras}}

    def batch(number: int) -> Batch:
        members = indices[number * rows : (number + 1) * rows]
        examples = [{**encode(records[i]), "index": np.int32(i), **{k: records[i][k] for k in extras}} for i in members]
        return pad_batch(examples + [blank] * (rows - len(examples)), limits, rows)

    dataset = grain.MapDataset.range(num_batches).map(batch).to_iter_dataset(read_options(settings))
    return dataset, report
