"""The input pipeline: packing, bucketing, sharding, length limits, eval batches, exact restore."""

import collections
import dataclasses

import numpy as np
import pytest

import input_pipeline as ip
import tasks
from configs import base
from run_setup import input_kinds
from run_setup.input_kinds import KINDS
from run_setup.settings import parse
from tasks import Task
from tasks import vocabularies as tk
from utils.errors import ConfigError

TEXT = KINDS["text"]


@pytest.fixture(scope="module")
def copy_task(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("data"))
    # copy of 40-symbol strings over 30 symbols: every source is unique, so examples are identifiable
    return tasks.load_task(
        "copy", data_dir, min_length=3, max_length=40, vocab_size=30, train_size=96, dev_size=21, test_size=5
    )


@pytest.fixture(scope="module")
def char_tokenizers(copy_task):
    chars = tk.CharTokenizer.train((t for r in copy_task.splits["train"] for t in copy_task.pair(r)), 10**6)
    return tk.Tokenizers(chars, chars)


def settings(**overrides):
    """configs/base.py's data settings with small batches and lengths."""
    config = base.get_config()
    fields = dict(batch_size=4, max_source_length=24, max_target_length=24, seed=1, num_threads=1, batching="pack")
    fields.update(overrides)
    return dataclasses.replace(parse(config).data, **fields)


def decoded_rows(batch, tokenizers, key="inputs"):
    return [tokenizers.source.decode(row) for row in batch[key]]


def take(dataset, n):
    iterator = iter(dataset)
    return [next(iterator) for _ in range(n)]


# ---------------------------------------------------------------- pure steps


def test_packing_loses_and_duplicates_nothing():
    rng = np.random.default_rng(0)
    examples = [
        {
            "inputs": rng.integers(3, 50, size=n).astype(np.int32),
            "targets": rng.integers(3, 50, size=m).astype(np.int32),
        }
        for n, m in rng.integers(1, 9, size=(60, 2))
    ]
    lengths = np.array([[len(e["inputs"]), len(e["targets"])] for e in examples])
    batches = ip.pack_plan(rng.permutation(60), lengths, rows=3, limits=(10, 10))
    assert sorted(i for batch in batches for row in batch for i in row) == list(range(60))
    segments = collections.Counter()
    for plan in batches:
        batch = ip.packed_batch([[examples[i] for i in row] for row in plan], {"inputs": 10, "targets": 10})
        for r, row in enumerate(plan):
            for key in ("inputs", "targets"):
                ids, positions = batch[f"{key}_segment_ids"][r], batch[f"{key}_positions"][r]
                # padding is zero
                assert np.all(batch[key][r][ids == 0] == 0)
                assert ids.max() == len(row)
                for segment, index in enumerate(row, start=1):
                    np.testing.assert_array_equal(batch[key][r][ids == segment], examples[index][key])
                    np.testing.assert_array_equal(positions[ids == segment], np.arange(len(examples[index][key])))
            segments.update(
                tuple(batch["inputs"][r][batch["inputs_segment_ids"][r] == s]) for s in range(1, len(row) + 1)
            )
    assert segments == collections.Counter(tuple(e["inputs"]) for e in examples)


def test_first_fit_fills_rows_before_opening_a_batch():
    lengths = np.array([[4, 4], [4, 4], [3, 3], [5, 5], [6, 6]])
    # rows of 8: row 0 takes 0 and 1; 2 goes to row 1; 3 fits row 1 (3+5=8); 4 fits nowhere: new batch
    assert ip.pack_plan(np.arange(5), lengths, rows=2, limits=(8, 8)) == [[[0, 1], [2, 3]], [[4], []]]


def test_epoch_plans_are_made_only_as_far_as_they_are_read():
    made = collections.Counter()

    # epoch e has e + 2 items, (e, 0), (e, 1), ...
    def plan(epoch):
        for item in range(epoch + 2):
            made[epoch] += 1
            yield epoch, item

    plans = ip.EpochPlans(plan)
    # epoch 0's two items only
    assert plans[1] == (0, 1) and made == {0: 2}
    expected = [(e, i) for e in range(5) for i in range(e + 2)]
    # forwards and back, as a restore reads
    assert [plans[i] for i in (13, 2, 19, 0)] == [expected[i] for i in (13, 2, 19, 0)]
    # epoch 4 (items 14...) made up to item 19 alone
    assert made[4] == 19 - 14 + 1


def test_shared_remainders_fill_the_shapes_of_their_longest_members():
    shapes = [(8, 3), (16, 2), (32, 1)]  # (length, rows) per bucket
    # by bucket, as bucket_plan leaves them
    remainders = [(0, 10), (0, 11), (1, 12), (2, 13)]
    # 10 and 11 fit 3 rows; with 12 (bucket 16: 2 rows) they would be 3: 12 starts a batch; 13 (1 row) too
    batches = ip.shared_remainders(remainders, shapes)
    assert [(length, members.tolist()) for length, members in batches] == [
        (8, [10, 11, -1]),
        (16, [12, -1]),
        (32, [13]),
    ]


@pytest.mark.parametrize("process_count", [1, 2, 3, 4])
def test_the_processes_blocks_of_global_batches_hold_every_example_once_per_epoch(process_count):
    rng = np.random.default_rng(process_count)
    lengths = rng.integers(1, 30, size=(101, 2))
    # some examples dropped by length
    kept = np.flatnonzero(lengths.max(1) != 7)
    # global rows, divisible by the process count
    rows = 4 * process_count
    for name in ("pack", "bucket"):
        for epoch in range(2):
            if name == "pack":
                global_batches = ip.pack_plan(rng.permutation(kept), lengths, rows, (40, 40))
                shares = [[ip.process_rows(b, p, process_count) for b in global_batches] for p in range(process_count)]
                seen = [i for share in shares for batch in share for row in batch for i in row]
                shapes = [[len(batch) for batch in share] for share in shares]
            else:
                plan = ip.bucket_plan(kept, lengths[kept], [rows, rows // 2 * 2, process_count], (8, 16, 32), seed=3)
                shares = [
                    [(length, ip.process_rows(m, p, process_count)) for length, m in plan(epoch)]
                    for p in range(process_count)
                ]
                seen = [i for share in shares for _, members in share for i in members.tolist() if i >= 0]
                shapes = [[(length, len(members)) for length, members in share] for share in shares]
            # every kept example once, over all processes
            assert sorted(seen) == kept.tolist()
            # one shape per step in every process
            assert all(s == shapes[0] for s in shapes)


def two_process_examples(task, tokenizers, pipeline, batches):
    """The train sources each of two processes' first `batches` batches hold, and the batches' shapes."""
    seen, shapes = [], []
    for process in range(2):
        dataset, _ = ip.train_dataset(task, tokenizers, pipeline, TEXT, process_index=process, process_count=2)
        for step, batch in enumerate(take(dataset, batches)):
            shapes.append((process, step, batch["inputs"].shape, batch["targets"].shape))
            if "inputs_segment_ids" in batch:
                segments = batch["inputs_segment_ids"]
                seen += [
                    tokenizers.source.decode(row[ids == s])
                    for row, ids in zip(batch["inputs"], segments)
                    for s in range(1, ids.max() + 1)
                ]
            else:
                seen += [tokenizers.source.decode(row) for row in batch["inputs"] if row.any()]
    return seen, shapes


@pytest.mark.parametrize("batching", ["pack", "bucket"])
def test_two_processes_together_see_every_training_example_once_per_epoch(copy_task, char_tokenizers, batching):
    pipeline = settings(
        batching=batching, batch_size=4, max_source_length=48, max_target_length=48, bucket_boundaries=(16, 32, 48)
    )
    lengths = TEXT.lengths(copy_task, "train", char_tokenizers)
    # the global plan of epoch 0, as every process makes it
    if batching == "pack":
        order = np.random.default_rng([pipeline.seed, 0]).permutation(len(lengths))
        per_epoch = len(ip.pack_plan(order, lengths, 4, (48, 48)))
    else:
        per_epoch = len(ip.bucket_plan(np.arange(len(lengths)), lengths, 4, (16, 32, 48), pipeline.seed)(0))
    seen, shapes = two_process_examples(copy_task, char_tokenizers, pipeline, per_epoch)
    every = sorted(copy_task.pair(r)[0] for r in copy_task.splits["train"])
    assert sorted(seen) == every
    by_step = collections.defaultdict(set)
    for _, step, *shape in shapes:
        by_step[step].add(tuple(shape))
    # both processes' batches of a step have one shape
    assert all(len(s) == 1 for s in by_step.values())


def test_bucketed_batches_keep_buckets_and_cover_each_epoch():
    lengths = np.array([[n, n] for n in [3, 5, 9, 12, 20, 7, 30, 31, 2, 15, 16, 17]])
    indices = np.arange(len(lengths))
    plans = ip.EpochPlans(ip.bucket_plan(indices, lengths, 2, (8, 16, 32), seed=0))
    # buckets of 4, 4 and 4 examples
    per_epoch = len(lengths) // 2
    epochs = [[plans[e * per_epoch + i] for i in range(per_epoch)] for e in range(2)]
    for batches in epochs:
        assert sorted(np.concatenate([members for _, members in batches]).tolist()) == indices.tolist()
        for length, members in batches:
            assert np.all(lengths[members].max(1) <= length)
            assert np.all(lengths[members].max(1) > {8: 0, 16: 8, 32: 16}[length])
    # reshuffled
    assert [m.tolist() for _, m in epochs[0]] != [m.tolist() for _, m in epochs[1]]


def test_token_batches_hold_the_largest_multiple_of_batch_size_rows_within_the_tokens():
    tokens = settings(batching="bucket", batch_size=8, batch_tokens=4096, max_source_length=96, max_target_length=64)
    # 4096 // 16 = 256 rows; 4096 // 96 = 42 -> 40, a multiple of 8; 1000 > 4096 / 8: at least 8
    assert [tokens.bucket_rows(n) for n in (16, 96, 1000)] == [256, 40, 8]
    # the longer limit caps a bucket
    assert [tokens.padded_length(b) for b in (16, 96, 512)] == [16, 96, 96]
    # batch_tokens 0: batch_size rows
    assert settings(batching="bucket", batch_size=8).bucket_rows(16) == 8


def test_token_batches_have_their_buckets_rows_and_cover_each_epoch(copy_task, char_tokenizers, caplog):
    lengths = np.array([[n, n] for n in [3, 5, 9, 12, 20, 7, 30, 31, 2, 15, 16, 17, 4, 6, 1]])
    indices = np.arange(len(lengths))
    # per boundary, as PipelineSettings.bucket_rows gives them
    rows = {8: 3, 16: 2, 32: 1}
    plan = ip.bucket_plan(indices, lengths, list(rows.values()), tuple(rows), seed=0)
    for epoch in range(2):
        batches = plan(epoch)
        members = np.concatenate([m for _, m in batches])
        # every example once, the remainder too
        assert sorted(members[members >= 0].tolist()) == indices.tolist()
        assert all(len(m) == rows[length] for length, m in batches)
        # the remainder of 7 in 3s: one example, in a batch of 3 rows
        assert (members < 0).sum() == 2
    # the first bucket cannot fill a batch
    plan = ip.bucket_plan(indices, lengths, [8, 2, 1], tuple(rows), seed=0)
    assert sorted(m for _, ms in plan(0) for m in ms.tolist() if m >= 0) == indices.tolist()
    tokens = settings(batching="bucket", batch_size=2, batch_tokens=48, bucket_boundaries=(8, 16, 24))
    for batch in take(ip.train_dataset(copy_task, char_tokenizers, tokens, TEXT)[0], 8):
        longest = max(batch["inputs"].shape[1], batch["targets"].shape[1])
        bucket = min(b for b in (8, 16, 24) if b >= longest)
        # 48 // 8; 48 // 16 = 3 -> 2; 48 // 24
        assert batch["inputs"].shape[0] == {8: 6, 16: 2, 24: 2}[bucket]
        # copies; padding rows are empty
        assert np.all((batch["inputs"] > 0).sum(1) == (batch["targets"] > 0).sum(1))
    # eval batches: 96 // 24 = 4 rows of 24 tokens
    wide = settings(batching="bucket", batch_size=2, batch_tokens=96)
    evaluated = list(ip.eval_batches(copy_task, char_tokenizers, "dev", wide, TEXT)[0])
    # 21 examples
    assert len(evaluated) == 6 and {b["inputs"].shape[0] for b in evaluated} == {wide.eval_rows()} == {4}
    assert sorted(i for b in evaluated for i in b["index"] if i >= 0) == list(range(21))
    with pytest.raises(ConfigError, match="data.batch_tokens"):
        settings(batching="pack", batch_tokens=48)


def test_epoch_plans_concatenate_epochs_of_different_lengths():
    # epoch e has e + 1 items
    plans = ip.EpochPlans(lambda epoch: [(epoch, i) for i in range(epoch + 1)])
    assert [plans[i] for i in range(6)] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    # random access, in any order
    assert plans[3] == (2, 0)


# ------------------------------------------------------------- train batches


@pytest.mark.parametrize("batching", ["pack", "bucket"])
def test_iterator_state_restores_exactly(copy_task, char_tokenizers, batching):
    dataset, _ = ip.train_dataset(copy_task, char_tokenizers, settings(batching=batching), TEXT)
    iterator = iter(dataset)
    for _ in range(7):
        next(iterator)
    state = iterator.get_state()
    # several epochs: reshuffling must restore too
    expected = [next(iterator) for _ in range(30)]
    resumed = iter(dataset)
    resumed.set_state(state)
    for want, got in zip(expected, (next(resumed) for _ in range(30))):
        assert want.keys() == got.keys()
        for key in want:
            np.testing.assert_array_equal(want[key], got[key])


def test_same_seed_same_batches_other_seed_other_batches(copy_task, char_tokenizers):
    first = take(ip.train_dataset(copy_task, char_tokenizers, settings(), TEXT)[0], 3)
    again = take(ip.train_dataset(copy_task, char_tokenizers, settings(), TEXT)[0], 3)
    other = take(ip.train_dataset(copy_task, char_tokenizers, settings(seed=2), TEXT)[0], 3)
    assert all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, again))
    assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(first, other))


def test_two_processes_see_disjoint_examples_covering_the_split(copy_task, char_tokenizers):
    limits = dict(max_source_length=41, max_target_length=41, batching="bucket", bucket_boundaries=(64,))
    kept = len(copy_task.splits["train"])
    seen = []
    for process in range(2):
        dataset, _ = ip.train_dataset(
            copy_task, char_tokenizers, settings(batch_size=2, **limits), TEXT, process_index=process, process_count=2
        )
        rows = [row for batch in take(dataset, kept // 2) for row in decoded_rows(batch, char_tokenizers)]
        # one epoch of this process: each of its examples once
        assert len(set(rows)) == kept // 2
        seen.append(set(rows))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {copy_task.pair(r)[0] for r in copy_task.splits["train"]}


def test_length_limits_drop_or_trim_and_report(copy_task, char_tokenizers):
    lengths = input_kinds.KINDS["text"].lengths(copy_task, "train", char_tokenizers)
    over = int(((lengths[:, 0] > 24) | (lengths[:, 1] > 24)).sum())
    assert over > 0
    _, report = ip.train_dataset(copy_task, char_tokenizers, settings(), TEXT)
    assert report == {"examples": 96, "over_length": over, "policy": "drop"}
    dataset, report = ip.train_dataset(
        copy_task, char_tokenizers, settings(length_policy="trim", batching="bucket"), TEXT
    )
    assert report["policy"] == "trim"
    rows = [row for batch in take(dataset, 30) for row in batch["inputs"]]
    # trimmed, eos kept
    assert max(int((row > 0).sum()) for row in rows) == 24
    assert all(row[(row > 0).sum() - 1] == tk.EOS_ID for row in rows)
    dropped_rows = [
        row
        for batch in take(ip.train_dataset(copy_task, char_tokenizers, settings(batching="bucket"), TEXT)[0], 30)
        for row in batch["inputs"]
    ]
    assert max(int((row > 0).sum()) for row in dropped_rows) <= 24


def test_nothing_within_limits_and_empty_split_are_named(copy_task, char_tokenizers):
    with pytest.raises(ValueError, match="no train example fits max_source_length=2"):
        ip.train_dataset(copy_task, char_tokenizers, settings(max_source_length=2), TEXT)
    empty = Task("empty", {"train": [], "dev": [], "test": []}, "exact_match")
    with pytest.raises(ValueError, match="task empty: the train split is empty"):
        ip.train_dataset(empty, char_tokenizers, settings(), TEXT)
    with pytest.raises(ValueError, match="task empty: the dev split is empty"):
        ip.eval_batches(empty, char_tokenizers, "dev", settings(), TEXT)


# -------------------------------------------------------------- eval batches


def test_eval_batches_hold_every_example_once_in_order(copy_task, char_tokenizers):
    records = copy_task.splits["dev"]
    dataset, _ = ip.eval_batches(
        copy_task, char_tokenizers, "dev", settings(batch_size=4, max_source_length=41, max_target_length=41), TEXT
    )
    batches = list(dataset)
    # ceil(21 / 4)
    assert len(batches) == 6
    index = np.concatenate([b["index"] for b in batches])
    np.testing.assert_array_equal(index, list(range(21)) + [-1, -1, -1])
    rows = [row for b in batches for row in decoded_rows(b, char_tokenizers)]
    assert rows[:21] == [copy_task.pair(r)[0] for r in records]
    assert rows[21:] == ["", "", ""]


@pytest.mark.parametrize(
    "overrides, processes, batches",
    [
        # ceil(21 / 4); the last batch: record 20 and three padding rows, the second process's two all padding
        ({"batch_size": 4}, 2, 6),
        # rows of 2, 2 and 2: ceil(21 / 6)
        ({"batch_size": 6}, 3, 4),
        # with token batching, 192 // 41 = 4 rows (two batch_sizes of 2): an eval batch of 4 rows, 2 a process
        ({"batching": "bucket", "batch_size": 2, "batch_tokens": 192}, 2, 6),
    ],
)
def test_eval_batches_of_several_processes_side_by_side_are_one_processes(
    copy_task, char_tokenizers, overrides, processes, batches
):
    """Each process reads its block of every global batch: the first process's rows, then the next's,
    are the batch one process reads (the same rows summed in the same order), padding included."""
    wide = settings(max_source_length=41, max_target_length=41, **overrides)
    one = list(ip.eval_batches(copy_task, char_tokenizers, "dev", wide, TEXT)[0])
    per_process = [
        list(
            ip.eval_batches(copy_task, char_tokenizers, "dev", wide, TEXT, process_index=p, process_count=processes)[0]
        )
        for p in range(processes)
    ]
    assert [len(b) for b in [one, *per_process]] == [batches] * (1 + processes)
    assert {b["index"].shape[0] for b in one} == {wide.eval_rows()}
    for whole, *blocks in zip(one, *per_process, strict=True):
        assert all(block.keys() == whole.keys() for block in blocks)
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([block[key] for block in blocks]), whole[key], err_msg=key)
    # the last process's share of the last batch (past record 20): padding only
    np.testing.assert_array_equal(per_process[-1][-1]["index"], -1)


def test_eval_batches_that_do_not_split_into_the_processes_are_refused(copy_task, char_tokenizers):
    with pytest.raises(ConfigError, match="an eval batch's 4 rows are not divisible by 3 processes"):
        ip.eval_batches(copy_task, char_tokenizers, "dev", settings(batch_size=4), TEXT, process_count=3)


def test_eval_batch_records_are_disjoint_consecutive_blocks_covering_the_split():
    # 11 records, 3 processes of 2 rows: batches of 6
    blocks = [[list(ip.eval_batch_records(n, 2, p, 3, 11)) for p in range(3)] for n in range(2)]
    assert blocks == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10]]]
    # past the end: nothing
    assert list(ip.eval_batch_records(2, 2, 0, 3, 11)) == []


def test_eval_batches_carry_the_dates_alignment(tmp_path):
    task = tasks.load_task("dates", str(tmp_path), train_size=50, dev_size=10, test_size=10)
    chars = tk.CharTokenizer.train((t for r in task.splits["train"] for t in task.pair(r)), 10**6)
    dataset, _ = ip.eval_batches(
        task,
        tk.Tokenizers(chars, chars),
        "test",
        settings(batch_size=4, max_source_length=48, max_target_length=12),
        TEXT,
    )
    batch = next(iter(dataset))
    assert batch["alignment"].shape == (4, 3, 4)  # [B, fields, (target start, end, source start, end)]
    for row in range(4):
        source, target = task.pair(task.splits["test"][row])
        np.testing.assert_array_equal(batch["alignment"][row, :, 2:], task.splits["test"][row]["alignment"])
        # the year's spans
        (target_start, target_end, start, end) = batch["alignment"][row][0]
        assert target[target_start:target_end] == target[:4]
        assert source[start:end] in (target[:4], target[2:4])
