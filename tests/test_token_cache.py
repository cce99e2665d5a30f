"""Token ids tokenized once beside the built data: read back memory-mapped, rebuilt when of another
format, read straight from the shards, tokenized by a pool of processes like in this one."""

import json
import pickle
import shutil

import numpy as np
import pytest
import tensorflow_datasets as tfds

import tasks
from tasks import token_cache
from tasks import vocabularies as tk


@pytest.fixture(scope="module")
def copy_task(tmp_path_factory):
    # copies of strings over 30 symbols: every source is unique, so examples are identifiable
    return tasks.load_task(
        "copy",
        str(tmp_path_factory.mktemp("data")),
        min_length=3,
        max_length=40,
        vocab_size=30,
        train_size=96,
        dev_size=21,
        test_size=5,
    )


@pytest.fixture(scope="module")
def char_tokenizers(copy_task):
    chars = tk.CharTokenizer.train((t for r in copy_task.splits["train"] for t in copy_task.pair(r)), 10**6)
    return tk.Tokenizers(chars, chars)


def assert_ids_of_every_pair(ids, task, split, tokenizers):
    """`ids` hold each pair's tokens as the tokenizers encode its texts, one at a time (the reference)."""
    records = task.splits[split]
    assert len(ids) == len(records)
    for index in range(len(records)):
        source, target = task.pair(records[index])
        example = ids.example(index, max_source_length=10, max_target_length=64)
        np.testing.assert_array_equal(example["inputs"], [*tokenizers.source.encode(source)[:9], tk.EOS_ID])
        np.testing.assert_array_equal(example["targets"], [*tokenizers.target.encode(target), tk.EOS_ID])


def fresh(task, split, tokenizers):
    """The token ids as a new process gets them (nothing remembered)."""
    token_cache._TOKEN_IDS.clear()
    return token_cache.token_ids(task, split, tokenizers)


def test_tokenized_once_then_read_from_beside_the_built_data(copy_task, char_tokenizers, monkeypatch):
    folder = token_cache.cache_folder(token_cache.shard_ranges(copy_task.splits["dev"]), "dev", char_tokenizers)
    made = fresh(copy_task, "dev", char_tokenizers)
    assert json.loads((folder / "format.json").read_text())["version"] == token_cache.FORMAT_VERSION
    monkeypatch.setattr(tk.CharTokenizer, "encode", lambda *args: pytest.fail("tokenized again"))
    read = fresh(copy_task, "dev", char_tokenizers)
    monkeypatch.undo()
    assert isinstance(read.source, token_cache.IdsFile) and isinstance(read.target_starts, np.memmap)
    # the file as numpy reads it
    whole = np.fromfile(folder / "source.ids", "<i4")
    np.testing.assert_array_equal(read.source[3:40], whole[3:40])
    # the file's end
    np.testing.assert_array_equal(read.source[len(whole) - 5 :], whole[-5:])
    assert len(read.source[7:7]) == 0
    # as a data worker process would get it: opened again
    copied = pickle.loads(pickle.dumps(read.source))
    np.testing.assert_array_equal(copied[0 : len(whole)], whole)
    for ids in (made, read):
        assert_ids_of_every_pair(ids, copy_task, "dev", char_tokenizers)
    other = tk.Tokenizers(*[tk.CharTokenizer("".join(sorted(char_tokenizers.source.chars, reverse=True)))] * 2)
    assert token_cache.cache_folder(token_cache.shard_ranges(copy_task.splits["dev"]), "dev", other) != folder


@pytest.mark.parametrize("damage", ["older version", "other count", "truncated ids", "unreadable format"])
def test_a_cache_of_another_format_or_damaged_is_made_again_not_misread(copy_task, char_tokenizers, damage):
    folder = token_cache.cache_folder(token_cache.shard_ranges(copy_task.splits["test"]), "test", char_tokenizers)
    fresh(copy_task, "test", char_tokenizers)
    meta = json.loads((folder / "format.json").read_text())
    # e.g. the same files, but meant otherwise by version 1
    if damage == "older version":
        (folder / "format.json").write_text(json.dumps({**meta, "version": 1}))
    elif damage == "other count":
        (folder / "format.json").write_text(json.dumps({**meta, "examples": meta["examples"] + 1}))
    elif damage == "truncated ids":
        (folder / "source.ids").write_bytes((folder / "source.ids").read_bytes()[:-4])
    else:
        (folder / "format.json").write_text("{not json")
    assert_ids_of_every_pair(fresh(copy_task, "test", char_tokenizers), copy_task, "test", char_tokenizers)
    # made again, whole
    assert json.loads((folder / "format.json").read_text()) == meta


def test_texts_read_straight_from_the_shards_are_tfds_decoded_ones(copy_task):
    records = copy_task.splits["train"]
    pieces = token_cache.shard_ranges(records)
    pairs = [copy_task.pair(records[i]) for i in range(len(records))]
    assert token_cache.read_texts(pieces, ("source", "target"), 0, len(records)) == pairs
    assert token_cache.read_texts(pieces, ("source", "target"), 7, 30) == pairs[7:30]
    # the stream the vocabulary's sample is read from
    assert list(token_cache.pairs(copy_task, "train")) == pairs
    # a split made of pieces of shards (as TFDS's "train[10:]" would be): records counted from each piece's skip
    split_pieces = [token_cache.ShardRange(pieces[0].path, 10, 20), token_cache.ShardRange(pieces[0].path, 50, 5)]
    assert token_cache.read_texts(split_pieces, ("source", "target"), 15, 23) == pairs[25:30] + pairs[50:53]


def test_a_pool_of_processes_tokenizes_as_this_process_does(copy_task, monkeypatch, tmp_path):
    spm = tk.SentencePieceTokenizer.train(
        (t for r in copy_task.splits["train"] for t in copy_task.pair(r)), 40, "bpe", 10**6
    )
    tokenizers = tk.Tokenizers(spm, spm)
    monkeypatch.setattr(token_cache, "PARALLEL_FROM", 1)
    # 14 chunks, over two processes
    monkeypatch.setattr(token_cache, "CHUNK_EXAMPLES", 7)
    chunks = list(token_cache.encoded_chunks(copy_task, "train", tokenizers))
    assert len(chunks) == 14
    # lengths stand in for starts here
    ids = token_cache.TokenIds(*(np.concatenate(part) for part in zip(*chunks)))
    np.testing.assert_array_equal(
        ids.source_starts, [len(spm.encode(copy_task.pair(r)[0])) for r in copy_task.splits["train"]]
    )
    made = fresh(copy_task, "train", tokenizers)
    assert_ids_of_every_pair(made, copy_task, "train", tokenizers)


def test_records_without_files_are_tokenized_in_memory(copy_task, char_tokenizers):
    listed = tasks.Task("listed", {"dev": list(copy_task.splits["dev"])}, "exact_match")
    assert token_cache.shard_ranges(listed.splits["dev"]) is None
    assert_ids_of_every_pair(fresh(listed, "dev", char_tokenizers), listed, "dev", char_tokenizers)


def test_a_catalog_data_source_is_tokenized_once_beside_its_prepared_data(copy_task, char_tokenizers, monkeypatch):
    # a prepared TFDS dataset read as the catalog reads one: a data source without our Records wrapper
    folder = token_cache.shard_ranges(copy_task.splits["dev"])[0].path.rsplit("/", 1)[0]
    source = tfds.builder_from_directory(folder).as_data_source()["dev"]
    catalog = tasks.Task("wmt_like/de-en", {"dev": source}, "bleu")
    assert token_cache.shard_ranges(source) == token_cache.shard_ranges(copy_task.splits["dev"])
    shutil.rmtree(
        token_cache.cache_folder(token_cache.shard_ranges(source), "dev", char_tokenizers), ignore_errors=True
    )
    assert_ids_of_every_pair(fresh(catalog, "dev", char_tokenizers), catalog, "dev", char_tokenizers)
    monkeypatch.setattr(tk.CharTokenizer, "encode", lambda *args: pytest.fail("tokenized again"))
    # kept: read back by the next run
    assert isinstance(fresh(catalog, "dev", char_tokenizers).source, token_cache.IdsFile)
